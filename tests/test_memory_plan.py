"""The memory estimate before launch, the knapsack over blocks and the memory planner."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
import torch
from conftest import MLP, classification_loss
from test_tune import QUICK, tiny_recipe

from torchturbo.config import CheckpointConfig, ConfigError, TurboConfig
from torchturbo.measure.footprint import BlockMemory, Line, MemoryEstimate, describe
from torchturbo.recipe import Recipe
from torchturbo.techniques.checkpointing import select_blocks
from torchturbo.techniques.framework.decide import Verdict
from torchturbo.techniques.framework.proposal import Candidate
from torchturbo.trials.memory_estimate import estimate_memory, estimate_recipe_memory
from torchturbo.trials.trial import Trial, fixed_batches
from torchturbo.tune.memory.knapsack import cheapest_cover
from torchturbo.tune.memory.plan import (
    CompiledGraph,
    budget_plans,
    footprint,
    plan_config,
    plans,
)
from torchturbo.tune.search import candidate as candidate_module
from torchturbo.tune.search import fastest_fit as fastest_fit_module
from torchturbo.tune.search.run import tune
from torchturbo.tune.search.stages import tuner_stages


def _brute_force(items, need):
    best = None
    for size in range(len(items) + 1):
        for chosen in itertools.combinations(range(len(items)), size):
            if sum(items[i][1] for i in chosen) >= need:
                cost = sum(items[i][0] for i in chosen)
                if best is None or (cost, len(chosen)) < (best[1], len(best[0])):
                    best = (chosen, cost)
    return best


def test_the_knapsack_finds_the_cheapest_cover_exactly():
    rng = random.Random(0)
    for _ in range(300):
        items = [(rng.choice([0.5, 1.0, 2.0, 3.5]), rng.randint(0, 40)) for _ in range(7)]
        need = rng.randint(-5, 150)
        got, want = cheapest_cover(items, need), _brute_force(items, need)
        if want is None:
            assert got is None
            continue
        assert got is not None
        assert got[1] == pytest.approx(want[1]) and len(got[0]) == len(want[0])
        assert sum(items[i][1] for i in got[0]) >= need


def test_the_knapsack_prefers_cheap_blocks_not_the_first_or_every_second():
    # Block 0 frees a lot but is slow to recompute; 1 and 2 together free enough for less.
    items = [(10.0, 100), (1.0, 60), (2.0, 50), (1.0, 5)]
    assert cheapest_cover(items, 100) == ((1, 2), 3.0)
    assert cheapest_cover(items, 0) == ((), 0.0)
    assert cheapest_cover(items, 1000) is None


def _mlp_recipe(batch_size: int = 8) -> Recipe:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=generator)
    return Recipe(
        name="mlp",
        model=lambda: MLP(width=16, depth=4),
        optimizer=lambda params: torch.optim.Adam(params, lr=1e-2),
        loss_fn=classification_loss,
        dataset=torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long() % 5),
        batch_size=batch_size,
    )


class _FixedMask(torch.nn.Module):
    """Saves a tensor that does not grow with the batch (as a causal mask does)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(
            *[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU()) for _ in range(2)]
        )
        self.scale = torch.nn.Parameter(torch.ones(16, 16))
        self.head = torch.nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = torch.randn(256, 16) * 2  # 16 KiB saved by the matmul, whatever the batch
        return self.head(self.blocks(x + (table @ self.scale).sum(0)))


