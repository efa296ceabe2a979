"""torchturbo: make PyTorch training faster and leaner, and prove it by measurement.

Public names are imported lazily so that ``import torchturbo`` stays cheap (the CLI's ``--help``
and ``version`` should not pay for building the whole package).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
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


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports each of ``exports`` (name -> module) on first use.

    A package whose ``__init__`` re-exports its modules' names this way imports none of them
    itself: importing one of its modules does not import them all, nor close an import cycle
    through them (``tests/test_architecture.py``)."""

    def getattr_(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return getattr_


__getattr__ = lazy_exports("torchturbo", _EXPORTS)
