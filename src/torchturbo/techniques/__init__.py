"""The techniques: one module each, declared once (``spec.py``), found by ``registry.py``.

The ``apply_*`` functions are importable from here as well as from their modules; they are
loaded on first use, so that importing this package loads no technique.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "apply_activation_checkpointing": "torchturbo.techniques.checkpointing",
    "apply_channels_last": "torchturbo.techniques.memory_format",
    "apply_compile": "torchturbo.techniques.compile",
    "apply_float8_training": "torchturbo.techniques.float8",
    "compressed_activations": "torchturbo.techniques.activation_compression",
    "rebuild_optimizer": "torchturbo.techniques.optimizer",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'torchturbo.techniques' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
