"""torchturbo: make PyTorch training faster and leaner, and prove it by measurement.

Public names are imported lazily so that ``import torchturbo`` stays cheap (the CLI's ``--help``
and ``version`` should not pay for building the whole package).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Turbo": "torchturbo.engine",
    "StepMetrics": "torchturbo.engine",
    "TurboConfig": "torchturbo.config",
    "ConfigError": "torchturbo.config",
    "Recipe": "torchturbo.recipe",
    "load_recipe": "torchturbo.recipe",
    "RecipeError": "torchturbo.recipe",
    "train": "torchturbo.runs.train",
    "CheckpointError": "torchturbo.resume.files",
    "NonFiniteError": "torchturbo.reliability.guard",
    "MemoryBudgetError": "torchturbo.reliability.oom",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'torchturbo' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