@pytest.mark.parametrize("model", ["mlp", "fixed", "conv"])
def test_the_estimate_matches_the_measured_footprint_and_splits_it(model):
    recipe = {
        "mlp": _mlp_recipe(16),
        "fixed": dataclasses.replace(_mlp_recipe(16), model=_FixedMask),
        "conv": tiny_recipe(),
    }[model]
    batches = fixed_batches(recipe, 1)
    estimate = estimate_recipe_memory(recipe, batches[0])
    trial = Trial(recipe, TurboConfig(device="cpu"), batches)
    try:
        trial.step()
        measured, _ = trial.memory_footprint()
        activations = trial.activation_bytes()
    finally:
        trial.close()
    assert measured is not None and activations is not None
    # Exact on CPU, where both count the same parts: the bar is 20%.
    assert abs(estimate.total_bytes / measured - 1) < 0.01
    assert estimate.activation_bytes() == pytest.approx(activations, rel=0.01)
    parameters = sum(p.numel() * 4 for p in trial.model.parameters())
    assert estimate.weights_bytes == estimate.gradients_bytes == parameters
    assert estimate.optimizer_bytes >= 2 * parameters  # Adam: two moments (+ steps)
    assert any(b.checkpointable for b in estimate.blocks)
    assert estimate.largest and estimate.largest[0].bytes >= estimate.largest[-1].bytes
    assert "memory estimate" in next(describe(estimate))


def test_what_does_not_grow_with_the_batch_is_the_fixed_part():
    recipe = dataclasses.replace(_mlp_recipe(16), model=_FixedMask)
    estimate = estimate_recipe_memory(recipe, fixed_batches(recipe, 1)[0])
    top = next(b for b in estimate.blocks if b.name.startswith("(top level"))
    assert top.held.fixed == pytest.approx(256 * 16 * 4, rel=0.01)  # the table, once
    blocks = [b for b in estimate.blocks if b.checkpointable]
    assert all(abs(b.held.fixed) < 64 for b in blocks)  # per-sample activations only


def test_an_unknown_block_name_is_a_clear_error():
    with pytest.raises(ValueError, match=r"no module named 'blocks\.9'.*its blocks are blocks\.0"):
        select_blocks(MLP(), CheckpointConfig(mode="selective", blocks=("blocks.9",)))
    chosen = select_blocks(MLP(), CheckpointConfig(mode="selective", blocks=("blocks.2", "head")))
    assert [n for n, _ in chosen] == ["blocks.2", "head"]
    with pytest.raises(ConfigError, match="blocks names the modules outright"):
        CheckpointConfig(mode="selective", blocks=("blocks.0",), every_n=2)
    with pytest.raises(ValueError, match="no module named"):
        estimate_memory(_mlp_recipe(), torch.zeros(8, 16), ["nope"])


