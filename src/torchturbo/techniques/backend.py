"""Backend switches that are global to the process, held only while the engine steps.

``torch.backends.cudnn.benchmark`` autotunes convolution algorithms per input shape: it pays
with fixed shapes and costs with varying ones (the article's defect 14). The flag is
process-wide, so the engine sets it around its own steps rather than for the whole process:
another engine in the same process (the bench and the tuner interleave several) keeps its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from torchturbo.config import BackendConfig, TurboConfig
from torchturbo.techniques.framework.spec import Technique, TrainerArguments


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


def _switch(config: TurboConfig, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    return cudnn_benchmark(config.backend)


def _lightning_arguments(config: TurboConfig, arguments: TrainerArguments) -> None:
    arguments.kwargs["benchmark"] = True


#: Proposed by the channels_last stage (``memory_format.py``), where shapes are fixed on CUDA.
TECHNIQUE = Technique(
    name="cudnn_benchmark",
    order=55,
    order_reason=("a process-wide cuDNN setting, independent of the other switches"),
    section="backend",
    doc="docs/techniques/channels_last.md",
    requested=lambda config: config.backend.cudnn_benchmark,
    switch=_switch,
    carried_by={"lightning": lambda config: "Trainer(benchmark=True)"},
    translations={"lightning": _lightning_arguments},
)
