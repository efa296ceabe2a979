"""torch.compile of the training model.

``nn.Module.compile`` compiles in place, so the model keeps its identity, its parameter objects
(the optimizer's references stay valid) and its ``state_dict`` keys (no ``_orig_mod.`` prefix).
Compilation itself happens lazily on the first step; measurement code reports that time apart.
"""

from __future__ import annotations

from torch import nn

from torchturbo.config import CompileConfig


def apply_compile(model: nn.Module, config: CompileConfig) -> None:
    """Compile the model in place (nothing to do when ``config.mode`` is "off")."""
    if config.mode == "off":
        return
    # "default" is torch.compile's name for passing no mode at all.
    mode = None if config.mode == "default" else config.mode
    model.compile(mode=mode, fullgraph=config.fullgraph, dynamic=config.dynamic)
