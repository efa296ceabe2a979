"""Built-in ``vision`` workload: a small ResNet classifying synthetic, learnable RGB images.

Why this shape: 3x3 convolutions at widths 32/64/128 dominate the step, which is the case the
article's mixed-precision and channels_last tips target (oneDNN on CPU, cuDNN on GPU), and the
residual blocks are direct children of ``nn.Sequential`` stages so activation checkpointing finds
them as blocks.

Data: each class owns a smooth random colour pattern (coarse noise upsampled); a sample is its
class pattern, randomly shifted and scaled, under heavy Gaussian noise. The default model learns
it within a few dozen steps, yet the loss keeps falling for hundreds more, so loss-parity checks
do not compare two saturated curves.

Default size, 48 px at batch 16: on 32 px images the fixed per-layer overheads are a large part of
the step, which hides what bf16 and channels_last do to the convolutions (fast/fp32 measured
1.9-2.2x at 32 px, 2.4-2.5x at 48 px, same run). Measured default step (forward + backward +
AdamW, fp32 eager, 2 threads) on the 2-core AVX-512 CPU, torch 2.13.0: median 193 ms.
bf16 autocast + channels_last ran the same step 1.8-1.95x faster (two interleaved runs).

``norm`` picks the normalisation: ``"batch"`` (default), ``"group"`` (GroupNorm, 8 groups) or
``"none"``. Gradient accumulation cannot reproduce BatchNorm over one large batch (each
micro-batch normalises with its own statistics), so exact accumulation tests need ``"group"`` or
``"none"``. Both learn this data more slowly than BatchNorm: over 40 steps ``"none"`` cuts the
loss by about a third, ``"group"`` barely moves it (per-sample normalisation hides most of the
class signal early on), so use ``"group"`` for exactness tests, not for learning curves. The
optimizer is AdamW because SGD did not move the BatchNorm-free variants at all in 40 steps.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from torchturbo.recipe import Recipe

WIDTHS = (32, 64, 128)  # multiples of 16: aligned for oneDNN/TensorCore kernels
DEFAULT_BATCH_SIZE = 16
_PATTERN_GRID = 4  # class patterns are drawn on a 4x4 grid, then upsampled: smooth and distinct
_MAX_SHIFT_FRACTION = 8  # shifts up to image_size / 8 pixels in each direction
_NOISE_STD = 2.0  # patterns have std ~0.7: learnable, not saturated within a few dozen steps


_NORM_LAYERS: dict[str, Callable[[int], nn.Module]] = {
    "batch": nn.BatchNorm2d,
    "group": functools.partial(nn.GroupNorm, 8),
    "none": lambda channels: nn.Identity(),
}
NORMS = tuple(_NORM_LAYERS)


def _conv_norm(
    c_in: int, c_out: int, kernel: int, stride: int, norm: str
) -> tuple[nn.Conv2d, nn.Module]:
    # A conv followed by a norm needs no bias: the norm's shift replaces it.
    conv = nn.Conv2d(c_in, c_out, kernel, stride, kernel // 2, bias=norm == "none")
    return conv, _NORM_LAYERS[norm](c_out)


class BasicBlock(nn.Module):
    """ResNet basic block: (conv3x3-norm-relu, conv3x3-norm) + shortcut, then relu."""

    def __init__(self, c_in: int, c_out: int, stride: int, norm: str) -> None:
        super().__init__()
        self.conv1, self.norm1 = _conv_norm(c_in, c_out, 3, stride, norm)
        self.conv2, self.norm2 = _conv_norm(c_out, c_out, 3, 1, norm)
        self.relu = nn.ReLU(inplace=True)
        needs_projection = stride != 1 or c_in != c_out
        self.shortcut = (
            nn.Sequential(*_conv_norm(c_in, c_out, 1, stride, norm))
            if needs_projection
            else nn.Identity()
        )
        if norm == "none":
            # Without a norm the residual sum grows with depth; a zero last conv makes each block
            # start as the identity (the "Fixup"/"ReZero" idea), so training is stable.
            nn.init.zeros_(self.conv2.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """Stem, three stages of two BasicBlocks each (stride 1, 2, 2), global pool, linear head."""

    def __init__(self, num_classes: int, norm: str, widths: tuple[int, ...] = WIDTHS) -> None:
        super().__init__()
        self.stem = nn.Sequential(*_conv_norm(3, widths[0], 3, 1, norm), nn.ReLU(inplace=True))
        stages = []
        c_in = widths[0]
        for i, width in enumerate(widths):
            stride = 1 if i == 0 else 2
            stages.append(
                nn.Sequential(
                    BasicBlock(c_in, width, stride, norm), BasicBlock(width, width, 1, norm)
                )
            )
            c_in = width
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(c_in, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        features = self.stages(self.stem(images))
        return self.head(features.mean(dim=(2, 3)))


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Mean cross-entropy over the batch, and the number of samples it averages."""
    images, labels = batch
    return F.cross_entropy(model(images), labels), labels.shape[0]


