"""The state of a tuning run and the constants its steps share (see ``search``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from torchturbo.config import TurboConfig
from torchturbo.measure.footprint import MemoryEstimate
from torchturbo.recipe import Recipe
from torchturbo.techniques import registry
from torchturbo.techniques.framework.decide import MIN_ROUNDS
from torchturbo.techniques.framework.facts import Facts
from torchturbo.techniques.framework.proposal import Candidate, StageContext
from torchturbo.trials.trial import Trial, TrialBatches
from torchturbo.tune.batch.choice import BatchMode
from torchturbo.tune.search.budget import Budget
from torchturbo.tune.search.horizon import Horizon, horizon
from torchturbo.tune.search.outcome import Outcome

Stage = Callable[[StageContext], "list[Candidate] | str"]

#: Steps whose losses are compared for parity: enough to see a broken technique, few enough
#: that fp32/bf16 rounding has not yet compounded into divergent trajectories.
PARITY_STEPS = 6
#: Distinct batches every trial cycles through, at the most and the fewest. Trials on other
#: batches than the best are compared in rounds of a whole pass over them: at seconds per step
#: fewer batches keep such a decision to about a minute (``batch_count``).
NUM_BATCHES = 8
MIN_BATCHES = 4
#: A pass over a trial's batches should take about this long at the baseline's step.
CYCLE_S = 4.0
#: Untimed steps after a trial's first one, before its paired rounds: the first step carries
#: the one-time costs, and allocator and cache warm-up settle in the next.
WARM_STEPS = 1
#: Seconds held back for writing the report (JSON, three PNG plots, markdown, HTML).
REPORT_S = 5.0


def batch_count(step_s: float) -> int:
    """Batches per trial for a baseline step of ``step_s`` seconds (see ``CYCLE_S``)."""
    if step_s <= 0:
        return NUM_BATCHES
    return max(MIN_BATCHES, min(NUM_BATCHES, math.ceil(CYCLE_S / step_s)))


@dataclass(frozen=True, kw_only=True)
class TuneOptions:
    time_budget_s: float = 300.0
    memory_budget: int | None = None
    #: Steps of the real job; None: the recipe's, else an assumed horizon (``tune.search.horizon``).
    planned_steps: int | None = None
    loss_tolerance: float = 0.05
    device: str | None = None
    #: Stage names to run (all when empty) and to leave out.
    only: tuple[str, ...] = ()
    skip: tuple[str, ...] = ()
    #: Paired rounds a comparison may take; None: as many as the budget affords (the futility
    #: rule stops one that cannot show a gain worth having). A fixed cap ended decisions the
    #: budget could afford: channels_last on a CNN (1.10x at ~13% per-round noise, 2-core EPYC)
    #: stayed undecided at 30 rounds when about 52 would have decided it, 4 s more.
    max_rounds: int | None = None
    #: Inductor's cache folder for what tuning compiles ("" leaves torch's default). When set,
    #: the chosen config names it and the one-time cost a compile is judged on is its
    #: warm-cache cost, which is what the job that loads this cache pays.
    compile_cache_dir: str = ""
    #: Find the largest micro-batch that fits ``memory_budget`` (on a GPU without one, most of
    #: its memory: ``search.batch_budget``) before tuning (``tune.batch.probe``): "keep" keeps
    #: the global batch by micro-batching, "max" may grow it; None: do not.
    find_batch: BatchMode | None = None
    #: Refuse, with a ``tune.search.budget.BudgetError``, budgets no run can keep: a memory budget
    #: under the weights, gradients and optimizer state, a time budget under what one decision
    #: needs once the baseline's steps are timed. ``torchturbo tune`` sets it; off, a run
    #: measures what it can (tests of the budget's economy run on budgets that small).
    refuse_impossible: bool = False

    def __post_init__(self) -> None:
        checks = {
            "time_budget_s": math.isfinite(self.time_budget_s) and self.time_budget_s > 0,
            "planned_steps": self.planned_steps is None or self.planned_steps >= 1,
            "loss_tolerance": 0 < self.loss_tolerance < 1,
            "max_rounds": self.max_rounds is None or self.max_rounds >= MIN_ROUNDS,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"{name} = {getattr(self, name)!r} is out of range")
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise ValueError(f"memory budget {self.memory_budget} bytes is not positive")


@dataclass
class Incumbent:
    """A config that is (or was) the best, with its live trial."""

    name: str
    config: TurboConfig
    trial: Trial
    memory_bytes: int | None
    #: The candidate that made it the best (None for the baseline).
    candidate: Candidate | None = None
    outcome: Outcome | None = None
    #: Seconds its first steps took beyond steady steps: the job pays them once.
    one_time_s: float = 0.0


@dataclass
class Run:
    """The state of one tuning run, shared by its steps."""

    recipe: Recipe
    options: TuneOptions
    device: torch.device
    budget: Budget
    #: Each config's batches: its batch plan's, drawn once per plan.
    batches: TrialBatches
    say: Callable[[str, str, float], None]
    facts: Facts
    #: Seconds to build a trial (model, optimizer, setup) and steady seconds per baseline step.
    build_s: float
    baseline_step_s: float
    #: The fp32 baseline's config, whose curve on its own batches is ``reference_losses``.
    reference_config: TurboConfig
    #: The baseline's first losses on each batch list a candidate trained on, by the list's
    #: key (``candidate.reference_curve``): the list and its curve.
    reference_curves: dict[Hashable, tuple[list[Any], list[float]]] = field(default_factory=dict)
    outcomes: list[Outcome] = field(default_factory=list)
    adoptions: list[Incumbent] = field(default_factory=list)
    #: The baseline step's memory estimate, made before it ran (None where it failed).
    memory: MemoryEstimate | None = None
    #: Said before the search when the budget cannot measure every large expected gain.
    budget_note: str = ""
    #: Samples or tokens per baseline step, measured once with the baseline (a collective
    #: under torchrun: read here later, when ranks may no longer meet).
    baseline_count: float = 0.0
    #: Called after every decided row: the run's record so far is kept (``tune(on_record=)``).
    on_decided: Callable[[], None] = lambda: None

    @property
    def reference_losses(self) -> list[float]:
        """The fp32 baseline's first losses on its own batches."""
        return self.reference_curves[registry.batch_key(self.reference_config)][1]

    @property
    def horizon(self) -> Horizon:
        """The job candidates are judged for (its steps and where that figure came from)."""
        return horizon(self.recipe, self.options.planned_steps)

    @property
    def clock(self) -> Callable[[], float]:
        return self.budget.clock
