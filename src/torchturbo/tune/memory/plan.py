"""The memory planner: the configurations that should fit ``--memory-budget``, cheapest first.

Over the budget, the tuner does not try a menu and stop at the first that fits: this stage
proposes plans, the tuner measures every one (footprint and speed against the same current best)
and races those that fit head to head for the fastest (``fastest_fit``). A plan combines

* micro-batching (each batch in 1, 2, 4 or 8 pieces, accumulated exactly: the global batch is
  kept),
* activation compression (saved float32 activations stored in bf16; eager only),
* torch.compile's activation memory budget, where the current best is compiled (``[compile]
  activation_memory_budget``: the partitioner keeps that fraction of what the compiled graph
  saves and recomputes the rest): the largest fraction on a 0.1 grid that should fit, alone
  and with the fewest micro-batches that it needs (``budget_plans``),
* a smaller optimizer state, where the optimizer is an Adam or AdamW (``[optimizer] state``:
  bf16, 8-bit or 4-bit moments, ``techniques/optimizer_state.py``): the estimate's weights,
  gradients and optimizer state are fixed bytes, and on a fine-tune the two float32 moments are
  often the largest of them, which no activation knob can free; its bytes are the state's
  layout over the model's parameters (``planned_state_bytes``), its cost no recompute but the
  loss difference the tuner measures; planned only when nothing fits without one,
* and the blocks to checkpoint: for each of those, the cheapest set that frees what is still
  missing, a knapsack over blocks (``knapsack``) whose savings are the bytes each block's
  checkpointing frees and whose costs are its measured forward time (what recomputing it
  costs), both from the memory estimate (``trials.memory_estimate``); and whole block types
  (every ``BasicBlock``, every ``LlamaDecoderLayer``) where that fits.

A plan's footprint is the estimate's, calibrated by the measured footprint of the current best
(the estimate's figure for the best is moved onto what was measured), and only plans that
should fit are proposed, without one another's redundant knobs (a plan is left out when another
one fits with a subset of its knobs). When none should fit, the leanest plan is proposed, so that
the measurement says how far off it is.

The estimate is of the fp32 eager step; a compiled step saves less. Where the best is compiled,
its measured footprint (taken for every candidate, compiled ones included:
``Trial.memory_footprint``) moves the eager knobs' plans like any best's, and scales the
compiled plans: the graph's activations at budget 1 are taken as the estimate's activations
times the measured over the estimated ones of the best (divided by the best's own budget), at
each split by the estimate's line. Unmeasured, the eager figure stands in (compile keeps no
more than eager): the fraction is then too small, never too large. A budget keeps the graph's
inputs even at 0, which the estimate leaves out; the tuner measures what each plan takes.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from torchturbo.config import CheckpointConfig, TurboConfig
from torchturbo.measure.footprint import BlockMemory, MemoryEstimate
from torchturbo.recipe import Recipe
from torchturbo.techniques import registry
from torchturbo.techniques.framework.proposal import (
    Candidate,
    PlannedState,
    StageContext,
    memory_not_needed,
)
from torchturbo.tune.memory.knapsack import cheapest_cover

#: Micro-batch splits a plan may use.
SPLITS = (1, 2, 4, 8)
#: A whole block type is proposed beside the knapsack's blocks when it recomputes at most this
#: many times as much (block forwards are timed once, on a busy machine).
TYPE_MARGIN = 1.25
#: Plans measured at most (the cheapest by estimated recompute, then by split).
MAX_PLANS = 6
#: The grid of a compiled plan's activation memory budget (stable names, one config per step).
BUDGET_STEP = 0.1
#: Of those, compiled plans at most: the budget at the fewest micro-batches it fits with, and
#: at the next split (a larger fraction kept, fewer ops recomputed).
MAX_BUDGET_PLANS = 2
#: The optimizer states a plan may use, least lossy first (a plan with a less lossy state
#: dominates one with a lossier state and the same other knobs). fp8 keeps 8-bit's bytes.
PLANNER_STATES = ("bf16", "8bit", "4bit")
#: A state is planned only when it takes less than this share of the optimizer's own bytes.
MIN_STATE_SHARE = 0.9


@dataclass(frozen=True)
class Plan:
    """One way to fit: which blocks to checkpoint (all of a type when ``block_type`` is set),
    the micro-batch split, bf16 activation storage, the footprint it is expected to have and
    the forward seconds it recomputes per step."""

    blocks: tuple[str, ...]
    split: int
    compress: bool
    estimated_bytes: int
    recompute_s: float
    block_type: str | None = None
    #: ``[compile] activation_memory_budget`` (compiled plans only, which change nothing else
    #: but the split: ``knobs`` and ``dominates`` compare the eager knobs' plans).
    memory_budget: float | None = None
    #: ``[optimizer] state`` (None: the optimizer's own).
    state: str | None = None

    def knobs(self) -> tuple[frozenset[str], int, bool, int]:
        return frozenset(self.blocks), self.split, self.compress, _lossiness(self.state)

    def dominates(self, other: Plan) -> bool:
        """Fits with a subset of ``other``'s knobs (and is not the same plan)."""
        mine, theirs = self.knobs(), other.knobs()
        return (
            mine != theirs
            and mine[0] <= theirs[0]
            and mine[1] <= theirs[1]
            and mine[2] <= theirs[2]
            and mine[3] <= theirs[3]
        )


