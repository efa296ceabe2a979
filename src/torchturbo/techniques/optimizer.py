"""The optimizer step as one fused kernel (``fused=True``) or multi-tensor kernels (``foreach``).

Built as ``torch.optim.AdamW(params)``, an optimizer on a CPU updates its parameters one tensor
at a time, several small ops per tensor (torch picks ``foreach`` by itself only when every
parameter is on CUDA). ``foreach=True`` runs each op across all parameters at once;
``fused=True`` runs the whole update in one kernel (Adam, AdamW, SGD, Adagrad on CPU and CUDA
in recent torch). Same maths, fewer kernel launches and passes over memory; results differ only
in floating-point rounding (tests/test_optimizer.py).

The user hands over an optimizer already built, so it is rebuilt with the flag: the same class,
parameter groups, hyper-parameters and state (through ``state_dict``/``load_state_dict``, the
public way to move state between optimizers, which also moves ``step`` counters where the fused
kernel wants them). Where that cannot be done faithfully the optimizer is left as built and the
reason reported: the class has no such option, torch has no such kernel for these parameters
(tried on a one-element probe, since the fused device check runs only at the first step), or
something holds on to the old object (an LR scheduler patches ``optimizer.step``; hooks are
registered on it) and would keep driving it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from torchturbo.config import TurboConfig
from torchturbo.techniques.framework.facts import Facts
from torchturbo.techniques.framework.levers import SMALL_GAIN, Expectation, amdahl_gain
from torchturbo.techniques.framework.proposal import Candidate, StageContext, candidate
from torchturbo.techniques.framework.result import TechniqueResult, applied, not_applied
from torchturbo.techniques.framework.spec import Lever, Stage, Technique, TrainerArguments

#: The flags a rebuild can set; each excludes the other (torch refuses both True).
IMPLEMENTATIONS = ("foreach", "fused")
#: torch.optim.Optimizer's per-instance hook registries (private attributes, read only).
_HOOK_DICTS = (
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)


def implementation_unsupported(
    optimizer: torch.optim.Optimizer, implementation: str, device: torch.device | str | None = None
) -> str | None:
    """Why ``optimizer`` cannot be rebuilt with ``implementation`` (``foreach`` or ``fused``)
    for parameters on ``device`` (default: where its parameters are), or None if it can."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation={implementation!r} is invalid: expected one of "
            f"{', '.join(IMPLEMENTATIONS)}"
        )
    name = type(optimizer).__name__
    accepted = inspect.signature(type(optimizer)).parameters
    if implementation not in accepted:
        return f"{name} has no {implementation}= option"
    held = held_elsewhere(optimizer)
    if held:
        return held
    return _probe(optimizer, implementation, device)


def rebuild_optimizer(
    optimizer: torch.optim.Optimizer, implementation: str
) -> tuple[torch.optim.Optimizer, str | None]:
    """``optimizer`` rebuilt with ``implementation=True`` and the same groups, hyper-parameters
    and state: (the new optimizer, None). Where it cannot be: (``optimizer`` itself, why not).

    The new optimizer shares the old one's state tensors; use only the new one afterwards.
    """
    reason = implementation_unsupported(optimizer, implementation)
    if reason is not None:
        return optimizer, reason
    flags = _flags(type(optimizer), implementation)
    groups = [{**group, **flags} for group in optimizer.param_groups]
    rebuilt = type(optimizer)(groups, **_arguments(optimizer, flags))
    state = optimizer.state_dict()
    # load_state_dict takes hyper-parameters from the saved groups and casts state by their
    # flags (a fused step keeps its counters on the parameters' device): set the new flags there.
    state["param_groups"] = [{**group, **flags} for group in state["param_groups"]]
    rebuilt.load_state_dict(state)
    return rebuilt, None


def _flags(cls: type, implementation: str) -> dict[str, bool]:
    """``implementation=True`` and, where the class has it, the other flag off."""
    other = next(flag for flag in IMPLEMENTATIONS if flag != implementation)
    flags = {implementation: True}
    if other in inspect.signature(cls).parameters:
        flags[other] = False
    return flags


def _arguments(optimizer: torch.optim.Optimizer, flags: dict[str, bool]) -> dict[str, Any]:
    """Constructor arguments that rebuild ``optimizer.defaults`` with ``flags`` set. A default the
    constructor does not take (AdamW fixes ``decoupled_weight_decay``) is checked by the probe."""
    accepted = inspect.signature(type(optimizer)).parameters
    return {k: v for k, v in {**optimizer.defaults, **flags}.items() if k in accepted}


def held_elsewhere(optimizer: torch.optim.Optimizer) -> str | None:
    """Why a rebuilt copy would be bypassed: something bound to the old object."""
    if "step" in vars(optimizer):
        return (
            "optimizer.step is patched (an LR scheduler built on it, or a wrapper) and would keep "
            "driving the old optimizer: build schedulers from the optimizer Turbo.setup returns"
        )
    # Instance hooks live in private dicts; a rebuilt optimizer would silently lose them.
    hooks = [name for name in _HOOK_DICTS if getattr(optimizer, name, None)]
    if hooks:
        return "hooks are registered on this optimizer instance; a rebuilt one would lose them"
    return None


