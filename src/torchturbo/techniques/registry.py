"""The registered techniques, in their one order, and the only code that calls their hooks.

Every module directly in this package (not in ``framework/`` or ``tools/``) is a technique and
defines ``TECHNIQUE`` (or a tuple ``TECHNIQUES``): adding a technique is adding its module, with
no list to edit. The functions below are what the engine, both trainer callbacks, the tuner, the
doctor and the translations call, so the order exists once (every hook by ``order``, see
``framework/spec.py``) and a technique reaches every host by being registered.

Discovery imports the modules by name (``pkgutil``), as a plugin system does: this module sits
above the techniques it finds, and nothing below it imports it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import pkgutil
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

import torchturbo.techniques
from torchturbo.data.batch_plan import BatchPlan, BatchSource
from torchturbo.techniques.framework.facts import Facts
from torchturbo.techniques.framework.levers import RankedLever
from torchturbo.techniques.framework.proposal import AsideCandidate, PlannedState
from torchturbo.techniques.framework.result import TechniqueResult, applied, not_applied
from torchturbo.techniques.framework.spec import Host, Lever, Stage, Technique, TrainerArguments
from torchturbo.techniques.framework.steps import Steps


@functools.cache
def techniques() -> tuple[Technique, ...]:
    """Every registered technique, by ``order``."""
    found: list[Technique] = []
    for name in technique_modules():
        module = importlib.import_module(f"torchturbo.techniques.{name}")
        found.extend(getattr(module, "TECHNIQUES", ()))
        if hasattr(module, "TECHNIQUE"):
            found.append(module.TECHNIQUE)
    for attribute in ("name", "order"):
        values = [getattr(t, attribute) for t in found]
        repeated = sorted({v for v in values if values.count(v) > 1})
        if repeated:
            raise RuntimeError(f"two techniques have the same {attribute}: {repeated}")
    return tuple(sorted(found, key=lambda t: t.order))


def technique_modules() -> list[str]:
    """The modules directly in ``torchturbo/techniques``: one technique each."""
    return [
        info.name
        for info in pkgutil.iter_modules(torchturbo.techniques.__path__)
        if not info.ispkg and info.name != "registry"
    ]


def technique(name: str) -> Technique:
    """The registered technique called ``name``."""
    by_name = {t.name: t for t in techniques()}
    if name not in by_name:
        raise KeyError(f"no technique {name!r}; registered: {sorted(by_name)}")
    return by_name[name]


# -- composing a model ------------------------------------------------------------------------


def compose_model(
    model: nn.Module, config: Any, device: torch.device, host: Host
) -> dict[str, TechniqueResult]:
    """Apply, in place and in order, every model transform ``config`` asks for that
    ``host``'s trainer does not carry itself; what each did, by technique name. The model must
    be on ``device`` already (float8 and compile specialise on it)."""
    results: dict[str, TechniqueResult] = {}
    for entry in techniques():
        if entry.transform is None or not entry.requested(config):
            continue
        if entry.carried(host, config) is None:
            results[entry.name] = entry.transform(model, config, device)
    return results


def transform_named(
    model: nn.Module, config: Any, device: torch.device, names: Sequence[str]
) -> dict[str, TechniqueResult]:
    """Apply, in order, the transforms of the techniques called ``names`` that ``config`` asks
    for: a copy of a composed model built aside gets only what is being tried on it."""
    return {
        entry.name: entry.transform(model, config, device)
        for entry in techniques()
        if entry.name in names and entry.transform is not None and entry.requested(config)
    }


def aside_candidates(config: Any, facts: Facts) -> list[tuple[Technique, AsideCandidate]]:
    """Each technique tuning inside the run may build aside from ``config``
    (``Technique.built_aside``), with its candidate."""
    return [(t, t.built_aside(config, facts)) for t in techniques() if t.built_aside is not None]


@contextlib.contextmanager
def held_switches(
    config: Any,
    device: torch.device,
    host: Host,
    results: dict[str, TechniqueResult],
    switching: list[Technique] | None = None,
) -> Iterator[None]:
    """Hold every process-wide switch ``config`` asks for (and ``host`` does not carry) while
    the block runs, restoring each on exit; records what each did in ``results``.
    ``switching`` is :func:`step_switches` of the same config and host, when the caller kept
    it (the engine enters this every step)."""
    if switching is None:
        switching = step_switches(config, host)
    with contextlib.ExitStack() as stack:
        for entry in switching:
            assert entry.switch is not None
            context = entry.switch(config, device)
            if isinstance(context, str):
                results[entry.name] = not_applied(entry.name, context)
                continue
            stack.enter_context(context)
            results.setdefault(entry.name, applied(entry.name))
        yield


def step_switches(config: Any, host: Host) -> list[Technique]:
    """The switching techniques a host holds around each step (empty: nothing to hold, and
    the engine's step skips the context entirely)."""
    return [
        t
        for t in techniques()
        if t.switch is not None and t.requested(config) and t.carried(host, config) is None
    ]


def step_hooks(config: Any, device: torch.device) -> Steps:
    """The step hooks of every technique ``config`` asks for that has them, in order: all the
    engine runs of techniques inside a step (autocast, loss scaling, the optimizer step)."""
    return Steps(
        [(t.name, t.step(config, device)) for t in techniques() if t.step and t.requested(config)]
    )


def channels_last_inputs(results: dict[str, TechniqueResult]) -> bool:
    """Whether a technique that took effect needs floating 4-D inputs laid out NHWC."""
    return any(
        t.channels_last_inputs and t.name in results and results[t.name].applied
        for t in techniques()
    )


def batch_plan(config: Any, source: BatchSource) -> BatchPlan:
    """The batches ``config`` trains on: the plan of the technique that ``[data] batches``
    names, else the host's own (``BatchPlan.rows``). Every host and the tuner's trials call
    this, so all of them build the same batches from the same config and seed."""
    planner = _planner(config)
    if planner is None:
        return BatchPlan.rows()
    assert planner.batches is not None
    return planner.batches(config, source)


def plan_needs(config: Any) -> frozenset[str]:
    """What ``config``'s batch plan needs of the host ("lengths", "model"); empty for rows."""
    planner = _planner(config)
    return frozenset() if planner is None else planner.needs


def batch_plans() -> dict[str, Technique]:
    """Every plan ``[data] batches`` may name but rows, and the technique that plans it."""
    return {t.plans: t for t in techniques() if t.plans}


def batch_key(config: Any) -> tuple[str, Hashable]:
    """What decides ``config``'s batches: the technique that plans them and its section (the
    ``[data]`` loader fields left out: they change how batches are loaded, not which), or the
    host's own rows and their padding multiple. Configs with equal keys train on equal
    batches."""
    planner = _planner(config)
    batching = config.data.batching()
    if planner is None:
        return ("rows", batching.pad_to_multiple)
    section = batching if planner.section == "data" else planner.section_of(config)
    return (planner.name, section)


def plans_batches(config: Any) -> bool:
    """Whether a technique ``config`` asks for plans the batches (else the host's own rows)."""
    return _planner(config) is not None


def _planner(config: Any) -> Technique | None:
    name = config.data.batches
    if name == "rows":
        return None
    plans = batch_plans()
    if name not in plans:
        raise ValueError(
            f"[data] batches = {name!r}: no technique plans it; registered: {sorted(plans)}"
        )
    return plans[name]


def rebuild_optimizer(
    optimizer: torch.optim.Optimizer, config: Any
) -> tuple[torch.optim.Optimizer, dict[str, TechniqueResult]]:
    """The optimizer to train with after every requested optimizer technique, and their results
    (after the model moved: a fused optimizer's support depends on the parameters' device)."""
    results: dict[str, TechniqueResult] = {}
    for entry in techniques():
        if entry.rebuild_optimizer is not None and entry.requested(config):
            optimizer, results[entry.name] = entry.rebuild_optimizer(optimizer, config)
    return optimizer, results


def optimizer_states(optimizer: torch.optim.Optimizer) -> dict[str, PlannedState]:
    """Every smaller optimizer state a technique can rebuild ``optimizer`` with, and its bytes
    (``Technique.optimizer_states``): what the memory planner chooses from."""
    states: dict[str, PlannedState] = {}
    for entry in techniques():
        if entry.optimizer_states is not None:
            states.update(entry.optimizer_states(optimizer))
    return states


def explain_failure(
    error: BaseException, results: dict[str, TechniqueResult]
) -> tuple[str, TechniqueResult, Exception] | None:
    """The technique that ``error`` is the failure of, among those that took effect: its name,
    the result to report instead and the error to raise; None for any other error."""
    for entry in techniques():
        result = results.get(entry.name)
        if entry.explain_failure is None or result is None or not result.applied:
            continue
        explained = entry.explain_failure(error)
        if explained is not None:
            return entry.name, *explained
    return None


# -- the tuner, the doctor and the translations -----------------------------------------------


def stages() -> list[Stage]:
    """The tuner stages techniques declare, by rank."""
    return sorted((t.stage for t in techniques() if t.stage is not None), key=lambda s: s.rank)


def changed_techniques(before: Any, after: Any) -> list[Technique]:
    """The techniques whose own fields differ between configs ``before`` and ``after``."""
    return [
        t
        for t in techniques()
        if any(
            getattr(t.section_of(before), f) != getattr(t.section_of(after), f)
            for f in t.owned_fields(before)
        )
    ]


def switchable_per_step(before: Any, after: Any) -> bool:
    """Whether a step can switch between ``before`` and ``after``: they differ in at least one
    technique and only in techniques that act inside a step (step hooks, process-wide switches)
    or whose transform can be switched off and on (``toggle``), none that rebuilds the
    optimizer or plans the batches."""
    changed = changed_techniques(before, after)
    if not changed or _dict_without_techniques(before) != _dict_without_techniques(after):
        return False
    return all(
        (t.transform is None or t.toggle is not None)
        and t.rebuild_optimizer is None
        and t.batches is None
        for t in changed
    )


def switchable_by_toggle(before: Any, after: Any) -> bool:
    """Whether a step can switch between ``before`` and ``after`` by switching transforms
    alone (``toggle``): what a host whose steps are not the engine's can switch (a trainer whose
    autocast is its own)."""
    changed = changed_techniques(before, after)
    return switchable_per_step(before, after) and all(
        t.toggle is not None and t.step is None and t.switch is None for t in changed
    )


def requested(name: str, config: Any) -> bool:
    """Whether ``config`` asks for the technique called ``name`` (True for a name no technique
    has: the strategy's results, such as the comm hook)."""
    entry = next((t for t in techniques() if t.name == name), None)
    return entry is None or entry.requested(config)


def set_toggles(model: nn.Module, config: Any) -> None:
    """Switch every switchable transform ``model`` has on or off as ``config`` asks
    (``Technique.toggle``)."""
    for entry in techniques():
        if entry.toggle is not None:
            entry.toggle(model, entry.requested(config))


def _dict_without_techniques(config: Any) -> dict[str, Any]:
    """``config`` as a dict less every field a technique owns: what no technique changes."""
    out = config.to_dict()
    for entry in techniques():
        for name in entry.owned_fields(config):
            out.get(entry.section, {}).pop(name, None)
    return out


def levers() -> list[Lever]:
    """Every technique's doctor levers."""
    return [lever for t in techniques() for lever in t.levers]


def lever(label: str) -> Lever:
    """The lever labelled ``label`` (a KeyError lists the labels)."""
    by_label = {lever.label: lever for lever in levers()}
    if label not in by_label:
        raise KeyError(f"no lever {label!r}; levers: {sorted(by_label)}")
    return by_label[label]


def ranked_levers(facts: Facts) -> list[RankedLever]:
    """Every technique's levers by expected gain on ``facts``, applicable ones first: the
    doctor's ranking (the tuner orders its candidates by the same expectations)."""
    ranked = [RankedLever(lever.label, lever.expect(facts)) for lever in levers()]
    return sorted(ranked, key=lambda lever: -(lever.expectation.gain or 0.0))


def translate(config: Any, arguments: TrainerArguments) -> None:
    """Add every requested technique's keywords and notes for ``arguments.trainer``: its own
    translation, or a note per changed field saying whether the callback applies it."""
    for entry in techniques():
        if not entry.requested(config):
            continue
        hook = entry.translations.get(arguments.trainer)
        if hook is not None:
            hook(config, arguments)
            continue
        applies = entry.transform is not None or entry.switch is not None
        for name in entry.changed_fields(config):
            if applies and entry.carried(arguments.trainer, config) is None:
                arguments.note(entry.section, name, f"applied by {arguments.callback}")
            else:
                arguments.note(entry.section, name, "not carried")
