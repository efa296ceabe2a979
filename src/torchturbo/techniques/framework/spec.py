"""What a technique declares about itself, once, in its own module.

A technique module defines ``TECHNIQUE = Technique(...)``: its config section, when the config
asks for it, its place in the one registry order and why, its model transform, the process-wide
switch it holds while training runs, what it does to the optimizer, to the batches and to the
inputs, how it explains a failure, the tuner stage that proposes it, the doctor's levers, and how
each trainer's arguments carry it. ``registry.py`` finds the modules, orders them and is the only
caller of these hooks: the engine, the tuner, the doctor, the translations and both trainer
callbacks read the registry, never a technique directly.

**One order for every hook.** Every technique has an ``order`` (unique) and the reason for it;
the registry calls each kind of hook in ascending ``order``:

- ``transform``: applied to the model in that order (the composition order: float8 before
  channels_last before checkpointing before the chunked loss before compile; the strategy's
  DDP/FSDP wrapping comes after all of them, ``engine/compose.py``);
- ``switch``: entered in that order around each step (or a trainer's run), left in reverse;
- ``rebuild_optimizer``: each rebuild gets the optimizer the one before returned;
- ``batches``: the technique whose ``plans`` is ``[data] batches`` plans the batches
  (``registry.batch_plan``); one field, so that two plans cannot be asked for at once.

Every hook is optional; a technique declares the ones it has. Hooks get the whole
``TurboConfig`` and read their own section (``config.section(name)``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from torchturbo.config import TurboConfig
from torchturbo.data.batch_plan import BatchPlan, BatchSource
from torchturbo.techniques.framework.facts import Facts
from torchturbo.techniques.framework.levers import Expectation
from torchturbo.techniques.framework.proposal import (
    AsideCandidate,
    Candidate,
    PlannedState,
    StageContext,
)
from torchturbo.techniques.framework.result import TechniqueResult
from torchturbo.techniques.framework.steps import StepHooks

#: Where a technique runs: torchturbo's own engine, or a trainer's torchturbo callback.
Host = Literal["engine", "transformers", "lightning"]
#: The trainers whose arguments a config translates into (``integrations/translate.py``).
Trainer = Literal["transformers", "lightning"]

#: A tuner stage: the candidates to measure against the current best, or why it does not apply.
StageFn = Callable[[StageContext], list[Candidate] | str]


@dataclass(frozen=True)
class Stage:
    """A tuner stage: ``rank`` places it in the report (the article's order: precision 10,
    float8 20, memory format 30, compile 40, optimizer 50, memory 60, dynamic batching 70,
    packing 71; the strategy's communication stages 80-90). Measuring order is by expected gain,
    not rank."""

    name: str
    rank: int
    propose: StageFn
    #: Its candidates make the best fit a memory budget: while the best is over the budget,
    #: they are measured first and judged by fitting at the least cost, not by speed.
    fits_memory: bool = False
    #: The lever it pulls ("" = its own name). Candidates of one lever are alternatives (bf16 or
    #: fp16; length buckets or packing, two stages of the lever "batching"): the tuner measures
    #: them all against the same best and races those that would be adopted head to head.
    lever: str = ""
    #: Its candidates' priors are facts measured in seconds, not guesses (the matrix-product
    #: rate of a precision here, the padding the lengths imply): tuning inside a run lets them
    #: choose where the run starts (``engine/in_run.py``).
    from_facts: bool = False


@dataclass(frozen=True)
class Lever:
    """A line of the doctor's ranking: its label and the prior ``(facts) -> Expectation``."""

    label: str
    expect: Callable[[Facts], Expectation]


@dataclass
class TrainerArguments:
    """A trainer's keywords being built from a config, and the notes for what they cannot say.

    ``accepts`` are the argument names the installed trainer takes (None: unknown, assume the
    newest); ``callback`` and ``trainer_class`` name torchturbo's classes for the notes.
    """

    trainer: Trainer
    accepts: frozenset[str] | None
    callback: str
    trainer_class: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)

    def note(self, section: str, name: str, text: str) -> None:
        self.notes[f"[{section}] {name}"] = text

    def takes(self, name: str) -> bool:
        """Whether the trainer has an argument called ``name`` (True when unknown)."""
        return self.accepts is None or name in self.accepts

    def planned_by_callback(self, field: str, batches: str) -> None:
        """``[data] field`` is a batch plan the Lightning callback applies: it rebuilds the train
        DataLoader on ``batches``, each rank taking its own whole batches (so Lightning must not
        put a DistributedSampler in)."""
        if self.takes("use_distributed_sampler"):
            self.kwargs["use_distributed_sampler"] = False
        self.note(
            "data",
            field,
            f"applied by {self.callback}: it rebuilds the train DataLoader on {batches}, the "
            "batches tune measured; use_distributed_sampler=False lets each rank take its own "
            "whole batches",
        )