def _probe(
    optimizer: torch.optim.Optimizer, implementation: str, device: torch.device | str | None
) -> str | None:
    """Step a one-element copy with the flag set on each (device, dtype) of the parameters:
    torch checks fused support only when stepping."""
    kinds = {
        (torch.device(device) if device is not None else p.device, p.dtype)
        for group in optimizer.param_groups
        for p in group["params"]
    }
    flags = _flags(type(optimizer), implementation)
    name = f"{type(optimizer).__name__}({implementation}=True)"
    for where, dtype in sorted(kinds, key=str):
        probe = torch.zeros(1, device=where, dtype=dtype, requires_grad=True)
        probe.grad = torch.zeros_like(probe)
        try:
            copy = type(optimizer)([probe], **_arguments(optimizer, flags))
            copy.step()
        except (RuntimeError, ValueError, TypeError) as err:
            return f"{name} on {dtype} {where}: {err}"
        differs = sorted(
            key
            for key, value in optimizer.defaults.items()
            if key not in flags and _differs(copy.defaults.get(key, _MISSING), value)
        )
        if differs:
            return f"{name} would not keep the hyper-parameters {differs} of the optimizer built"
    return None


_MISSING = object()


def _differs(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return not (
            isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
        )
    return a != b


def optimizer_stage(ctx: StageContext) -> list[Candidate] | str:
    """The user's optimizer rebuilt with foreach/fused where its class and the device allow."""
    _, optimizer = ctx.recipe.build()
    current = ctx.best.optimizer.implementation
    candidates, skipped = [], []
    for implementation in IMPLEMENTATIONS:
        if implementation == current:
            continue
        reason = implementation_unsupported(optimizer, implementation, ctx.device)
        if implementation == "foreach" and ctx.device.type == "cuda" and current == "as_built":
            # Left at foreach=None, torch already runs foreach when all parameters are on CUDA.
            reason = "torch already uses foreach on CUDA"
        if reason:
            skipped.append(f"{implementation}: {reason}")
        else:
            config = ctx.best.replace(optimizer__implementation=implementation)
            expectation = optimizer_gain(ctx.facts, implementation)
            candidates.append(candidate(f"optimizer:{implementation}", config, expectation))
    return candidates or "; ".join(skipped)


def _rebuild(
    optimizer: torch.optim.Optimizer, config: TurboConfig
) -> tuple[torch.optim.Optimizer, TechniqueResult]:
    rebuilt, why_not = rebuild_optimizer(optimizer, config.optimizer.implementation)
    if why_not is None:
        return rebuilt, applied("optimizer")
    return rebuilt, not_applied("optimizer", why_not)


def _translation(how: str) -> Callable[[TurboConfig, TrainerArguments], None]:
    """A note for either trainer: it builds the optimizer, so ``how`` says what to set."""

    def note(config: TurboConfig, arguments: TrainerArguments) -> None:
        arguments.note(
            "optimizer",
            "implementation",
            f"{config.optimizer.implementation!r} not carried: the trainer builds the optimizer; "
            f"{how}",
        )

    return note


#: How many times faster the optimizer step itself runs rebuilt, from benchmarks/fused_optimizer.py
#: on the 2-core CPU (Adam/AdamW: foreach 1.2-1.4x, fused 3.2-4.9x; SGD less).
OPTIMIZER_STEP_SPEEDUP = {"foreach": 1.3, "fused": 3.0}


def optimizer_gain(facts: Facts, implementation: str) -> Expectation:
    """foreach or fused: Amdahl's law over the optimizer's share of the step."""
    speedup = OPTIMIZER_STEP_SPEEDUP.get(implementation)
    if speedup is None or facts.optimizer_share is None:
        return Expectation(SMALL_GAIN, f"a {implementation} optimizer step")
    gain = amdahl_gain(facts.optimizer_share, speedup)
    return Expectation(
        gain,
        f"the optimizer step is {facts.optimizer_share:.0%} of a step; {implementation} runs it "
        f"~{speedup:g}x faster",
    )


TECHNIQUE = Technique(
    name="optimizer",
    order=70,
    order_reason=(
        "rebuilds the optimizer once the model is composed: a fused step's support depends on "
        "the parameters' device"
    ),
    section="optimizer",
    doc="docs/techniques/fused_optimizer.md",
    requested=lambda config: config.optimizer.implementation != "as_built",
    rebuild_optimizer=_rebuild,
    stage=Stage("optimizer", 50, optimizer_stage),
    levers=tuple(
        Lever(f"{flag} optimizer", functools.partial(optimizer_gain, implementation=flag))
        for flag in IMPLEMENTATIONS
    ),
    translations={
        "transformers": _translation(
            "set optim: 'adamw_torch_fused' (the Trainer's default) is AdamW fused"
        ),
        "lightning": _translation(
            "build it with fused=True or foreach=True in configure_optimizers"
        ),
    },
)
