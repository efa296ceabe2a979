"""The tuner: decision rules with injected numbers, and real tune runs on a tiny recipe."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from conftest import ConvNet, classification_loss

from torchturbo.bench import fixed_batches, start_trial
from torchturbo.config import TurboConfig
from torchturbo.recipe import Recipe
from torchturbo.tune import search
from torchturbo.tune.decide import Parity, Verdict, break_even_steps, judge, loss_parity
from torchturbo.tune.search import TuneOptions, tune
from torchturbo.tune.stages import Candidate, StageContext, bucket_stage, comm_hook_stage

OK_PARITY = Parity(2.3, 2.31, 0.004, True, True)


def _judge(**overrides):
    args = dict(
        ratio=1.5,
        noise=0.03,
        parity=OK_PARITY,
        memory_bytes=100,
        memory_budget=None,
        break_even=10.0,
        planned_steps=1000,
        tolerance=0.05,
    )
    args.update(overrides)
    return judge(**args)


def test_a_clear_speedup_is_adopted():
    verdict = _judge()
    assert verdict.adopt and "1.50x" in verdict.reason


@pytest.mark.parametrize(("ratio", "noise", "adopt"), [(1.04, 0.05, False), (1.06, 0.05, True)])
def test_speedups_inside_the_noise_band_are_rejected(ratio, noise, adopt):
    assert _judge(ratio=ratio, noise=noise).adopt is adopt


def test_the_noise_band_has_a_floor():
    assert not _judge(ratio=1.015, noise=0.0).adopt


def test_parity_failure_is_rejected_with_the_numbers():
    parity = loss_parity([2.3, 2.2], [2.9, 2.8], tolerance=0.05)
    assert not parity.ok
    verdict = _judge(parity=parity)
    assert not verdict.adopt and "loss parity" in verdict.reason and "2.8500" in verdict.reason


def test_non_finite_loss_is_rejected():
    parity = loss_parity([2.3, 2.2], [2.3, math.nan], tolerance=0.05)
    assert not parity.finite
    assert "non-finite" in _judge(parity=parity).reason


def test_memory_over_budget_is_rejected():
    verdict = _judge(memory_bytes=3 * 2**20, memory_budget=2**20)
    assert not verdict.adopt and "3 MiB > budget 1 MiB" in verdict.reason


def test_a_one_time_cost_that_never_pays_back_is_rejected():
    assert break_even_steps(30.0, 0.10, 0.09) == pytest.approx(3000)
    assert break_even_steps(30.0, 0.10, 0.11) == math.inf
    assert break_even_steps(0.0, 0.10, 0.11) == 0
    verdict = _judge(break_even=3000.0, planned_steps=1000)
    assert not verdict.adopt and "3,000 steps" in verdict.reason
    assert _judge(break_even=3000.0, planned_steps=5000).adopt


def test_memory_candidates_may_be_slower_when_the_best_does_not_fit():
    verdict = _judge(ratio=0.8, must_be_faster=False)
    assert verdict.adopt and "fits the memory budget" in verdict.reason


def tiny_recipe(**overrides) -> Recipe:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 16, 16, generator=generator)
    y = (x[:, 0].mean(dim=(1, 2)) > 0).long()
    args = dict(
        name="tiny",
        model=ConvNet,
        optimizer=lambda params: torch.optim.Adam(params, lr=1e-2),
        loss_fn=classification_loss,
        dataset=torch.utils.data.TensorDataset(x, y),
        batch_size=8,
    )
    args.update(overrides)
    return Recipe(**args)


QUICK = TuneOptions(time_budget_s=60, device="cpu", warmup=1, repeats=2, confirm_repeats=2)


def test_tune_runs_the_stages_and_reports_every_candidate():
    config, results = tune(tiny_recipe(), QUICK, stages=_only("precision", "memory_format"))
    assert isinstance(config, TurboConfig)
    names = [c["name"] for c in results["candidates"]]
    assert names == ["fp32 eager", "tf32", "bf16", "fp16+scaler", "channels_last"]
    for row in results["candidates"]:
        assert row["verdict"] in {"adopted", "kept", "rejected", "skipped"} and row["reason"]
    assert results["confirmed_ratio"] > 0
    assert [s["stage"] for s in results["stages"]] == ["data_loader", "precision", "memory_format"]
    assert results["loader"]["verdict"] in {"input-bound", "compute-bound"}
    assert TurboConfig.from_toml(config.to_toml()) == config


def test_a_candidate_that_raises_is_rejected_and_the_run_goes_on():
    def broken_model():
        raise RuntimeError("this op has no bf16 kernel")

    def stage(ctx):
        return [
            Candidate("explodes", ctx.best, recipe=tiny_recipe(model=broken_model)),
            Candidate("bf16", ctx.best.replace(precision__dtype="bf16")),
        ]

    _, results = tune(tiny_recipe(), QUICK, stages={"injected": stage})
    rows = {c["name"]: c for c in results["candidates"][1:]}
    assert rows["explodes"]["verdict"] == "rejected"
    assert "RuntimeError: this op has no bf16 kernel" in rows["explodes"]["reason"]
    assert rows["bf16"]["verdict"] in {"adopted", "rejected"} and rows["bf16"]["ratio"]


def test_a_candidate_that_breaks_loss_parity_is_rejected():
    def wrong_loss(model, batch):  # a "technique" that silently changes what is optimized
        return 3.0 * classification_loss(model, batch)

    def stage(ctx):
        return [Candidate("wrong", ctx.best, recipe=tiny_recipe(loss_fn=wrong_loss))]

    _, results = tune(tiny_recipe(), QUICK, stages={"injected": stage})
    _, row = results["candidates"]
    assert row["verdict"] == "rejected" and row["reason"].startswith("loss parity")
    assert row["parity"]["relative_diff"] > 1.0
    assert results["adopted"] == []


def test_later_candidates_train_on_the_batches_an_earlier_stage_adopted(monkeypatch):
    recipe = tiny_recipe()
    special = fixed_batches(recipe, 4, seed=123)  # e.g. length buckets or micro-batches
    trained_on = []

    def recording_start(recipe, config, batches):
        trained_on.append(batches)
        return start_trial(recipe, config, batches)

    monkeypatch.setattr(search, "start_trial", recording_start)
    monkeypatch.setattr(search, "judge", lambda **_: Verdict(adopt=True, reason="forced"))
    stages = {
        "batching": lambda ctx: [Candidate("special batches", ctx.best, batches=special)],
        "next": lambda ctx: [Candidate("tf32", ctx.best.replace(precision__dtype="tf32"))],
    }
    _, results = tune(recipe, QUICK, stages=stages)
    assert results["adopted"] == ["special batches", "tf32"]
    assert trained_on[-1] is special  # not the baseline's batches


def test_an_exhausted_time_budget_skips_candidates():
    options = dataclasses.replace(QUICK, time_budget_s=0.001)
    _, results = tune(tiny_recipe(), options, stages=_only("precision"))
    assert {c["verdict"] for c in results["candidates"][1:]} == {"skipped"}
    # Nothing adopted: the best is the baseline itself, not a noisy re-measurement of it.
    assert results["confirmed_ratio"] == 1.0
    confirmation = results["confirmation"]
    assert confirmation["best_step_ms"] == confirmation["baseline_step_ms"]


def _only(*names):
    from torchturbo.tune.stages import STAGES

    return {name: STAGES[name] for name in names}


def test_over_the_memory_budget_the_memory_stage_tries_checkpointing_and_micro_batches():
    options = dataclasses.replace(QUICK, memory_budget=1)  # nothing fits: every candidate tried
    _, results = tune(tiny_recipe(), options, stages=_only("memory"))
    names = [c["name"] for c in results["candidates"][1:]]
    assert names[:2] == ["checkpointing:full", "checkpointing:every_2nd"]
    assert "micro-batch 4 x2" in names
    assert all(c["verdict"] == "rejected" and c["reason"] for c in results["candidates"][1:])


def _ddp_context(recipe, world_size=2):
    return StageContext(
        recipe=recipe,
        best=TurboConfig(device="cpu"),
        device=torch.device("cpu"),
        has_convolutions=False,
        best_memory_bytes=None,
        memory_budget=None,
        world_size=world_size,
        backend="gloo",
    )


def test_ddp_stages_need_torchrun_and_try_only_bucket_sizes_that_change_the_buckets():
    assert "torchrun" in comm_hook_stage(_ddp_context(tiny_recipe(), world_size=1))
    hooks = [c.name for c in comm_hook_stage(_ddp_context(tiny_recipe()))]
    assert hooks == ["comm_hook:fp16", "comm_hook:powersgd"]  # no bf16 on gloo
    # A few KiB of gradients fit one bucket at 5, 25 and 100 MiB alike.
    assert "changes nothing" in bucket_stage(_ddp_context(tiny_recipe()))
    wide = tiny_recipe(model=lambda: torch.nn.Linear(2048, 2048))  # 16 MiB of gradients
    caps = [c.config.distributed.bucket_cap_mb for c in bucket_stage(_ddp_context(wide))]
    assert caps == [5.0]  # 100 MiB would hold them in one bucket, as 25 MiB does
