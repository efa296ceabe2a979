"""Numeric precision as one object: autocast, loss scaling, TF32, and their saved state.

:class:`Precision` is the technique's step hooks (``framework/steps.py``), as Lightning
Fabric's precision plugins are: the forward's autocast context, scaling the loss before
backward, unscaling the gradients before clipping, the optimizer step (which a GradScaler may
skip), the TF32 switches, and a ``state_dict`` for checkpoints. The engine reaches it through
the registry alone. One class rather than a hierarchy: the configs differ only in an autocast
dtype, an optional GradScaler and an optional TF32 scope.

Uses the device-generic ``torch.amp`` API (the article's ``torch.cuda.amp`` is deprecated).
bf16 keeps fp32's exponent range and needs no loss scaling; fp16 does, and gradients must be
unscaled before clipping.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

from torchturbo.config import PrecisionConfig, TurboConfig
from torchturbo.techniques.framework.facts import Facts
from torchturbo.techniques.framework.levers import Expectation
from torchturbo.techniques.framework.proposal import Candidate, StageContext, candidate
from torchturbo.techniques.framework.result import TechniqueResult, applied, not_applied
from torchturbo.techniques.framework.spec import Lever, Stage, Technique, TrainerArguments
from torchturbo.techniques.framework.steps import StepHooks

AUTOCAST_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}
_NULL = contextlib.nullcontext()


class Precision(StepHooks):
    """The precision of training steps on ``device`` as ``config`` asks."""

    def __init__(self, config: PrecisionConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        #: What the requested precision does on this device; None for fp32 (nothing requested).
        self.result = None if config.dtype == "fp32" else check_precision(config, device)
        effective = self.result is not None and self.result.applied
        #: The dtype the forward autocasts to; None runs it in the parameters' dtype.
        self.autocast_dtype = AUTOCAST_DTYPES.get(config.dtype) if effective else None
        #: fp16's GradScaler; None for every other dtype.
        self.scaler = (
            torch.amp.GradScaler(device.type) if effective and config.uses_scaler else None
        )
        self._tf32 = effective and config.dtype == "tf32"

    def forward_context(self) -> contextlib.AbstractContextManager[Any]:
        """The autocast context for the forward pass; a no-op for fp32 and tf32."""
        if self.autocast_dtype is None:
            return _NULL
        return torch.amp.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def step_context(self) -> contextlib.AbstractContextManager[Any]:
        """TF32 for the span of one step (forward, backward, optimizer); a no-op otherwise.

        The switches are process-wide: holding them only while the engine steps keeps them out
        of the user's other code and out of other engines in the same process (the bench and
        the tuner interleave the steps of several).
        """
        return float32_matmul_precision(self.config) if self._tf32 else _NULL

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The tensor to call ``backward`` on: the loss times the GradScaler's scale, if any."""
        return loss if self.scaler is None else self.scaler.scale(loss)

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the loss scale, so that clipping sees true gradients."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, *, finite: bool) -> bool | None:
        """With a GradScaler, step ``optimizer`` through it and return whether it skipped;
        without one, leave the step to the engine (None).

        ``finite`` is the engine's guard, which sees the gradients as they will be applied
        (after unscaling and clipping). A GradScaler also skips on inf/NaN of its own and then
        lowers its scale, which is how its skip is told apart; it updates its scale either way.
        """
        if self.scaler is None:
            return None
        scale_before = self.scaler.get_scale()
        if finite:
            self.scaler.step(optimizer)
        self.scaler.update()
        return not finite or self.scaler.get_scale() < scale_before

    def checks_finite(self) -> bool:
        """A GradScaler skips non-finite gradients itself (and lowers its scale)."""
        return self.scaler is not None

    def state_dict(self) -> dict[str, Any]:
        """The loss scaler's state (its scale and growth tracker); empty without one."""
        return {} if self.scaler is None else {"scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])

    def older_state(self, files: dict[str, Any]) -> dict[str, Any] | None:
        """Checkpoint version 1 kept the loss scale as scaler.pt."""
        return {"scaler": files["scaler.pt"]} if "scaler.pt" in files else None


def check_precision(config: PrecisionConfig, device: torch.device) -> TechniqueResult:
    """Whether ``config.dtype`` takes effect on ``device``, and why not when it does not."""
    cuda_capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if config.dtype == "tf32":
        if cuda_capability is None or cuda_capability < (8, 0):
            return not_applied(
                "precision",
                f"TF32 is a CUDA tensor-core format (compute capability >= 8.0); on "
                f"{device.type}{'' if cuda_capability is None else f' {cuda_capability}'} "
                "float32 stays float32",
            )
        return applied("precision")
    if not torch.amp.is_autocast_available(device.type):
        return not_applied("precision", f"torch.amp has no autocast for {device.type!r}")
    return applied("precision")


@contextlib.contextmanager
def float32_matmul_precision(config: PrecisionConfig) -> Iterator[None]:
    """Allow TF32 for float32 matmuls and convolutions while the context is open.

    These are process-wide switches, restored on exit instead of leaking into other code.
    """
    if config.dtype != "tf32":
        yield
        return
    saved = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved[0])
        torch.backends.cudnn.allow_tf32 = saved[1]


