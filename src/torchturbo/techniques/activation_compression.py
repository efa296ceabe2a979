"""Activation compression: keep the activations saved for backward in bf16 or fp16.

Training memory is mostly the activations that autograd saves in the forward for the backward.
Saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``, composed with others by
``saved_tensors.py``) let each saved tensor be packed when it is saved and unpacked when backward
needs it: here a float32 activation is stored at half its size and
cast back to float32 for the backward, so the forward and the gradients' arithmetic stay float32
and only the saved copy is rounded (bf16 keeps 8 bits of mantissa: about 0.4% per element;
fp16 11 bits, but its range ends at 65504). Leaf tensors (parameters, inputs that need a
gradient) are left alone: they are alive anyway, so a copy would add memory, and the weight's own
precision would drop. Tensors under ``min_bytes`` (1 MiB) are left alone too: their casts cost
more than they save.

It trades time (a cast per saved tensor, each way) for memory, so the tuner's memory planner
(``tune/memory/plan.py``) proposes it only over a memory budget, alone or with checkpointing and
micro-batching. Under
``torch.compile`` it does not apply, and says why: the compiled graph saves its tensors inside
its own autograd function, where no saved-tensor hook sees them (tested: nothing was stored in
bf16 with torch 2.13).
"""

from __future__ import annotations

import contextlib
import typing
from dataclasses import dataclass
from typing import Any

import torch

from torchturbo.base.saved_tensors import saved_tensor_packer
from torchturbo.config import TurboConfig
from torchturbo.techniques.framework.spec import Technique

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@contextlib.contextmanager
def compressed_activations(dtype: str, min_bytes: int = 2**20) -> typing.Iterator[None]:
    """Store float32 non-leaf tensors of at least ``min_bytes`` saved for backward as ``dtype``
    ("bf16" or "fp16") while the block runs."""
    stored = _DTYPES[dtype]

    def pack(value: Any) -> Any:
        if (
            not isinstance(value, torch.Tensor)
            or value.dtype != torch.float32
            or value.is_leaf
            or value.numel() * value.element_size() < min_bytes
        ):
            return value
        return _Compressed(value.to(stored))

    def unpack(value: Any) -> Any:
        if isinstance(value, _Compressed):
            return value.tensor.to(torch.float32)
        return value

    with saved_tensor_packer(pack, unpack):
        yield


@dataclass(frozen=True)
class _Compressed:
    """A saved tensor stored at half precision (told apart from one stored as it was)."""

    tensor: torch.Tensor


def _switch(
    config: TurboConfig, device: torch.device
) -> contextlib.AbstractContextManager[Any] | str:
    if config.compile.mode != "off":
        return (
            "torch.compile's graphs keep what they save for backward out of reach of "
            "saved-tensor hooks: compress an eager model, or checkpoint a compiled one"
        )
    section = config.activation_compression
    return compressed_activations(section.dtype, section.min_bytes)


TECHNIQUE = Technique(
    name="activation_compression",
    order=60,
    order_reason=("saved-tensor hooks held around each step, independent of the other switches"),
    section="activation_compression",
    doc="docs/techniques/activation_compression.md",
    requested=lambda config: config.activation_compression.dtype != "off",
    switch=_switch,
)