class _Wide(torch.nn.Module):
    """Blocks with a wide hidden layer inside: what checkpointing frees."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(
            *[
                torch.nn.Sequential(
                    torch.nn.Linear(16, 256), torch.nn.ReLU(), torch.nn.Linear(256, 16)
                )
                for _ in range(4)
            ]
        )
        self.head = torch.nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def _synthetic(batch: int = 8) -> MemoryEstimate:
    """Four blocks of 8 MiB each at batch 8 (1 MiB a sample), the first slow to recompute."""
    mib = 2**20
    blocks = tuple(
        BlockMemory(
            name=f"layers.{i}",
            type_name="Wide" if i == 0 else "Layer",
            checkpointable=True,
            held=Line(0.0, mib),
            freeable=Line(0.0, 0.75 * mib),
            compressible=((0.5 * mib, True), (0.5 * mib, False)),
            forward_s=0.05 if i == 0 else 0.01,
        )
        for i in range(4)
    )
    return MemoryEstimate(
        batch_size=batch,
        slices=(2, 4),
        weights_bytes=mib,
        gradients_bytes=mib,
        optimizer_bytes=2 * mib,
        blocks=blocks,
    )


def test_every_plan_should_fit_and_none_carries_a_knob_it_does_not_need():
    estimate = _synthetic()
    assert footprint(estimate, (), 1, False) == 36 * 2**20
    budget = 30 * 2**20  # 6 MiB to free: one block frees 6 MiB
    found = plans(estimate, budget)
    assert found
    for plan in found:
        assert plan.estimated_bytes <= budget
        assert not any(other.dominates(plan) for other in found)
    cheapest = found[0]
    # The knapsack takes a cheap block, not layers.0 (five times the recompute).
    assert cheapest.blocks in ((), ("layers.1",)) or cheapest.split > 1
    checkpointing = [p for p in found if p.blocks and p.split == 1 and not p.compress]
    assert [p.blocks for p in checkpointing] == [("layers.1",)]


def test_a_plan_becomes_a_config_that_names_its_blocks():
    estimate = _synthetic()
    plan = next(p for p in plans(estimate, 30 * 2**20) if p.blocks and p.split == 1)
    config = plan_config(TurboConfig(device="cpu"), plan, all_blocks=4)
    assert config.checkpointing.mode == "selective"
    assert config.checkpointing.blocks == ("layers.1",)
    assert plans(estimate, 1)[0].blocks == tuple(f"layers.{i}" for i in range(4))  # leanest


def test_a_micro_batched_plan_keeps_the_global_batch_in_the_written_config():
    """A split is ``[accumulation] micro_batches`` (each batch cut inside the step), never more
    ``steps``: those would accumulate whole batches, and ``train`` would run a k times larger
    global batch than the plan was measured with."""
    estimate = _synthetic()
    split = next(p for p in plans(estimate, 30 * 2**20) if p.split > 1 and not p.blocks)
    config = plan_config(TurboConfig(device="cpu"), split, all_blocks=4)
    assert config.accumulation.micro_batches == split.split
    assert config.accumulation.steps == 1
    already = TurboConfig(device="cpu").replace(accumulation__micro_batches=split.split)
    assert plan_config(already, split, all_blocks=4) == already


def test_tune_with_a_budget_adopts_the_fastest_plan_that_fits_and_reports_every_plan():
    recipe = dataclasses.replace(_mlp_recipe(32), model=_Wide)
    estimate = estimate_recipe_memory(recipe, fixed_batches(recipe, 1)[0])
    # Two thirds of the activations: several plans fit.
    budget = estimate.persistent_bytes + 2 * estimate.activation_bytes() // 3
    options = dataclasses.replace(QUICK, memory_budget=budget, max_rounds=4)
    config, result = tune(recipe, options, stages={"memory": tuner_stages()["memory"]})
    rows = [o for o in result.candidates if o.stage == "memory"]
    measured = [o for o in rows if o.comparison is not None]
    assert len(measured) >= 2, [o.name for o in rows]
    assert all(o.memory_bytes is not None for o in measured)
    adopted = [o for o in rows if o.verdict == "adopted"]
    assert len(adopted) == 1 and adopted[0].memory_bytes <= budget
    # The written config is the plan, however slow: the baseline does not fit (a confirmation
    # against it used to revert to it). Its headline figure is the plan's own measurement.
    assert config == TurboConfig.from_dict(adopted[0].config)
    assert result.adopted == (adopted[0].name,) and result.confirmation.state == "fits"
    assert result.confirmation.comparison == adopted[0].comparison
    assert [row["name"] for row in result.confirmation.rows] == [
        "baseline (fp32 eager)",
        f"+ {adopted[0].name}",
    ]
    fitting = {o.name for o in measured if o.memory_bytes <= budget}
    beaten = [o for o in measured if o.verdict == "rejected" and o.memory_bytes <= budget]
    for row in beaten:
        # The winner is named first, then why: "is faster", "is ahead", or "makes the job faster"
        # when one-time costs decided (then the loser's step may even be the faster one).
        winners = [n for n in fitting - {row.name} if row.reason.startswith(f"fits, but {n} ")]
        assert len(winners) == 1, row.reason
        if "head to head" in row.reason:  # its figures are the race's, against the winner
            assert row.comparison.against == winners[0]
            assert row.comparison.speed.ratio <= 1 or "one-time costs included" in row.reason
    record = result.to_dict()["memory_estimate"]
    assert record["measured_bytes"] == result.baseline.memory_bytes
    assert abs(record["error"]) < 0.2


def _two_fitting_plans(monkeypatch, before: dict[float, float], racing: dict[float, float]):
    """Tune with two memory candidates that both fit, "slow" and "fast" (told apart by their
    clipping norm), on a clock only steps advance: each steps in ``before[norm]`` seconds while
    measured against the best, and in ``racing[norm]`` once a race has begun."""
    raced = [False]
    now = [0.0]
    real_step, real_compare = Trial.step, fastest_fit_module.compare

    def step(self):
        real_step(self)
        norm = self.config.clipping.max_norm
        now[0] += 0.010 if norm is None else (racing if raced[0] else before)[norm]

    def race(*args, **kwargs):
        raced[0] = True
        return real_compare(*args, **kwargs)

    monkeypatch.setattr(Trial, "step", step)
    monkeypatch.setattr(fastest_fit_module, "compare", race)
    # Both fit (the footprint is not what these tests are about); the loss is the same.
    monkeypatch.setattr(candidate_module, "judge", lambda **_: Verdict(True, "fits"))
    stages = {
        "memory": lambda ctx: [
            Candidate("slow", ctx.best.replace(clipping__max_norm=1.0)),
            Candidate("fast", ctx.best.replace(clipping__max_norm=2.0)),
        ]
    }
    options = dataclasses.replace(QUICK, memory_budget=1, max_rounds=12, skip=("data_loader",))
    config, result = tune(_mlp_recipe(), options, stages=stages, clock=lambda: now[0])
    return config, {o.name: o for o in result.candidates}, raced[0]


def test_plans_that_fit_are_raced_head_to_head_and_the_race_decides(monkeypatch):
    """Against the best, the two were measured at different times: "slow" looked faster there
    (a busy spell during "fast"'s comparison). Head to head, in rounds of their own, "fast"
    is 1.25x "slow": it is adopted, and "slow"'s row shows the race that beat it."""
    config, rows, raced = _two_fitting_plans(
        monkeypatch, before={1.0: 0.011, 2.0: 0.014}, racing={1.0: 0.010, 2.0: 0.008}
    )
    assert raced
    assert rows["fast"].verdict == "adopted" and config.clipping.max_norm == 2.0
    slow = rows["slow"]
    assert slow.verdict == "rejected" and "fast is faster" in slow.reason
    assert "head to head" in slow.reason
    race_figures = slow.comparison
    assert race_figures.against == "fast"
    assert race_figures.speed.ratio == pytest.approx(0.8, rel=0.02)
    assert race_figures.throughput / race_figures.reference_throughput == pytest.approx(
        race_figures.speed.ratio
    )


def test_plans_whose_intervals_against_the_best_are_apart_are_not_raced(monkeypatch):
    config, rows, raced = _two_fitting_plans(
        monkeypatch, before={1.0: 0.010, 2.0: 0.004}, racing={1.0: 0.004, 2.0: 0.010}
    )
    assert not raced and config.clipping.max_norm == 2.0
    slow = rows["slow"]
    assert "fast is faster" in slow.reason and "intervals apart" in slow.reason
    assert slow.comparison.against == "fp32 eager"  # its own measurement, against the best


def _compiled_plans(best: TurboConfig, **context):
    """The memory stage's candidates for a best over 12 MiB on ``_synthetic`` (4 MiB of
    weights, gradients and state; 32 MiB of eager activations at batch 8)."""
    from conftest import cpu_stage_context

    from torchturbo.tune.memory.plan import memory_plan_stage

    ctx = cpu_stage_context(
        _mlp_recipe(8),
        best=best,
        memory=_synthetic(),
        memory_budget=12 * 2**20,
        batch_size=8,
        **context,
    )
    found = memory_plan_stage(ctx)
    if isinstance(found, str):  # not applicable, and why
        return {}
    return {c.name: c.config for c in found}


def test_a_compiled_best_gets_compiled_plans_with_the_budget_computed_from_the_estimate():
    compiled = TurboConfig(device="cpu").replace(compile__mode="default")
    # Unmeasured, the eager activations stand in: 8 MiB of room over 32 MiB is 0.25 (0.2 on
    # the grid) at one piece, over 16 MiB at two pieces 0.5; four pieces fit alone.
    found = _compiled_plans(compiled, best_memory_bytes=None)
    assert found["plan: compile memory budget 0.2"].compile.activation_memory_budget == 0.2
    two = found["plan: compile memory budget 0.5 + micro-batch 4 x2"]
    assert two.compile.activation_memory_budget == 0.5 and two.accumulation.micro_batches == 2
    assert not any(c.activation_compression.dtype != "off" for c in found.values())
    assert len(found) <= 6
    # Measured: the compiled step kept 16 MiB of activations, half the eager estimate's, so
    # 8 MiB of room is half of what the graph keeps at one piece.
    measured = _compiled_plans(compiled, best_memory_bytes=20 * 2**20)
    assert measured["plan: compile memory budget 0.5"].compile.activation_memory_budget == 0.5
    assert not any("budget" in n and "x2" in n for n in measured)  # x2 fits alone then
    eager = _compiled_plans(TurboConfig(device="cpu"), best_memory_bytes=None)
    assert not any(c.compile.activation_memory_budget is not None for c in eager.values())
    assert any(c.activation_compression.dtype == "bf16" for c in eager.values())


def test_the_compiled_fraction_is_relative_to_the_bests_own_budget_and_never_raises_it():
    estimate = _synthetic()
    mib = 2**20
    graph = CompiledGraph(budget=0.5, scale=0.25)  # it keeps 4 MiB of 32 at its 0.5
    # 8 MiB of room over the 8 MiB the graph would keep at budget 1: 1.0, above its 0.5.
    assert budget_plans(estimate, 12 * mib, (1,), graph) == []
    # 1.5 MiB of room: 0.19 of 8 MiB at one piece (0.1 on the grid), 0.38 of 4 at two.
    found = budget_plans(estimate, int(5.5 * mib), (1, 2, 4), graph)
    assert [(p.memory_budget, p.split) for p in found] == [(0.1, 1), (0.3, 2)]
    assert all(p.estimated_bytes <= 5.5 * mib for p in found)
    # Below the weights, gradients and state no fraction fits: the leanest is measured.
    leanest = plans(estimate, 3 * mib, splits=(1, 2), compression=False, compiled=graph)
    assert len(leanest) == 1 and leanest[0].estimated_bytes > 3 * mib


def test_a_compiled_best_that_fits_by_a_plan_gets_compile_budgets_without_the_plan():
    """The planner runs on the eager best; compile is adopted on top of its plan. Then the
    same compile without the plan's knobs, under compile's own budget, is proposed (12 MiB
    budget, 4 MiB persistent, 32 MiB of eager activations: 0.25 -> 0.2 at one piece, 0.5 at
    two)."""
    planned = TurboConfig(device="cpu").replace(
        compile__mode="default", checkpointing__mode="full", accumulation__micro_batches=2
    )
    found = _compiled_plans(planned, best_memory_bytes=10 * 2**20)
    assert set(found) == {
        "compiled, without the plan: memory budget 0.2",
        "compiled, without the plan: memory budget 0.5 + micro-batch 4 x2",
    }
    one = found["compiled, without the plan: memory budget 0.2"]
    assert one.checkpointing.mode == "off" and one.accumulation.micro_batches == 1
    assert one.compile.mode == "default" and one.compile.activation_memory_budget == 0.2
    # Controls: an eager best, a compiled best with no plan, and one already under a budget.
    assert _compiled_plans(planned.replace(compile__mode="off"), best_memory_bytes=10 * 2**20) == {}
    bare = TurboConfig(device="cpu").replace(compile__mode="default")
    assert _compiled_plans(bare, best_memory_bytes=10 * 2**20) == {}
    budgeted = planned.replace(compile__activation_memory_budget=0.5)
    assert _compiled_plans(budgeted, best_memory_bytes=10 * 2**20) == {}
