"""What a tuner stage proposes: candidates to measure against the current best, and what it reads.

A stage (``Technique.stage``, or one of the strategy's in ``stages.py``) is a plain function
``(StageContext) -> list[Candidate] | str``. A leaf of the tuner: technique modules build their
candidates from it, so it imports nothing that imports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from torchturbo.config import TurboConfig
from torchturbo.measure.footprint import MemoryEstimate
from torchturbo.recipe import Recipe
from torchturbo.techniques.framework import levers
from torchturbo.techniques.framework.facts import Facts


@dataclass(frozen=True)
class PlannedState:
    """A smaller optimizer state the memory planner may give a plan (``Technique.
    optimizer_states``): its bytes over the model's parameters, and its first step's one-time
    cost (torchao compiles its step)."""

    bytes: int
    one_time_s: float


@dataclass(frozen=True)
class Candidate:
    """One configuration to try.

    ``expected_gain`` (None: no prior) orders the work; ``not_applicable`` says why it cannot
    help here, and then it is reported, not trained. Its batches are its config's batch plan;
    ``batches`` and ``recipe`` override the batches and the recipe outright (tests inject
    techniques this way). ``one_time_s`` is a one-time cost it brings besides compiling the
    model (torchao compiling its optimizer step), in seconds on an idle machine, for the
    tuner's cost estimate.
    """

    name: str
    config: TurboConfig
    expected_gain: float | None = None
    not_applicable: str | None = None
    evidence: str = ""
    batches: list[Any] | None = None
    recipe: Recipe | None = None
    one_time_s: float = 0.0


@dataclass(frozen=True)
class AsideCandidate:
    """A choice tuning inside the run builds off the critical path before measuring it on the
    job's steps (``Technique.built_aside``): the candidate, and the seconds its build is
    expected to take from the job (what the steps left must save before it is built)."""

    candidate: Candidate
    build_s: float


@dataclass
class StageContext:
    """What stages may read: the recipe, the current best, and facts measured so far."""

    recipe: Recipe
    best: TurboConfig
    device: torch.device
    facts: Facts
    best_memory_bytes: int | None
    memory_budget: int | None
    world_size: int = 1
    #: The process group's backend under torchrun ("nccl", "gloo"), None in one process.
    backend: str | None = None
    #: The current best's batch size per step (after any micro-batching).
    batch_size: int | None = None
    #: The fp32 eager step's memory estimate (``trials.memory_estimate``), for the planner.
    memory: MemoryEstimate | None = None
    notes: dict[str, str] = field(default_factory=dict)

    @property
    def has_convolutions(self) -> bool:
        return self.facts.has_convolutions


def candidate(
    name: str, config: TurboConfig, expectation: levers.Expectation, **kw: Any
) -> Candidate:
    if expectation.applicable:
        return Candidate(name, config, expectation.gain, evidence=expectation.evidence, **kw)
    return Candidate(name, config, not_applicable=expectation.evidence, **kw)


def memory_not_needed(ctx: StageContext, cost: str, fits_cost: str) -> str | None:
    """Why a stage that trades time for memory does not apply: no budget was given (``cost``:
    what it would only cost then), or the current best already fits it (``fits_cost``); None
    when the best is over the budget."""
    if ctx.memory_budget is None:
        return f"no memory budget given: {cost}"
    if ctx.best_memory_bytes is not None and ctx.best_memory_bytes <= ctx.memory_budget:
        return (
            f"the current best fits the budget ({ctx.best_memory_bytes / 2**20:.0f} of "
            f"{ctx.memory_budget / 2**20:.0f} MiB): {fits_cost}"
        )
    return None
