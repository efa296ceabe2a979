"""channels_last (NHWC) memory format for convolutional models.

oneDNN on CPU and cuDNN on TensorCores run convolutions fastest in NHWC, and avoid layout
conversions when both weights and inputs use it. Models without 4-D convolutions gain nothing,
so they are left alone and the reason is returned for the report.
"""

from __future__ import annotations

import torch
from torch import nn

from torchturbo.techniques.result import TechniqueResult, applied, not_applied

_CONV_TYPES = (nn.Conv2d, nn.ConvTranspose2d)


def has_2d_convolutions(model: nn.Module) -> bool:
    return any(isinstance(m, _CONV_TYPES) for m in model.modules())


def apply_channels_last(model: nn.Module) -> TechniqueResult:
    """Convert the model's 4-D parameters and buffers to channels_last in place.

    Not applied (with the reason) when the model has no 2-D convolutions.
    """
    if not has_2d_convolutions(model):
        return not_applied(
            "channels_last",
            "no Conv2d/ConvTranspose2d in the model: channels_last only changes 4-D tensors",
        )
    # Module.to takes memory_format (see its docstring); torch's type stubs omit it.
    model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    return applied("channels_last")


def is_image(tensor: torch.Tensor) -> bool:
    """A 4-D floating-point tensor (images, activations): what channels_last lays out NHWC.
    Integer tensors of 4 dimensions (masks, ids) keep their layout."""
    return tensor.dim() == 4 and tensor.is_floating_point()


def to_channels_last(tensor: torch.Tensor) -> torch.Tensor:
    """Convert an image tensor (:func:`is_image`) to channels_last; others as is."""
    if is_image(tensor):
        return tensor.contiguous(memory_format=torch.channels_last)
    return tensor
