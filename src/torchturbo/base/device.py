"""The one place where a tensor torchturbo makes for a model learns the model's device.

Probe batches (packing's isolation check, the memory estimate and the batch finder, the facts'
probes), collated batches, trial batches and resumed state are built on the CPU and moved with
:func:`to_device` to :func:`model_device` of the model they feed; a tensor made beside a model
is made with ``device=model_device(model)``. Before, each module found the device its own way
and some not at all: packing's check built its position ids on the CPU, and every tune of a
Hugging Face causal LM on CUDA stopped there, which no test on a one-device machine could see
(``tests/fake_device.py`` now gives the tests a second device).
"""

from __future__ import annotations

import itertools
from typing import TypeVar

import torch
from torch import nn

from torchturbo.base.nested import map_tensors
from torchturbo.base.nhwc import is_image

T = TypeVar("T")


def model_device(model: nn.Module) -> torch.device:
    """Where ``model`` computes: the device of its first parameter, else of its first buffer,
    else the CPU (a model with no tensors of its own)."""
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        return tensor.device
    return torch.device("cpu")


def to_device(
    batch: T, device: torch.device | str, *, non_blocking: bool = False, channels_last: bool = False
) -> T:
    """Move every tensor of a nested batch to ``device``, keeping the structure and its types.

    The containers seen into are those of :func:`torchturbo.base.nested.map_tensors`;
    anything else (ints, strings) passes through unchanged. With ``channels_last``, image tensors
    (:func:`~torchturbo.base.nhwc.is_image`) are laid out NHWC in the same copy;
    integer tensors (labels, masks, token ids) never are. ``non_blocking=True`` makes the copy
    asynchronous only from pinned (page-locked) host memory to CUDA; from pageable memory it behaves
    as a blocking copy, and on CPU it changes nothing.
    """

    def move(tensor: torch.Tensor) -> torch.Tensor:
        nhwc = channels_last and is_image(tensor)
        layout = torch.channels_last if nhwc else torch.preserve_format
        return tensor.to(device, non_blocking=non_blocking, memory_format=layout)

    return map_tensors(move, batch)