_CANDIDATE_NAMES = {"bf16": "bf16", "fp16": "fp16+scaler", "tf32": "tf32"}


def precision_stage(ctx: StageContext) -> list[Candidate] | str:
    """bf16, fp16 with its scaler, TF32. A precision whose matrix products are no faster than
    fp32's here (TF32 on a CPU, bf16 or fp16 without native units) is decided by that
    micro-benchmark (``precision_gain``), not by training."""
    return [
        candidate(
            _CANDIDATE_NAMES[dtype],
            ctx.best.replace(precision__dtype=dtype),
            precision_gain(ctx.facts, dtype),
        )
        for dtype in ("bf16", "fp16", "tf32")
    ]


def _tf32_switch(
    config: TurboConfig, device: torch.device
) -> contextlib.AbstractContextManager[Any] | str:
    """TF32 for a trainer's whole run where it takes effect; why not elsewhere. bf16 and fp16
    are the trainers' own arguments (autocast and the scaler are theirs)."""
    if config.precision.dtype != "tf32":
        return f"{config.precision.dtype} is the trainer's own precision argument"
    result = check_precision(config.precision, device)
    if result.reason is not None:
        return result.reason
    return float32_matmul_precision(config.precision)


def _uses_cuda(config: TurboConfig) -> bool:
    device = config.device
    return device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())


def _hf_carries(config: TurboConfig) -> str | None:
    if config.precision.dtype in ("bf16", "fp16"):
        return f"TrainingArguments({config.precision.dtype}=True)"
    if _uses_cuda(config):
        return "TrainingArguments(tf32=True)"
    return None


def _hf_arguments(config: TurboConfig, arguments: TrainerArguments) -> None:
    dtype = config.precision.dtype
    if dtype in ("bf16", "fp16"):
        arguments.kwargs[dtype] = True  # fp16 brings Trainer's own GradScaler
    elif _uses_cuda(config):
        arguments.kwargs["tf32"] = True
    else:
        arguments.note(
            "precision",
            "dtype",
            "'tf32' not carried: TF32 is a CUDA tensor-core format (Ampere or newer); on a CPU "
            "float32 stays float32, as the engine and the tuner run it",
        )


_LIGHTNING_PRECISION = {"tf32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}


def _lightning_arguments(config: TurboConfig, arguments: TrainerArguments) -> None:
    dtype = config.precision.dtype
    arguments.kwargs["precision"] = _LIGHTNING_PRECISION[dtype]
    if dtype == "tf32":
        arguments.note(
            "precision",
            "dtype",
            f"'tf32' applied by {arguments.callback} (float32 matmul precision 'high') on a GPU "
            "with TF32 units; elsewhere float32 stays float32",
        )


#: Share of a training step spent in dense maths (matmuls, convolutions) that a faster precision
#: speeds up, where it was not measured (``Facts.dense_share``); the rest (elementwise ops,
#: norms, the optimizer) is assumed unchanged. From the built-in workloads' profiles (55-75% on
#: CPU).
DENSE_SHARE = 0.6


def precision_gain(facts: Facts, dtype: str) -> Expectation:
    """bf16, fp16 or tf32: Amdahl's law over the measured GEMM speed-up of that precision."""
    if dtype in facts.emulated:
        return Expectation(None, f"{dtype} cannot pay off here: {facts.emulated[dtype]}")
    speedup = facts.gemm_speedup.get(dtype)
    if speedup is None:
        return Expectation(None, f"{dtype} matrix products were not measured on {facts.device}")
    dense = DENSE_SHARE if facts.dense_share is None else facts.dense_share
    gain = 1 / ((1 - dense) + dense / max(speedup, 1e-9))
    share = "" if facts.dense_share is None else f", and dense maths is ~{dense:.0%} of a step"
    return Expectation(
        gain,
        f"a {dtype} matrix product runs at {speedup:.2f}x the fp32 rate on {facts.device}{share}",
    )


TECHNIQUE = Technique(
    name="precision",
    order=50,
    order_reason=(
        "its TF32 switch is independent of the model transforms; held first around a step"
    ),
    section="precision",
    fields=("dtype", "grad_scaler"),
    doc="docs/techniques/precision.md",
    requested=lambda config: config.precision.dtype != "fp32",
    switch=_tf32_switch,
    step=lambda config, device: Precision(config.precision, device),
    carried_by={
        "engine": lambda config: "its step hooks hold autocast, the scaler and TF32 per step",
        "transformers": _hf_carries,
        "lightning": lambda config: (
            None if config.precision.dtype == "tf32" else "Trainer(precision=...)"
        ),
    },
    stage=Stage("precision", 10, precision_stage, from_facts=True),
    levers=tuple(
        Lever(dtype, functools.partial(precision_gain, dtype=dtype))
        for dtype in ("bf16", "fp16", "tf32")
    ),
    translations={"transformers": _hf_arguments, "lightning": _lightning_arguments},
)