def make_images(
    num_samples: int, image_size: int, num_classes: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Images [N, 3, S, S] float32 and labels [N] int64, fixed by ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    coarse = torch.randn(num_classes, 3, _PATTERN_GRID, _PATTERN_GRID, generator=gen)
    patterns = F.interpolate(coarse, size=(image_size, image_size), mode="bilinear")
    labels = torch.randint(num_classes, (num_samples,), generator=gen)
    gain = torch.empty(num_samples, 1, 1, 1).uniform_(0.5, 1.5, generator=gen)
    images = patterns[labels] * gain
    max_shift = max(1, image_size // _MAX_SHIFT_FRACTION)
    shifts = torch.randint(-max_shift, max_shift + 1, (num_samples, 2), generator=gen)
    # Rolling sample by sample is ~1 ms per thousand images; a gather would be no clearer.
    for i, (dy, dx) in enumerate(shifts.tolist()):
        images[i] = images[i].roll((dy, dx), dims=(1, 2))
    images += _NOISE_STD * torch.randn(images.shape, generator=gen)
    return images, labels


def vision(
    *,
    seed: int = 0,
    batch_size: int | None = None,
    num_samples: int = 2048,
    image_size: int = 48,
    num_classes: int = 10,
    norm: str = "batch",
    lr: float = 1e-3,
    widths: tuple[int, ...] = WIDTHS,
) -> Recipe:
    """ResNet-style classifier on synthetic class patterns (see the module docstring).

    ``image_size`` must be a multiple of 8 (32 to 64 is the intended range on a CPU, 128 on a
    GPU); ``norm`` is one of ``"batch" | "group" | "none"``; ``lr`` is the AdamW learning rate;
    ``widths`` the channels of each stage (one stage each, the first at full resolution).
    """
    if norm not in NORMS:
        raise ValueError(f"vision: norm must be one of {NORMS}, got {norm!r}")
    if image_size < 8 or image_size % 8:
        raise ValueError(f"vision: image_size must be a multiple of 8, >= 8, got {image_size!r}")
    if num_samples < 1:
        raise ValueError(f"vision: num_samples must be >= 1, got {num_samples!r}")
    if num_classes < 2:
        raise ValueError(f"vision: num_classes must be >= 2, got {num_classes!r}")
    if not widths or any(w < 1 for w in widths):
        raise ValueError(f"vision: widths must be positive channel counts, got {widths!r}")
    images, labels = make_images(num_samples, image_size, num_classes, seed)
    return Recipe(
        name="vision",
        model=functools.partial(ResNet, num_classes, norm, tuple(widths)),
        optimizer=functools.partial(torch.optim.AdamW, lr=lr),
        loss_fn=loss_fn,
        dataset=TensorDataset(images, labels),
        batch_size=DEFAULT_BATCH_SIZE if batch_size is None else batch_size,
        seed=seed,
        extras={"image_size": image_size, "num_classes": num_classes, "norm": norm},
    )
