"""Built-in workloads: synthetic but learnable recipes for the CLI default and the benchmarks.

``vision`` (ResNet classifier: convolution-bound), ``segmentation`` (U-Net: activation-memory
bound) and ``text`` (Transformer tagger on long-tailed sequence lengths: padding-bound). Each
factory takes keyword overrides (``seed``, ``batch_size``, ``num_samples``, sizes, ``lr``) and
builds its data in memory when called; importing this package generates nothing.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torchturbo.recipe import Recipe
from torchturbo.workloads.segmentation import segmentation
from torchturbo.workloads.text import text
from torchturbo.workloads.vision import vision

WORKLOADS: dict[str, Callable[..., Recipe]] = {
    "vision": vision,
    "segmentation": segmentation,
    "text": text,
}


def get_workload(name: str, **overrides: Any) -> Recipe:
    """Build the built-in workload ``name`` with keyword ``overrides`` (e.g. ``batch_size=8``)."""
    factory = WORKLOADS.get(name)
    if factory is None:
        raise ValueError(f"unknown workload {name!r}; choose one of {sorted(WORKLOADS)}")
    accepted = inspect.signature(factory).parameters
    unknown = sorted(set(overrides) - set(accepted))
    if unknown:
        raise ValueError(
            f"workload {name!r} does not take {unknown}; it accepts {sorted(accepted)}"
        )
    return factory(**overrides)


__all__ = ["WORKLOADS", "get_workload", "segmentation", "text", "vision"]
