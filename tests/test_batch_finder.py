"""The batch finder (tune.batch.choice, tune.batch.probe): the largest micro-batch that fits a
memory budget and the accumulation that keeps the global batch, on fake footprints (exact
answers), on a real tiny model (the chosen size's measured step fits, the next does not), through
the engine's micro-batches (the same gradient as the whole batch), the CLI, and 2 ranks."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import run_two_ranks
from torch import nn

from torchturbo import Turbo, TurboConfig
from torchturbo.cli import main
from torchturbo.recipe import load_recipe
from torchturbo.reliability.oom import MemoryBudgetError, split_batch
from torchturbo.tune.batch.choice import largest_fit, micro_sizes, plan
from torchturbo.tune.batch.probe import apply_choice, find_batch, step_footprint
from torchturbo.tune.report.document import build_blocks, render_markdown

TINY = str(Path(__file__).parent / "recipes" / "tiny.py") + ":recipe"
SCRIPT = Path(__file__).parent / "scripts" / "batch_finder_ranks.py"
TIMEOUT_S = 120  # a collective waiting for a peer must fail the test, not stall the suite


def linear(fixed: int, per_sample: int, budget: int, calls: list[int] | None = None):
    """A fake step footprint: ``fixed`` + ``per_sample`` x size, checked against ``budget``."""

    def fits(size: int) -> tuple[bool, int]:
        if calls is not None:
            calls.append(size)
        used = fixed + per_sample * size
        return used <= budget, used

    return fits


def brute_force(fits, sizes: list[int]) -> int:
    return max((s for s in sizes if fits(s)[0]), default=0)


@pytest.mark.parametrize("batch", [1, 7, 8, 48, 50, 64, 97, 256])
@pytest.mark.parametrize("room", [0, 1, 3, 20, 63, 300])
def test_the_search_finds_the_largest_fitting_size_exactly(batch, room):
    budget = 1000 + 10 * room
    calls: list[int] = []
    found = largest_fit(linear(1000, 10, budget, calls), micro_sizes(batch), budget, start=batch)
    assert found.size == brute_force(linear(1000, 10, budget), micro_sizes(batch))
    assert len(calls) == len(set(calls)) <= 4  # each size once; the line lands on the answer


@pytest.mark.parametrize("batch", [10, 64, 100])
@pytest.mark.parametrize("budget", [1100, 1500, 2600, 4000])
def test_the_search_stays_exact_where_the_line_is_wrong(batch, budget):
    # Allocator rounding: memory grows in 8-sample blocks, and a workspace appears above 32.
    def stepped(size: int) -> tuple[bool, int]:
        used = 1000 + 80 * math.ceil(size / 8) + (600 if size > 32 else 0)
        return used <= budget, used

    sizes = micro_sizes(batch)
    found = largest_fit(stepped, sizes, budget, start=batch)
    assert found.size == brute_force(stepped, sizes)


def test_a_batch_that_fits_is_measured_once_and_left_alone():
    calls: list[int] = []
    chosen = plan(linear(1000, 10, 5000, calls), recipe_batch=64, budget_bytes=5000, world_size=2)
    assert calls == [64]
    assert (chosen.micro_batch, chosen.micro_batches) == (64, 1)
    assert chosen.planned_global_batch == chosen.global_batch == 128


def test_an_indivisible_batch_keeps_its_global_batch_in_unequal_pieces():
    chosen = plan(linear(1000, 10, 1200, None), recipe_batch=50, budget_bytes=1200, world_size=2)
    assert chosen.fit == 17  # pieces of 50 can be 17 (x3), not 20
    assert (chosen.micro_batch, chosen.micro_batches) == (17, 3)
    # 17 + 17 + 16 samples: the global batch is the user's, to the sample.
    assert [len(p) for p in torch.arange(50).tensor_split(chosen.micro_batches)] == [17, 17, 16]
    assert chosen.planned_global_batch == chosen.global_batch == 100
    assert "do not divide by 3" in " ".join(chosen.notes)
    assert "17 x 2 + 16 x 1 accumulated = batch 50 x 2 processes = global batch 100 (kept)" in (
        chosen.summary()
    )


def test_a_divisible_batch_is_cut_into_equal_micro_batches():
    chosen = plan(linear(1000, 10, 1200, None), recipe_batch=48, budget_bytes=1200)
    assert (chosen.micro_batch, chosen.micro_batches, chosen.planned_global_batch) == (16, 3, 48)
    assert "micro-batch 16 x 3 accumulated = global batch 48 (kept)" in chosen.summary()
    assert not any("divide" in note for note in chosen.notes)


def test_a_budget_below_one_sample_is_a_one_line_error():
    with pytest.raises(MemoryBudgetError, match="below one sample: a micro-batch of 1 sample "):
        plan(linear(1000, 10, 900, None), recipe_batch=16, budget_bytes=900)
    with pytest.raises(MemoryBudgetError, match="the recipe's batch of 1 sample cannot be split"):
        plan(linear(1000, 10, 900, None), recipe_batch=1, budget_bytes=900)


def test_max_grows_the_batch_and_states_the_learning_rate_rule_without_applying_it():
    budget = 1000 + 10 * 200
    adam = plan(linear(1000, 10, budget), recipe_batch=16, budget_bytes=budget, mode="max", grow=16)
    assert (adam.fit, adam.micro_batch, adam.micro_batches) == (200, 200, 1)
    assert (adam.global_batch, adam.planned_global_batch) == (16, 200)
    notes = " ".join(adam.notes)
    assert "square-root rule" in notes and f"lr x {math.sqrt(200 / 16):.3g}" in notes
    sgd = plan(
        linear(1000, 10, budget), recipe_batch=16, budget_bytes=budget, mode="max", optimizer="SGD"
    )
    assert "for SGD, the linear rule (SGD-style): lr x 12.5" in " ".join(sgd.notes)
    # Bounded by grow (the dataset): doubling stops there.
    capped = plan(linear(1000, 10, 10**9), recipe_batch=16, budget_bytes=10**9, mode="max", grow=4)
    assert capped.fit == 64


def test_max_keeps_the_global_batch_when_the_recipe_batch_does_not_fit():
    chosen = plan(linear(1000, 10, 1200), recipe_batch=64, budget_bytes=1200, mode="max")
    assert (chosen.micro_batch, chosen.micro_batches, chosen.planned_global_batch) == (16, 4, 64)
    assert "kept by micro-batching rather than shrunk" in " ".join(chosen.notes)


def _gradients(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def test_micro_batches_give_the_whole_batch_gradient():
    recipe = load_recipe(TINY)
    images, labels = next(iter(torch.utils.data.DataLoader(recipe.dataset, batch_size=8)))
    runs = {}
    for pieces in (1, 3):
        model, optimizer = recipe.build()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # keep the gradients to read
        config = TurboConfig(device="cpu").replace(accumulation__micro_batches=pieces)
        turbo = Turbo(config)
        model, optimizer, _ = turbo.setup(model, optimizer)
        optimizer.zero_grad = lambda set_to_none=True: None  # read them after the step
        metrics = turbo.step(recipe.loss_fn, (images, labels))
        runs[pieces] = (_gradients(model), metrics.micro_batches)
    assert runs[3][1] == 3 and runs[1][1] == 1
    # fp32 sums in another order: agreement to rounding.
    for whole, pieced in zip(runs[1][0], runs[3][0], strict=True):
        torch.testing.assert_close(pieced, whole, rtol=1e-5, atol=1e-7)
    # Negative control: averaging the 3 pieces' mean losses (3, 3 and 2 samples) is another
    # gradient, which the same comparison tells apart.
    model, _ = recipe.build()
    pieces = split_batch((images, labels), 3)
    loss = sum(recipe.loss_fn(model, piece) for piece in pieces) / len(pieces)
    loss.backward()
    naive = _gradients(model)
    with pytest.raises(AssertionError):
        for whole, wrong in zip(runs[1][0], naive, strict=True):
            torch.testing.assert_close(wrong, whole, rtol=1e-5, atol=1e-7)


def test_on_a_real_model_the_chosen_micro_batch_fits_and_the_next_does_not():
    recipe, config = load_recipe(TINY), TurboConfig(device="cpu")
    three, four = step_footprint(recipe, config, 3), step_footprint(recipe, config, 4)
    assert three is not None and four is not None and three < four
    budget = (three + four) // 2
    chosen = find_batch(recipe, budget, config=config)
    assert (chosen.micro_batch, chosen.micro_batches) == (3, 3)  # 8 samples as 3 + 3 + 2
    assert chosen.planned_global_batch == chosen.global_batch == recipe.batch_size
    measured = {p.size: p for p in chosen.probes}
    assert measured[3].bytes == three <= budget and measured[3].fits
    assert measured[4].bytes == four > budget and not measured[4].fits
    # The config it writes trains in those micro-batches, and its footprint is the finder's.
    written = apply_choice(config, chosen)
    assert written.accumulation.micro_batches == 3
    from torchturbo.trials.trial import fixed_batches, start_trial

    trial, _ = start_trial(recipe, written, fixed_batches(recipe, 1))
    assert trial.memory_footprint()[0] == three
    trial.close()


def test_the_report_shows_the_finder_choice_and_every_size_measured():
    chosen = plan(linear(1000, 10, 1200), recipe_batch=50, budget_bytes=1200)
    text = render_markdown(build_blocks({"recipe": "r", "batch": chosen.to_dict()}, ()))
    assert "## Batch for the budget" in text
    assert "| 17 | 1.1 KiB | yes |" in text and "| 50 | 1.5 KiB | no |" in text
    assert "do not divide by 3" in text


@pytest.mark.slow  # the whole tuner, its facts and report included: about 30 s on 2 cores
def test_tune_find_batch_writes_the_micro_batches_into_turbo_toml(tmp_path, capsys, monkeypatch):
    from torchturbo.tune.search import run as search

    recipe, config = load_recipe(TINY), TurboConfig(device="cpu")
    budget = step_footprint(recipe, config, 4)
    no_candidates = {"none": lambda context: []}
    monkeypatch.setattr(search, "tune", functools.partial(search.tune, stages=no_candidates))
    out = tmp_path / "report"
    argv = ["tune", TINY, "--device", "cpu", "--skip", "data_loader", "--out", str(out)]
    argv += ["--time-budget", "30s", "--memory-budget", f"{budget}B", "--find-batch"]
    assert main(argv) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "micro-batch 4 x 2 accumulated = global batch 8 (kept)" in printed
    assert TurboConfig.load(out / "turbo.toml").accumulation.micro_batches == 2
    results = json.loads((out / "results.json").read_text())
    # One figure, one measurement: the baseline trained in those micro-batches and its
    # footprint is the one the finder measured for them.
    assert results["candidates"][0]["memory_bytes"] == results["batch"]["micro_bytes"] == budget
    assert "Batch for the budget" in (out / "report.md").read_text()


def test_find_batch_without_a_budget_is_a_one_line_error_on_a_cpu(capsys):
    assert main(["tune", TINY, "--device", "cpu", "--find-batch"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "torchturbo tune: error: --find-batch needs --memory-budget on a CPU (give the memory a "
        "step may use, e.g. --memory-budget 8GiB); on a GPU it defaults to 90% of the GPU's "
        "memory\n"
    )


def test_on_a_gpu_find_batch_fills_most_of_its_memory_by_default(monkeypatch):
    from torchturbo.tune.search import run as search

    monkeypatch.setattr(search, "memory_capacity", lambda device: 100 * 2**30)
    gpu = torch.device("cuda")  # a device object: no GPU is asked anything
    assert search.batch_budget(None, gpu) == 90 * 2**30
    assert search.batch_budget(2**30, gpu) == 2**30  # --memory-budget wins


def test_a_budget_below_one_sample_on_the_cli_is_one_line(tmp_path, capsys):
    argv = ["tune", TINY, "--device", "cpu", "--memory-budget", "1KiB", "--find-batch"]
    assert main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("torchturbo tune: error: --memory-budget 1.0 KiB is below one sample")
    assert err.count("\n") == 1


@pytest.mark.slow
def test_two_ranks_with_different_budgets_agree_on_the_smaller_fit(tmp_path):
    (rank0, rank1), _ = run_two_ranks(SCRIPT, tmp_path, TIMEOUT_S)
    assert rank0["budget"] == rank0["four"] and rank1["budget"] == rank1["two"] < rank0["budget"]
    # Alone, rank 0 would run micro-batches of 4; together both take rank 1's fit, 2.
    plans = [rank0["plan"], rank1["plan"]]
    assert plans[0] == plans[1]
    assert (plans[0]["micro_batch"], plans[0]["micro_batches"]) == (2, 4)
    assert plans[0]["budget_bytes"] == rank1["budget"]  # the smallest budget is reported
    # micro x accumulation x ranks == the user's global batch (8 per process, 2 processes).
    assert plans[0]["micro_batch"] * plans[0]["micro_batches"] * 2 == 16
    assert plans[0]["planned_global_batch"] == plans[0]["global_batch"] == 16
