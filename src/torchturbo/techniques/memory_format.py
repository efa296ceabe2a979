"""channels_last (NHWC) memory format for convolutional models.

oneDNN on CPU and cuDNN on TensorCores run convolutions fastest in NHWC, and avoid layout
conversions when both weights and inputs use it. Models without 4-D convolutions gain nothing,
so they are left alone and the reason is returned for the report.
"""

from __future__ import annotations

import torch
from torch import nn

_CONV_TYPES = (nn.Conv2d, nn.ConvTranspose2d)


def has_2d_convolutions(model: nn.Module) -> bool:
    return any(isinstance(m, _CONV_TYPES) for m in model.modules())


def apply_channels_last(model: nn.Module) -> str | None:
    """Convert the model's 4-D parameters and buffers to channels_last in place.

    Returns None when applied, or the reason it was not (no 2-D convolutions in the model).
    """
    if not has_2d_convolutions(model):
        return "no Conv2d/ConvTranspose2d in the model: channels_last only changes 4-D tensors"
    model.to(memory_format=torch.channels_last)
    return None


def to_channels_last(tensor: torch.Tensor) -> torch.Tensor:
    """Convert a 4-D floating-point tensor (images, activations) to channels_last; others as is."""
    if tensor.dim() == 4 and tensor.is_floating_point():
        return tensor.contiguous(memory_format=torch.channels_last)
    return tensor
