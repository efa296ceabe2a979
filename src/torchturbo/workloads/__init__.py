"""Built-in workloads: synthetic but learnable recipes for the CLI default and the benchmarks.

``vision`` (ResNet classifier: convolution-bound), ``segmentation`` (U-Net: activation-memory
bound) and ``text`` (Transformer tagger on long-tailed sequence lengths: padding-bound). Each
factory takes keyword overrides (``seed``, ``batch_size``, ``num_samples``, sizes, ``lr``) and
builds its data in memory when called; importing this package generates nothing. Sizes: ``small``
and ``large`` for a CPU, ``gpu`` sized for the device from its measured rate and memory
(``sizing.py``), ``auto`` the GPU size on a GPU and the small one elsewhere.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import torch

from torchturbo.measure.memory import memory_capacity
from torchturbo.output.suggest import did_you_mean
from torchturbo.recipe import Recipe
from torchturbo.workloads.segmentation import segmentation
from torchturbo.workloads.sizing import (
    BATCHES,
    GPU_DIMS,
    PROBE_SAMPLES,
    Sizing,
    batch_for,
    best_peak,
    per_sample,
)
from torchturbo.workloads.text import text
from torchturbo.workloads.vision import vision

WORKLOADS: dict[str, Callable[..., Recipe]] = {
    "vision": vision,
    "segmentation": segmentation,
    "text": text,
}


#: Sizes of each workload: ``small`` (a step takes 0.05-0.2 s on a 2-core CPU, so the tests and
#: the demo run in minutes), ``large`` (wider inputs, models and batches: 1-5 s a step there,
#: what real models cost on a CPU, for checking the tuner's budget on them) and ``gpu`` (wider
#: models, the batch chosen for the device: ``sizing.py``).
SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "small": {"vision": {}, "segmentation": {}, "text": {}},
    "large": {
        "vision": {"image_size": 128, "batch_size": 32},
        "segmentation": {"image_size": 160, "batch_size": 16},
        "text": {"d_model": 256, "num_layers": 4, "batch_size": 32},
    },
    "gpu": GPU_DIMS,
}
#: ``auto`` is the GPU size on a GPU, the small one elsewhere.
SIZE_CHOICES = ("auto", *SIZES)


def get_workload(
    name: str, size: str = "small", *, device: torch.device | str | None = None, **overrides: Any
) -> Recipe:
    """Build the built-in workload ``name`` at ``size`` (see ``SIZES``; ``auto`` picks by
    ``device``, default CUDA when available), with keyword ``overrides`` on top (e.g.
    ``batch_size=8``). The ``gpu`` size measures ``device`` for its batch (``sizing.py``), unless
    ``batch_size`` is given; what it chose is in ``recipe.extras["sizing"]``."""
    factory = WORKLOADS.get(name)
    if factory is None:
        guess = did_you_mean(name, WORKLOADS)
        raise ValueError(f"unknown workload {name!r}{guess}; choose one of {sorted(WORKLOADS)}")
    if size not in SIZE_CHOICES:
        guess = did_you_mean(size, SIZE_CHOICES)
        raise ValueError(
            f"unknown workload size {size!r}{guess}; choose one of {sorted(SIZE_CHOICES)}"
        )
    where = _device(device)
    if size == "auto":
        size = "gpu" if where.type == "cuda" else "small"
    overrides = {**SIZES[size][name], **overrides}
    accepted = inspect.signature(factory).parameters
    unknown = sorted(set(overrides) - set(accepted))
    if unknown:
        raise ValueError(
            f"workload {name!r} does not take {unknown}; it accepts {sorted(accepted)}"
        )
    sizing = None
    if size == "gpu" and "batch_size" not in overrides:
        sizing = _sized(factory, overrides, where)
        default_samples = accepted["num_samples"].default
        overrides = {
            "num_samples": max(default_samples, BATCHES * sizing.batch_size),
            **overrides,
            "batch_size": sizing.batch_size,
        }
    recipe = factory(**overrides)
    if sizing is not None:
        recipe.extras["sizing"] = sizing
    return recipe if size == "small" else dataclasses.replace(recipe, name=f"{name}-{size}")


def _device(device: torch.device | str | None) -> torch.device:
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _sized(
    factory: Callable[..., Recipe], overrides: dict[str, Any], device: torch.device
) -> Sizing:
    """The batch for ``factory`` at ``overrides``'s dimensions on ``device`` (``sizing.py``)."""
    probe = factory(**{**overrides, "num_samples": PROBE_SAMPLES})  # its batch: the CPU size's
    flops, held = per_sample(probe, device)
    peak, memory = best_peak(device), memory_capacity(device)
    batch, bound = batch_for(flops, held, peak, memory, floor=probe.batch_size)
    return Sizing(str(device), batch, flops, held, peak, memory, bound)


__all__ = ["SIZES", "WORKLOADS", "get_workload", "segmentation", "text", "vision"]
