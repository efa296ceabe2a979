"""FLOP counts of a training step or a forward pass, by ``torch.utils.flop_counter``.

``FlopCounterMode`` intercepts aten ops and counts matmuls, convolutions and attention (forward and
their backward ops) with PyTorch's own formulas, so nothing is hand-written here. What it counts,
checked in tests/test_measure.py: a multiply-add is 2 FLOPs; elementwise ops, norms and bias adds
count 0; in backward only the gradients autograd actually computes are counted (no input
gradient for a first layer whose input needs no grad). Count on the eager model: the count is a
property of the maths, not of how fast a compiled kernel runs it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode


def count_step_flops(fn: Callable[[], Any]) -> int:
    """FLOPs of one call of ``fn``: pass a full training step (forward + backward, optionally the
    optimizer) to count both passes. ``fn`` really runs, so it changes state like any step."""
    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


def count_forward_flops(model: torch.nn.Module, *args: Any, **kwargs: Any) -> int:
    """FLOPs of ``model(*args, **kwargs)`` alone, run without building an autograd graph."""
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(*args, **kwargs)
    return int(counter.get_total_flops())