@dataclass(frozen=True, kw_only=True)
class Technique:
    """One technique, as the registry composes, tunes, ranks and translates it."""

    #: The key of its result in ``Turbo.results`` and the callbacks' ``results``.
    name: str
    #: Its config section (``config/sections.py`` declares every section).
    section: str
    #: The fields of the section it owns (several techniques may share one); () = all.
    fields: tuple[str, ...] = ()
    #: Its page, relative to the repository root: what it does, when it helps and hurts, the
    #: effect we measured and the command that measured it.
    doc: str
    #: Whether ``config`` asks for it at all.
    requested: Callable[[TurboConfig], bool]
    #: Its place in the registry's one order (unique; see the module docstring), and which
    #: constraint puts it there.
    order: int
    order_reason: str
    #: Model transform ``(model, config, device) -> result``, applied in place.
    transform: Callable[[nn.Module, TurboConfig, torch.device], TechniqueResult] | None = None
    #: ``(model, on) -> whether the model has it``: the transform switched off, or on again, in
    #: place between steps (the parameters untouched), so that tuning inside the run can
    #: measure it on the job's own steps (``engine/in_run.py``).
    toggle: Callable[[nn.Module, bool], bool] | None = None
    #: ``(config, facts) -> candidate``: how tuning inside the run tries it where its cold
    #: cost must stay off the critical path (a compile): its transform applied to a copy of the
    #: model and run once aside (``engine/build_aside.py``), then measured like a toggle.
    built_aside: Callable[[TurboConfig, Facts], AsideCandidate] | None = None
    #: A process-wide setting ``(config, device) -> context`` held while training runs (for
    #: each step in the engine, from train begin to end in a trainer) and restored afterwards;
    #: a string instead of the context says why it does not take effect here.
    switch: Callable[[TurboConfig, torch.device], AbstractContextManager[Any] | str] | None = None
    #: ``(optimizer, config) -> (optimizer to use, result)``, after the model is composed.
    rebuild_optimizer: (
        Callable[
            [torch.optim.Optimizer, TurboConfig], tuple[torch.optim.Optimizer, TechniqueResult]
        ]
        | None
    ) = None
    #: ``(config, device) -> hooks``: what it does inside each step the engine runs (the
    #: forward's context, the loss backward is called on, the optimizer step, checkpointed
    #: state: ``framework/steps.py``); trainers run their own steps.
    step: Callable[[TurboConfig, torch.device], StepHooks] | None = None
    #: ``(optimizer) -> {state: PlannedState}``: the smaller optimizer states it can rebuild
    #: ``optimizer`` with, and their bytes: what the tuner's memory planner may give a plan.
    optimizer_states: Callable[[torch.optim.Optimizer], dict[str, PlannedState]] | None = None
    #: ``(config, source) -> plan``: the batches it trains on (``data/batch_plan.py``), which
    #: every host and the tuner's trials build alike, when ``[data] batches`` names its plan
    #: (``plans``, one of ``config.sections.BatchPlanName``).
    batches: Callable[[TurboConfig, BatchSource], BatchPlan] | None = None
    plans: str = ""
    #: What its batch plan needs of the host: "lengths" (one per sample), "model" (it checks
    #: the model the batches feed). Hosts ask the registry (``registry.plan_needs``).
    needs: frozenset[str] = frozenset()
    #: Once the transform took effect, floating 4-D inputs must be laid out NHWC as well.
    channels_last_inputs: bool = False
    #: ``(error) -> (result, error to raise)`` when ``error`` is this technique failing during
    #: a step (compile errors surface only then); None for any other error.
    explain_failure: Callable[[BaseException], tuple[TechniqueResult, Exception] | None] | None = (
        None
    )
    #: Host -> ``(config) -> why that host's trainer carries it itself`` (None: it does not);
    #: the host's callback then leaves it to the trainer.
    carried_by: Mapping[Host, Callable[[TurboConfig], str | None]] = field(default_factory=dict)
    stage: Stage | None = None
    levers: tuple[Lever, ...] = ()
    #: Trainer -> ``(config, arguments)`` adding its keywords and notes; without one, each
    #: changed field of the section is noted as applied by the callback (or not carried).
    translations: Mapping[Trainer, Callable[[TurboConfig, TrainerArguments], None]] = field(
        default_factory=dict
    )

    def __post_init__(self) -> None:
        if not self.order_reason:
            raise ValueError(f"technique {self.name!r}: say why its order ({self.order})")
        if (self.batches is None) != (not self.plans):
            raise ValueError(
                f"technique {self.name!r}: a batches hook and the plan it is named by (plans) "
                "go together"
            )

    def carried(self, host: Host, config: TurboConfig) -> str | None:
        """Why ``host``'s trainer applies this itself for ``config``, or None."""
        why = self.carried_by.get(host)
        return None if why is None else why(config)

    def section_of(self, config: TurboConfig) -> Any:
        """This technique's section of ``config``."""
        return config.section(self.section)

    def owned_fields(self, config: TurboConfig) -> list[str]:
        """The fields of its section it owns (``fields``, else all of them)."""
        return [
            f.name
            for f in dataclasses.fields(self.section_of(config))
            if not self.fields or f.name in self.fields
        ]

    def changed_fields(self, config: TurboConfig) -> list[str]:
        """The fields of its section that ``config`` sets away from their defaults."""
        section = self.section_of(config)
        default = type(section)()
        return [
            name
            for name in self.owned_fields(config)
            if getattr(section, name) != getattr(default, name)
        ]
