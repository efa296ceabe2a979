"""trials.trial.Trial: fixed data and a private RNG stream per trial, so interleaved trials of one
configuration train identically (dropout included)."""

from __future__ import annotations

import torch
from conftest import MLP, classification_loss

from torchturbo.config import TurboConfig
from torchturbo.engine import Turbo
from torchturbo.recipe import Recipe
from torchturbo.trials.trial import Trial, fixed_batches


def dropout_recipe() -> Recipe:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(64, 16, generator=generator)
    return Recipe(
        name="dropout-mlp",
        model=lambda: MLP(dropout=0.5),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        loss_fn=classification_loss,
        dataset=torch.utils.data.TensorDataset(inputs, (inputs[:, 0] > 0).long()),
        batch_size=8,
    )


def test_interleaved_trials_draw_the_same_dropout_masks():
    recipe = dropout_recipe()
    batches = fixed_batches(recipe, 4)
    first, second = (Trial(recipe, TurboConfig(device="cpu"), batches) for _ in range(2))
    for _ in range(6):
        first.step()
        torch.rand(100)  # other work between the trials' steps draws from the global stream
        second.step()
    assert first.loss_curve() == second.loss_curve()
    assert len(set(first.loss_curve())) > 1


def test_without_private_streams_interleaved_engines_see_different_masks():
    """The negative control: the same two runs on the global RNG stream diverge at once."""
    recipe = dropout_recipe()
    batches = fixed_batches(recipe, 4)
    runs = []
    for _ in range(2):
        turbo = Turbo(TurboConfig(device="cpu"))
        model, optimizer = recipe.build()
        turbo.setup(model, optimizer)
        runs.append(turbo)
    losses = [
        [float(turbo.step(recipe.loss_fn, batch).loss) for turbo in runs] for batch in batches
    ]
    assert all(a != b for a, b in losses)


def test_a_trial_aligned_with_another_takes_the_same_next_batch_without_training():
    recipe = dropout_recipe()
    batches = fixed_batches(recipe, 4)
    ahead, behind = (Trial(recipe, TurboConfig(device="cpu"), batches) for _ in range(2))
    for _ in range(7):
        ahead.step()
    behind.step()
    weights = [p.detach().clone() for p in behind.model.parameters()]
    behind.align_with(ahead)
    assert behind.position % 4 == ahead.position % 4 == 3
    assert all(torch.equal(a, b) for a, b in zip(weights, behind.model.parameters(), strict=True))
    other = Trial(recipe, TurboConfig(device="cpu"), fixed_batches(recipe, 4))
    other.align_with(ahead)  # different batch lists: nothing to align
    assert other.position == 0


def test_bench_trains_a_bucketing_config_on_length_buckets_and_says_what_it_left_out():
    from torchturbo.trials.variants import compare_configs
    from torchturbo.workloads import get_workload

    recipe = get_workload("text", num_samples=256, d_model=64, num_layers=1)
    bucketing = TurboConfig(device="cpu").replace(data__batches="buckets", data__num_workers=2)
    rows = compare_configs(
        recipe,
        {"baseline": TurboConfig(device="cpu"), "buckets": bucketing},
        baseline="baseline",
        warmup=1,
        repeats=2,
        steps_per_repeat=1,
        num_batches=4,
    )
    plain, buckets = rows
    # Long-tailed lengths: random batches are mostly padding, length buckets hardly any.
    assert plain.padding > 0.4 and buckets.padding < 0.15
    assert buckets.loss_first != plain.loss_first  # other batches, not the same padded ones
    assert "num_workers=2" in buckets.notes["loader settings"]
    assert buckets.to_dict()["padding"] == buckets.padding


def test_an_accumulation_window_longer_than_the_run_is_named_not_hidden():
    from torchturbo.trials.variants import compare_configs

    recipe = dropout_recipe()
    configs = {
        "baseline": TurboConfig(device="cpu"),
        "long window": TurboConfig(device="cpu").replace(accumulation__steps=64),
        "short window": TurboConfig(device="cpu").replace(accumulation__steps=2),
    }
    rows = compare_configs(
        recipe, configs, baseline="baseline", warmup=1, repeats=2, steps_per_repeat=1
    )
    baseline, long_window, short_window = rows
    assert "no optimizer step in" in long_window.notes["accumulation"]
    assert "accumulation" not in short_window.notes and "accumulation" not in baseline.notes


def test_trial_batches_span_the_epochs_padded_lengths():
    """A long-tailed text dataset: steps cost about the square of their padded length, and the
    first four batches of a shuffle put the trial's step anywhere from 0.4x to 2x the job's.
    The representative batches are full rows of the user's batch size whose costs average
    near the epoch's, whatever the seed."""
    from torchturbo.trials.trial import representative_batches

    generator = torch.Generator().manual_seed(0)
    lengths = [int(n) for n in (torch.randn(2048, generator=generator) * 0.7).exp().mul(40)]
    lengths = [min(max(n, 2), 512) for n in lengths]
    dataset = [{"input_ids": torch.ones(n, dtype=torch.long)} for n in lengths]

    def cost(length: int) -> float:
        return length * length

    for seed in range(4):
        recipe = Recipe(
            name="long-tailed",
            model=lambda: torch.nn.Linear(1, 1),
            optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
            loss_fn=lambda model, batch: batch["input_ids"].float().mean(),
            dataset=dataset,
            batch_size=16,
            lengths=lengths,
            seed=seed,
        )
        order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed))
        rows = order[: len(order) // 16 * 16].view(-1, 16).tolist()
        epoch = sum(cost(max(lengths[i] for i in row)) for row in rows) / len(rows)
        picked = representative_batches(recipe, 8)
        assert [b["input_ids"].shape[0] for b in picked] == [16] * 8
        widths = [b["input_ids"].shape[1] for b in picked]
        assert widths == sorted(widths) and len(set(widths)) > 4
        assert 0.75 < sum(cost(w) for w in widths) / len(widths) / epoch < 1.1