def _lossiness(state: str | None) -> int:
    """0 for the optimizer's own state, then by ``PLANNER_STATES``' order."""
    return 0 if state is None else 1 + PLANNER_STATES.index(state)


def footprint(
    estimate: MemoryEstimate, checkpointed: Collection[str], split: int, compress: bool
) -> int:
    """Estimated bytes of a step with these knobs (at the estimate's batch size)."""
    samples = estimate.batch_size / split
    return estimate.persistent_bytes + sum(
        _block_bytes(block, samples, block.name in checkpointed, compress)
        for block in estimate.blocks
    )


def _block_bytes(block: BlockMemory, samples: float, checkpointed: bool, compress: bool) -> int:
    held = block.held.at(samples) - (block.freeable.at(samples) if checkpointed else 0)
    return held - (block.compressible_at(samples, checkpointed) // 2 if compress else 0)


@dataclass(frozen=True)
class CompiledGraph:
    """The current best's compiled graph: its activation memory budget, and ``scale``, what it
    saves at budget 1 over what the eager estimate saves (1 when unmeasured)."""

    budget: float = 1.0
    scale: float = 1.0


def plans(
    estimate: MemoryEstimate,
    budget: int,
    *,
    offset: int = 0,
    splits: tuple[int, ...] = SPLITS,
    compression: bool = True,
    compiled: CompiledGraph | None = None,
    states: Mapping[str, int] | None = None,
) -> list[Plan]:
    """The plans expected to fit ``budget`` once ``offset`` (measured minus estimated bytes of
    the current best) is added, cheapest first; the leanest plan alone when none should fit.
    With ``compiled`` (the best is compiled), ``budget_plans`` join them. ``states`` are the
    optimizer states a plan may use, each with the bytes it would take instead of the
    estimate's optimizer state."""
    blocks = [b for b in estimate.blocks if b.checkpointable]
    fitting: list[Plan] = []
    unfit: list[Plan] = []
    freed: dict[str | None, int] = {None: 0}
    freed.update((s, estimate.optimizer_bytes - b) for s, b in (states or {}).items())
    for split, compress in itertools.product(splits, (False, True) if compression else (False,)):
        for state, saved in freed.items():
            room = budget - offset + saved
            for plan in _choices(estimate, blocks, room, split, compress, state):
                bytes_ = plan.estimated_bytes + offset - saved
                plan = dataclasses.replace(plan, estimated_bytes=bytes_)
                (fitting if plan.estimated_bytes <= budget else unfit).append(plan)
    budgeted = budget_plans(estimate, budget, splits, compiled) if compiled is not None else []
    fitting_budgeted = [p for p in budgeted if p.estimated_bytes <= budget][:MAX_BUDGET_PLANS]
    unfit += [p for p in budgeted if p.estimated_bytes > budget]
    exact = [p for p in fitting if p.state is None]
    if exact or fitting_budgeted:
        # A smaller state changes every update (a loss difference), where recomputing and
        # micro-batching do not: it is planned only when nothing fits without one.
        fitting = exact
    kept = _unique(p for p in fitting if not any(o.dominates(p) for o in fitting))
    kept.sort(key=_cheapest)
    if kept or fitting_budgeted:
        return sorted(fitting_budgeted + kept[: MAX_PLANS - len(fitting_budgeted)], key=_cheapest)
    return [min(unfit, key=lambda p: p.estimated_bytes)] if unfit else []


def _cheapest(plan: Plan) -> tuple[float, int, bool, int, int]:
    return plan.recompute_s, plan.split, plan.compress, _lossiness(plan.state), len(plan.blocks)


def budget_plans(
    estimate: MemoryEstimate, budget: int, splits: tuple[int, ...], compiled: CompiledGraph
) -> list[Plan]:
    """Compiled plans, one per split that needs a budget below the best's: the largest
    fraction on the ``BUDGET_STEP`` grid at which persistent bytes plus that fraction of the
    graph's activations should fit (0 where nothing does: the leanest). Their recompute is
    the whole forward times the fraction not kept, an upper bound (the partitioner recomputes
    the cheapest operations first)."""
    persistent = estimate.persistent_bytes
    forward_s = sum(_cost(b) for b in estimate.blocks)
    found = []
    for split in splits:
        kept = compiled.scale * estimate.activation_bytes(estimate.batch_size / split)
        if kept <= 0:
            continue
        fraction = min(max((budget - persistent) / kept, 0.0), 1.0)
        on_grid = round(math.floor(fraction / BUDGET_STEP + 1e-9) * BUDGET_STEP, 1)
        if on_grid >= compiled.budget:
            continue  # the split alone should do (an eager knobs' plan)
        found.append(
            Plan(
                blocks=(),
                split=split,
                compress=False,
                estimated_bytes=persistent + math.ceil(on_grid * kept),
                recompute_s=(1 - on_grid) * forward_s,
                memory_budget=on_grid,
            )
        )
    return found


def _choices(
    estimate: MemoryEstimate,
    blocks: list[BlockMemory],
    budget: int,
    split: int,
    compress: bool,
    state: str | None = None,
) -> list[Plan]:
    """For one split, compression and optimizer state: the knapsack's blocks, every whole
    block type, and (the leanest) every block."""
    samples = estimate.batch_size / split
    plain = footprint(estimate, (), split, compress)
    savings = [
        _block_bytes(b, samples, False, compress) - _block_bytes(b, samples, True, compress)
        for b in blocks
    ]
    costs = [_cost(b) for b in blocks]
    chosen: list[tuple[tuple[str, ...], str | None]] = []
    cover = cheapest_cover(list(zip(costs, savings, strict=True)), plain - budget)
    if cover is not None:
        chosen.append((tuple(blocks[i].name for i in sorted(cover[0])), None))
    for type_name in sorted({b.type_name for b in blocks}):
        typed = [b for b in blocks if b.type_name == type_name]
        # A whole type is worth measuring beside the knapsack's pick only where its recompute
        # is within the noise of a forward timed once (``TYPE_MARGIN``).
        if cover is None or sum(map(_cost, typed)) <= TYPE_MARGIN * cover[1]:
            chosen.append((tuple(b.name for b in typed), type_name))
    chosen.append((tuple(b.name for b in blocks), None))
    out = []
    for names, block_type in chosen:
        if not names and split == 1 and not compress and state is None:
            continue  # no change at all: the current best
        recompute = sum(_cost(b) for b in blocks if b.name in names)
        bytes_ = footprint(estimate, names, split, compress)
        out.append(Plan(names, split, compress, bytes_, recompute, block_type, state=state))
    return out


def _cost(block: BlockMemory) -> float:
    return block.forward_s if block.forward_s is not None else 0.0


def _unique(found: Iterable[Plan]) -> list[Plan]:
    seen: dict[tuple[frozenset[str], int, bool, int], Plan] = {}
    for plan in found:
        seen.setdefault(plan.knobs(), plan)
    return list(seen.values())


def plan_config(best: TurboConfig, plan: Plan, all_blocks: int) -> TurboConfig:
    """``best`` with the plan's knobs set."""
    changes: dict[str, object] = {}
    if plan.blocks and len(plan.blocks) == all_blocks:
        changes["checkpointing__mode"] = "full"
    elif plan.block_type is not None:
        changes["checkpointing__mode"] = "selective"
        changes["checkpointing__module_types"] = (plan.block_type,)
    elif plan.blocks:
        changes["checkpointing__mode"] = "selective"
        changes["checkpointing__blocks"] = plan.blocks
    if plan.split > best.accumulation.micro_batches:
        # Each loader batch cut into pieces inside the step: the written config trains the
        # same global batch (``[accumulation] steps`` would accumulate whole batches instead).
        changes["accumulation__micro_batches"] = plan.split
    if plan.compress:
        changes["activation_compression__dtype"] = "bf16"
    if plan.memory_budget is not None:
        changes["compile__activation_memory_budget"] = plan.memory_budget
    if plan.state is not None:
        # A rebuilt state has no fused or foreach kernel of torch's: the flag goes.
        changes["optimizer__state"] = plan.state
        changes["optimizer__implementation"] = "as_built"
    return best.replace(**changes)


def plan_name(plan: Plan, all_blocks: int, batch_size: int) -> str:
    """A short, unique name: what the plan checkpoints, splits and compresses, or its
    compiled graph's budget."""
    parts = []
    if plan.memory_budget is not None:
        parts.append(f"compile memory budget {plan.memory_budget:.1f}")
    if plan.blocks and len(plan.blocks) == all_blocks:
        parts.append(f"ckpt all {all_blocks} blocks")
    elif plan.block_type is not None:
        parts.append(f"ckpt every {plan.block_type}")
    elif len(plan.blocks) <= 3:
        parts += [f"ckpt {','.join(plan.blocks)}"] if plan.blocks else []
    else:
        parts.append(f"ckpt {len(plan.blocks)} blocks ({plan.blocks[0]}..{plan.blocks[-1]})")
    if plan.split > 1:
        parts.append(f"micro-batch {batch_size // plan.split} x{plan.split}")
    if plan.compress:
        parts.append("bf16 activations")
    if plan.state is not None:
        parts.append(f"{plan.state} optimizer state")
    return "plan: " + " + ".join(parts)


def memory_plan_stage(ctx: StageContext) -> list[Candidate] | str:
    """Over the budget: every plan that should fit (``plans``), to be measured side by side."""
    not_needed = memory_not_needed(
        ctx,
        "checkpointing, micro-batching, compression and smaller optimizer states would only "
        "cost time or precision",
        "checkpointing, micro-batching, compression and smaller optimizer states would only "
        "cost time or precision",
    )
    if not_needed:
        return _compiled_replans(ctx) or not_needed
    estimate, budget = ctx.memory, ctx.memory_budget
    assert budget is not None  # memory_not_needed said there is one
    if estimate is None:
        return "no memory estimate of this recipe's step: nothing to plan from"
    offset = 0
    same_batch = ctx.batch_size in (None, estimate.batch_size)
    # A plan's split is the whole batch's (the pieces a step cuts it into), never fewer than
    # the best's own ``micro_batches`` (``tune --find-batch`` may have set them).
    current = ctx.best.accumulation.micro_batches
    states = optimizer_states(ctx, estimate)
    if ctx.best_memory_bytes is not None and same_batch:
        offset = ctx.best_memory_bytes - footprint(estimate, (), current, False)
    splits = (
        tuple(s for s in SPLITS if estimate.batch_size % s == 0 and s >= current)
        if same_batch
        else (current,)
    )
    # Compression's hooks cannot see what a compiled graph saves (activation_compression.py);
    # the compiler's own budget can.
    compression = ctx.best.compile.mode == "off"
    compiled = None if compression else _compiled_graph(ctx, estimate, current, same_batch)
    count = sum(b.checkpointable for b in estimate.blocks)
    return [
        Candidate(
            plan_name(plan, count, estimate.batch_size),
            plan_config(ctx.best, plan, count),
            evidence=_evidence(plan, estimate, states),
            one_time_s=0.0 if plan.state is None else states[plan.state].one_time_s,
        )
        for plan in plans(
            estimate,
            budget,
            offset=offset,
            splits=splits,
            compression=compression,
            compiled=compiled,
            states={name: state.bytes for name, state in states.items()},
        )
    ]


def _evidence(plan: Plan, estimate: MemoryEstimate, states: Mapping[str, PlannedState]) -> str:
    text = (
        f"estimated {plan.estimated_bytes / 2**20:.1f} MiB, recomputes "
        f"{plan.recompute_s * 1e3:.0f} ms of forward per step"
    )
    if plan.state is None:
        return text
    return (
        f"{text}; optimizer state {states[plan.state].bytes / 2**20:.1f} MiB as {plan.state} "
        f"instead of {estimate.optimizer_bytes / 2**20:.1f} MiB (its loss difference is measured)"
    )


def optimizer_states(ctx: StageContext, estimate: MemoryEstimate) -> dict[str, PlannedState]:
    """The optimizer states a plan may use, with the bytes each would take: those the
    recipe's optimizer can be rebuilt with, while the best keeps the optimizer's own."""
    if ctx.best.optimizer.state != "as_built":
        return {}
    return recipe_optimizer_states(ctx.recipe, estimate)


def smallest_optimizer_state(recipe: Recipe, estimate: MemoryEstimate) -> int:
    """The fewest bytes of optimizer state a plan can give the recipe: what a memory budget
    must leave beside the weights and gradients (``tune.search.budget.memory_floor``)."""
    states = recipe_optimizer_states(recipe, estimate)
    return min([estimate.optimizer_bytes, *(state.bytes for state in states.values())])


def recipe_optimizer_states(recipe: Recipe, estimate: MemoryEstimate) -> dict[str, PlannedState]:
    """The smaller optimizer states the recipe's optimizer can be rebuilt with, and their bytes."""
    if estimate.optimizer_bytes == 0:
        return {}
    _, optimizer = recipe.build()
    offered = registry.optimizer_states(optimizer)
    planned = {state: offered[state] for state in PLANNER_STATES if state in offered}
    # torchao leaves tensors under 4,096 values in float32: on a small model a state may free
    # next to nothing, and is then no plan.
    limit = MIN_STATE_SHARE * estimate.optimizer_bytes
    return {name: state for name, state in planned.items() if state.bytes < limit}


def _compiled_graph(
    ctx: StageContext, estimate: MemoryEstimate, split: int, same_batch: bool
) -> CompiledGraph:
    """The compiled best's budget, and its activations at budget 1 over the estimate's, from
    its measured footprint where that was of the estimate's batch."""
    budget = ctx.best.compile.activation_memory_budget
    graph = CompiledGraph(1.0 if budget is None else budget)
    eager = estimate.activation_bytes(estimate.batch_size / split)
    if ctx.best_memory_bytes is None or not same_batch or graph.budget == 0 or eager == 0:
        return graph
    saved = max(ctx.best_memory_bytes - estimate.persistent_bytes, 0)
    return dataclasses.replace(graph, scale=saved / (graph.budget * eager))


def _compiled_replans(ctx: StageContext) -> list[Candidate]:
    """A compiled best that fits the budget thanks to a plan (the planner runs first, on the
    eager best; compile is judged on top of the plan): the same compile without the plan's
    checkpointing, compression and micro-batches, under compile's own activation budget, may
    fit faster, the partitioner choosing what to recompute inside the graph. Speed candidates:
    adopted only when faster than the best and within the budget, as measured. The graph's
    activations are taken as the eager estimate's (compile keeps no more, so the fraction errs
    small), at the fewest pieces that should fit and the next split (``budget_plans``)."""
    best, estimate, budget = ctx.best, ctx.memory, ctx.memory_budget
    compression = best.activation_compression
    planned = (
        best.checkpointing.mode != "off"
        or best.accumulation.micro_batches > 1
        or compression.dtype != "off"
    )
    if (
        estimate is None
        or budget is None
        or best.compile.mode == "off"
        or best.compile.activation_memory_budget is not None
        or not planned
        or ctx.batch_size not in (None, estimate.batch_size)
    ):
        return []
    bare = best.replace(
        checkpointing=CheckpointConfig(),
        accumulation__micro_batches=1,
        activation_compression=type(compression)(),
    )
    splits = tuple(s for s in SPLITS if estimate.batch_size % s == 0)
    # A graph bound above 1 skips no fraction: 1.0 is plain compile at that split.
    found = budget_plans(estimate, budget, splits, CompiledGraph(budget=math.inf))
    fitting = [p for p in found if p.estimated_bytes <= budget][:MAX_BUDGET_PLANS]
    candidates = []
    for plan in fitting:
        fraction = (
            None if plan.memory_budget is None or plan.memory_budget >= 1 else plan.memory_budget
        )
        config = bare.replace(
            accumulation__micro_batches=plan.split, compile__activation_memory_budget=fraction
        )
        parts = [f"memory budget {fraction:.1f}"] if fraction is not None else []
        if plan.split > 1:
            parts.append(f"micro-batch {estimate.batch_size // plan.split} x{plan.split}")
        name = "compiled, without the plan: " + (" + ".join(parts) or "no recompute, one piece")
        evidence = (
            f"estimated {plan.estimated_bytes / 2**20:.1f} MiB with compile keeping "
            f"{1.0 if fraction is None else fraction:.0%} of the eager activations"
        )
        if config != best:
            candidates.append(Candidate(name, config, evidence=evidence))
    return candidates
