"""Backend switches that are global to the process, held only while the engine steps.

``torch.backends.cudnn.benchmark`` autotunes convolution algorithms per input shape: it pays
with fixed shapes and costs with varying ones (the article's defect 14). The flag is
process-wide, so the engine sets it around its own steps rather than for the whole process:
another engine in the same process (the bench and the tuner interleave several) keeps its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from torchturbo.config import BackendConfig


@contextlib.contextmanager
def cudnn_benchmark(config: BackendConfig) -> Iterator[None]:
    """cuDNN autotuning on while the context is open when ``config`` asks for it; otherwise
    the process's own setting is left alone."""
    if not config.cudnn_benchmark:
        yield
        return
    saved = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = saved
