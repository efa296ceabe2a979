"""Numeric precision: autocast contexts, the fp16 GradScaler and TF32 switches.

Uses the device-generic ``torch.amp`` API (the article's ``torch.cuda.amp`` is deprecated).
bf16 keeps fp32's exponent range and needs no loss scaling; fp16 does, and gradients must be
unscaled before clipping (see ``engine.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from torchturbo.config import PrecisionConfig

AUTOCAST_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_context(
    device: torch.device, config: PrecisionConfig
) -> contextlib.AbstractContextManager:
    """The autocast context for the forward pass; a no-op for fp32 and tf32."""
    dtype = AUTOCAST_DTYPES.get(config.dtype)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.amp.autocast(device_type=device.type, dtype=dtype)


def make_grad_scaler(device: torch.device, config: PrecisionConfig) -> torch.amp.GradScaler | None:
    """A GradScaler for fp16, None otherwise."""
    if not config.uses_scaler:
        return None
    return torch.amp.GradScaler(device.type)


@contextlib.contextmanager
def float32_matmul_precision(config: PrecisionConfig) -> Iterator[None]:
    """Allow TF32 for float32 matmuls and convolutions while the context is open.

    These are process-wide switches, so they are set for the span of a Turbo session and
    restored afterwards instead of leaking into the user's other code.
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
