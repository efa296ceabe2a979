"""What the NHWC (channels_last) layout applies to: models with 2-D convolutions, image tensors.

A leaf module: the tuner's facts, the doctor and the loader's device copy ask these questions
without importing the channels_last technique (whose spec imports the tuner's types).
"""

from __future__ import annotations

import torch
from torch import nn

CONV_TYPES = (nn.Conv2d, nn.ConvTranspose2d)


def has_2d_convolutions(model: nn.Module) -> bool:
    return any(isinstance(m, CONV_TYPES) for m in model.modules())


def is_image(tensor: torch.Tensor) -> bool:
    """A 4-D floating-point tensor (images, activations): what channels_last lays out NHWC.
    Integer tensors of 4 dimensions (masks, ids) keep their layout."""
    return tensor.dim() == 4 and tensor.is_floating_point()


def to_channels_last(tensor: torch.Tensor) -> torch.Tensor:
    """Convert an image tensor (:func:`is_image`) to channels_last; others as is."""
    if is_image(tensor):
        return tensor.contiguous(memory_format=torch.channels_last)
    return tensor
