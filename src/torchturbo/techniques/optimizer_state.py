"""Smaller optimizer state: an Adam or AdamW's moments in bf16, 8 bits, 4 bits or fp8.

Adam keeps two float32 moments per parameter: 8 bytes per parameter, twice the weights. On a
fine-tune that is often the largest part of training memory. ``[optimizer] state`` rebuilds
the user's ``torch.optim.Adam``/``AdamW`` (same parameter groups and hyper-parameters) as

* ``bf16``: :class:`~torchturbo.techniques.tools.bf16_adam.AdamBf16`, moments in bfloat16 with
  stochastic rounding (4 bytes per parameter);
* ``8bit``, ``4bit``, ``fp8``: torchao's ``AdamW8bit``/``Adam8bit``, ``AdamW4bit``/``Adam4bit``,
  ``AdamWFp8``/``AdamFp8``: each moment block-quantised (a float32 scale per block of 256 or
  128 values, a dynamic-tree code map) for tensors of 4,096 values or more, float32 below
  (``planned_state_bytes`` counts both). Their step is ``torch.compile``'d per parameter shape:
  a one-time cost (tens of seconds on a CPU), after which it runs fused.

Loss parity is the tuner's to measure: quantised moments change the trajectory a little each
step (tests/test_optimizer_state.py bounds it over 40 steps). The Hugging Face Trainer builds
its optimizer itself: ``optim="adamw_torch_8bit"`` / ``"adamw_torch_4bit"`` are the same torchao
classes; Lightning users call :func:`rebuild_with_state` in ``configure_optimizers``.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import shutil
from collections.abc import Iterable

import torch

from torchturbo.config import TurboConfig
from torchturbo.techniques.framework.facts import Facts
from torchturbo.techniques.framework.levers import SMALL_GAIN, Expectation, amdahl_gain
from torchturbo.techniques.framework.proposal import (
    Candidate,
    PlannedState,
    StageContext,
    candidate,
)
from torchturbo.techniques.framework.result import TechniqueResult, applied, not_applied
from torchturbo.techniques.framework.spec import Lever, Stage, Technique, TrainerArguments
from torchturbo.techniques.optimizer import held_elsewhere
from torchturbo.techniques.tools.bf16_adam import AdamBf16

NAME = "optimizer_state"
#: The states that shrink the moments, least lossy first (the memory planner's order).
STATES = ("bf16", "8bit", "fp8", "4bit")
#: torchao's class per state, for AdamW and for Adam.
TORCHAO_CLASSES = {
    "8bit": ("AdamW8bit", "Adam8bit"),
    "4bit": ("AdamW4bit", "Adam4bit"),
    "fp8": ("AdamWFp8", "AdamFp8"),
}
#: torchao quantises a moment with at least this many values (as bitsandbytes does) and a
#: count divisible by the block; others stay float32.
QUANTISED_MIN_VALUES = 4096
#: Per state: (bytes per value, values per float32 scale, float32 entries of the code map).
_LAYOUT = {"8bit": (1.0, 256, 256), "4bit": (0.5, 128, 16), "fp8": (1.0, 256, 0)}
#: The Trainer's ``optim`` names for torchao's states (transformers' OptimizerNames).
HF_OPTIM = {"8bit": "adamw_torch_8bit", "4bit": "adamw_torch_4bit"}


def state_unavailable(state: str, device: torch.device | str = "cpu") -> str | None:
    """Why ``state`` cannot run here, or None when it can."""
    if state not in TORCHAO_CLASSES:
        return None
    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed: pip install 'torchturbo[float8]' (it brings torchao)"
    if torch.device(device).type == "cpu" and not any(
        shutil.which(c) for c in ("c++", "g++", "clang++")
    ):
        return "torchao compiles its optimizer step, and inductor finds no C++ compiler here"
    return None


def state_unsupported(optimizer: torch.optim.Optimizer, state: str) -> str | None:
    """Why ``optimizer`` cannot be rebuilt with ``state``, or None when it can."""
    name = type(optimizer).__name__
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return f"{name}: smaller moment states exist for torch.optim.Adam and AdamW only"
    defaults = optimizer.defaults
    refused = [flag for flag in ("maximize", "capturable", "differentiable") if defaults.get(flag)]
    if state == "bf16" and defaults.get("amsgrad"):
        refused.append("amsgrad")
    if refused:
        return f"{name}({', '.join(f'{f}=True' for f in refused)}): not kept by the {state} state"
    if optimizer.state:
        return (
            f"{name} has stepped: its float32 moments would be requantised mid-run; rebuild "
            "before the first step"
        )
    return held_elsewhere(optimizer) or state_unavailable(state, _device(optimizer))


def rebuild_with_state(optimizer: torch.optim.Optimizer, state: str) -> torch.optim.Optimizer:
    """``optimizer`` (an Adam or AdamW that has not stepped) rebuilt to keep its moments as
    ``state``, with the same parameter groups and hyper-parameters; a ValueError saying why
    when it cannot be. For ``configure_optimizers``::

        return rebuild_with_state(torch.optim.AdamW(self.parameters(), lr=3e-4), "8bit")
    """
    if state not in STATES:
        raise ValueError(f"state={state!r} is invalid: expected one of {', '.join(STATES)}")
    reason = state_unsupported(optimizer, state)
    if reason is not None:
        raise ValueError(f"cannot keep the optimizer state as {state}: {reason}")
    decoupled = _decoupled(optimizer)
    keys = ("lr", "betas", "eps", "weight_decay") + (("amsgrad",) if state != "bf16" else ())
    groups = [
        {k: v for k, v in g.items() if k == "params" or k in keys} for g in optimizer.param_groups
    ]
    settings = {k: optimizer.defaults[k] for k in keys}
    if state == "bf16":
        return AdamBf16(groups, **settings, decoupled=decoupled)
    import torchao.optim

    adamw, adam = TORCHAO_CLASSES[state]
    cls = getattr(torchao.optim, adamw if decoupled else adam)
    rebuilt: torch.optim.Optimizer = cls(groups, **settings)
    return rebuilt


def _decoupled(optimizer: torch.optim.Optimizer) -> bool:
    """AdamW, or an Adam whose weight decay is decoupled (torch >= 2.7's flag)."""
    return isinstance(optimizer, torch.optim.AdamW) or bool(
        optimizer.defaults.get("decoupled_weight_decay")
    )


def _device(optimizer: torch.optim.Optimizer) -> torch.device:
    for group in optimizer.param_groups:
        for param in group["params"]:
            return torch.device(param.device)
    return torch.device("cpu")


def planned_state_bytes(parameters: Iterable[torch.Tensor], state: str) -> int:
    """Bytes the two moments (and the step counter) of ``parameters`` take as ``state``, as
    torchao and :class:`AdamBf16` allocate them (``as_built``: torch's float32 moments)."""
    total = 0
    for param in parameters:
        if not param.requires_grad:
            continue
        values = param.numel()
        total += 4 + 2 * _moment_bytes(values, state)  # a float32 step counter, two moments
    return total


def _moment_bytes(values: int, state: str) -> int:
    if state == "bf16":
        return 2 * values
    if state not in _LAYOUT:
        return 4 * values
    per_value, block, code_map = _LAYOUT[state]
    if values < QUANTISED_MIN_VALUES or values % block:
        return 4 * values
    return math.ceil(per_value * values) + 4 * (values // block) + 4 * code_map


def _rebuild(
    optimizer: torch.optim.Optimizer, config: TurboConfig
) -> tuple[torch.optim.Optimizer, TechniqueResult]:
    state = config.optimizer.state
    if config.optimizer.implementation != "as_built":
        return optimizer, not_applied(
            NAME,
            f"[optimizer] implementation = {config.optimizer.implementation!r} rebuilt it with "
            "torch's kernel, which a smaller state would replace: set implementation = "
            f"'as_built' to keep the moments as {state}",
        )
    try:
        return rebuild_with_state(optimizer, state), applied(NAME, (type(optimizer).__name__,))
    except ValueError as err:
        return optimizer, not_applied(NAME, str(err).split(": ", 1)[-1])


#: The optimizer step's share of a training step above which its state's format is a speed
#: candidate: torchao's compiled step against the user's (below it, only the memory planner
#: proposes smaller states, for their bytes).
LARGE_SHARE = 0.25
#: The states the speed stage tries: torchao's, whose step is compiled and fused (bf16's
#: stochastic rounding runs eagerly, slower than torch's AdamW, and is proposed for memory).
SPEED_STATES = ("8bit", "4bit", "fp8")


def optimizer_state_stage(ctx: StageContext) -> list[Candidate] | str:
    """Where the optimizer step is a large share of the step: torchao's states, each measured
    for speed and loss parity against the current best (not applicable where measured
    slower: ``optimizer_state_gain``)."""
    share = ctx.facts.optimizer_share
    if share is None or share < LARGE_SHARE:
        shown = "unmeasured" if share is None else f"{share:.0%} of a step"
        return (
            f"the optimizer step is {shown} (under {LARGE_SHARE:.0%}): its state's format "
            "cannot move the step time much; the memory planner proposes smaller states for "
            "their bytes"
        )
    _, optimizer = ctx.recipe.build()
    found = []
    for state in SPEED_STATES:
        if ctx.best.optimizer.state == state:
            continue
        name = f"optimizer:state:{state}"
        config = ctx.best.replace(optimizer__state=state, optimizer__implementation="as_built")
        reason = state_unsupported(optimizer, state)
        if reason is not None:
            found.append(Candidate(name, config, not_applicable=reason))
            continue
        expectation = optimizer_state_gain(ctx.facts, state)
        one_time = step_compile_seconds(_parameters(optimizer), state)
        found.append(candidate(name, config, expectation, one_time_s=one_time))
    return found


#: torchao compiles its step once per parameter shape: seconds to start, and per shape, on an
#: idle 2-core CPU (measured 49-135 s for 8 shapes at load 5-6, about three times idle).
STEP_COMPILE_BASE_S = 10.0
STEP_COMPILE_PER_SHAPE_S = 5.0


def step_compile_seconds(parameters: Iterable[torch.Tensor], state: str) -> float:
    """The one-time cost of ``state``'s first optimizer step: torchao compiles it for each
    parameter shape (none for bf16, which runs eagerly)."""
    if state not in TORCHAO_CLASSES:
        return 0.0
    shapes = {tuple(p.shape) for p in parameters if p.requires_grad}
    return STEP_COMPILE_BASE_S + STEP_COMPILE_PER_SHAPE_S * len(shapes)


def _planned_states(optimizer: torch.optim.Optimizer) -> dict[str, PlannedState]:
    """``Technique.optimizer_states``: every state ``optimizer`` can be rebuilt with, and its
    bytes and first step's one-time cost over the optimizer's parameters."""
    parameters = _parameters(optimizer)
    return {
        state: PlannedState(
            planned_state_bytes(parameters, state), step_compile_seconds(parameters, state)
        )
        for state in STATES
        if state_unsupported(optimizer, state) is None
    }


def _parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _hf_arguments(config: TurboConfig, arguments: TrainerArguments) -> None:
    state = config.optimizer.state
    if state in HF_OPTIM:
        arguments.kwargs["optim"] = HF_OPTIM[state]
        return
    arguments.note(
        "optimizer",
        "state",
        f"{state!r} not carried: TrainingArguments' optim has no {state} state; pass "
        f"optimizers=(rebuild_with_state(torch.optim.AdamW(...), {state!r}), None) to the "
        "Trainer (torchturbo.techniques.optimizer_state)",
    )


def _lightning_arguments(config: TurboConfig, arguments: TrainerArguments) -> None:
    state = config.optimizer.state
    arguments.note(
        "optimizer",
        "state",
        f"{state!r} not carried: return rebuild_with_state(torch.optim.AdamW(...), {state!r}) "
        "from configure_optimizers (torchturbo.techniques.optimizer_state)",
    )


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes ``optimizer``'s state tensors hold (through torchao's quantised subclasses)."""
    from torchturbo.measure.memory import tensor_bytes

    return sum(
        tensor_bytes(v)
        for per_param in optimizer.state.values()
        for v in per_param.values()
        if isinstance(v, torch.Tensor)
    )


#: torchao's low-bit optimizer steps over torch's AdamW (as built) on the 2-core CPU, a 4.5M
#: parameter Llama (benchmarks/optimizer_state.py, load 5-6): per-parameter compiled graphs
#: that (de)quantise run far slower than AdamW's loop there.
OPTIMIZER_STATE_CPU_SPEED = {"8bit": 0.13, "4bit": 0.08, "fp8": 0.2}


#: Bytes a fused AdamW step moves per parameter (read p, g, m, v; write p, m, v: 28) over what
#: the state's step moves (8-bit and fp8 moments: 16; 4-bit: 14): the most a bandwidth-bound
#: step could gain, not a measurement.
OPTIMIZER_STATE_BYTES_BOUND = {"8bit": 1.75, "fp8": 1.75, "4bit": 2.0}


def optimizer_state_gain(facts: Facts, state: str) -> Expectation:
    """A torchao state's optimizer step. On a CPU it was measured slower than torch's AdamW
    (not applicable); on a GPU, Amdahl's law over the optimizer's share with the bytes the
    step moves as the bound (an AdamW step is memory-bound: unmeasured here, hence a bound)."""
    measured = OPTIMIZER_STATE_CPU_SPEED.get(state)
    if facts.device.startswith("cpu") and measured is not None:
        return Expectation(
            None,
            f"torchao's compiled {state} step ran at {measured:g}x torch's AdamW step on a "
            "2-core CPU (benchmarks/optimizer_state.py): a smaller state saves memory here, "
            "never time",
        )
    bound = OPTIMIZER_STATE_BYTES_BOUND.get(state)
    if bound is None or facts.optimizer_share is None:
        return Expectation(SMALL_GAIN, f"the optimizer's moments kept as {state}")
    gain = amdahl_gain(facts.optimizer_share, bound)
    return Expectation(
        gain,
        f"the optimizer step is {facts.optimizer_share:.0%} of a step; {state} moments move "
        f"1/{bound:g} of its bytes, an upper bound on its gain",
    )


TECHNIQUE = Technique(
    name=NAME,
    section="optimizer",
    fields=("state",),
    doc="docs/techniques/optimizer_state.md",
    requested=lambda config: config.optimizer.state != "as_built",
    order=71,
    order_reason=(
        "after the fused/foreach rebuild (70), whose optimizer it is handed: it refuses to "
        "replace a fused or foreach one, and says so"
    ),
    rebuild_optimizer=_rebuild,
    optimizer_states=_planned_states,
    stage=Stage("optimizer_state", 55, optimizer_state_stage),
    levers=tuple(
        Lever(f"{state} optimizer state", functools.partial(optimizer_state_gain, state=state))
        for state in SPEED_STATES
    ),
    translations={"transformers": _hf_arguments, "lightning": _lightning_arguments},
)
