"""Built-in workloads: synthetic but learnable recipes for the CLI default and the benchmarks.

``vision`` (ResNet classifier: convolution-bound), ``segmentation`` (U-Net: activation-memory
bound) and ``text`` (Transformer tagger on long-tailed sequence lengths: padding-bound). Each
factory takes keyword overrides (``seed``, ``batch_size``, ``num_samples``, sizes, ``lr``) and
builds its data in memory when called; importing this package generates nothing.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

from torchturbo.output.suggest import did_you_mean
from torchturbo.recipe import Recipe
from torchturbo.workloads.segmentation import segmentation
from torchturbo.workloads.text import text
from torchturbo.workloads.vision import vision

WORKLOADS: dict[str, Callable[..., Recipe]] = {
    "vision": vision,
    "segmentation": segmentation,
    "text": text,
}


#: Sizes of each workload: ``small`` (the default: a step takes 0.05-0.2 s on a 2-core CPU, so
#: the tests and the demo run in minutes) and ``large`` (wider inputs, models and batches: 1-5 s
#: a step there, what real models cost on a CPU, for checking the tuner's budget on them).
SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "small": {"vision": {}, "segmentation": {}, "text": {}},
    "large": {
        "vision": {"image_size": 128, "batch_size": 32},
        "segmentation": {"image_size": 160, "batch_size": 16},
        "text": {"d_model": 256, "num_layers": 4, "batch_size": 32},
    },
}


def get_workload(name: str, size: str = "small", **overrides: Any) -> Recipe:
    """Build the built-in workload ``name`` at ``size`` (see ``SIZES``), with keyword
    ``overrides`` on top (e.g. ``batch_size=8``)."""
    factory = WORKLOADS.get(name)
    if factory is None:
        guess = did_you_mean(name, WORKLOADS)
        raise ValueError(f"unknown workload {name!r}{guess}; choose one of {sorted(WORKLOADS)}")
    if size not in SIZES:
        guess = did_you_mean(size, SIZES)
        raise ValueError(f"unknown workload size {size!r}{guess}; choose one of {sorted(SIZES)}")
    overrides = {**SIZES[size][name], **overrides}
    accepted = inspect.signature(factory).parameters
    unknown = sorted(set(overrides) - set(accepted))
    if unknown:
        raise ValueError(
            f"workload {name!r} does not take {unknown}; it accepts {sorted(accepted)}"
        )
    recipe = factory(**overrides)
    return recipe if size == "small" else dataclasses.replace(recipe, name=f"{name}-{size}")


__all__ = ["SIZES", "WORKLOADS", "get_workload", "segmentation", "text", "vision"]
