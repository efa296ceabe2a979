"""The techniques: one module each, declared once (``framework/spec.py``), found by ``registry.py``;
``framework/`` holds what they declare, ``tools/`` the techniques that are not registered.

The ``apply_*`` functions are importable from here as well as from their modules; they are
loaded on first use, so that importing this package loads no technique.
"""

from torchturbo import lazy_exports

_EXPORTS = {
    "apply_activation_checkpointing": "torchturbo.techniques.checkpointing",
    "apply_channels_last": "torchturbo.techniques.memory_format",
    "apply_compile": "torchturbo.techniques.compile",
    "apply_float8_training": "torchturbo.techniques.float8",
    "rebuild_optimizer": "torchturbo.techniques.optimizer",
}

__all__ = list(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS)
