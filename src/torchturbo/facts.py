"""Facts about a recipe on this machine that take seconds to gather and order the tuner's work.

* the rate of a matrix product in bf16, fp16 and fp32-with-TF32 against plain fp32 on the
  device: a CPU without bf16 units runs bf16 emulated,
  ~80x slower, and TF32 is a CUDA tensor-core mode that changes nothing on a CPU;
* the padding of random batches and of length-bucketed ones, from the recipe's lengths;
* the share of the forward's FLOPs in 2-D convolutions (``FlopCounterMode``), and whether batch
  shapes vary (compile then recompiles).

``levers`` turns them into expected gains.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from torchturbo.config import PrecisionConfig
from torchturbo.data.bucketing import padding_fractions
from torchturbo.measure.timing import time_once
from torchturbo.recipe import Recipe
from torchturbo.techniques.memory_format import has_2d_convolutions
from torchturbo.techniques.precision import float32_matmul_precision

#: The low precisions compared with fp32, and the dtype their matrix products run in.
_LOW_PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32}


@dataclass(frozen=True, kw_only=True)
class Facts:
    """What the tuner and the doctor know before training anything (see the module docstring)."""

    #: The device in words, for evidence strings: "cpu" or "cuda:0".
    device: str
    #: Matrix-product rate of each low precision over fp32's on this device.
    gemm_speedup: dict[str, float]
    #: Padding fraction of random batches and of length-sorted ones; None without lengths.
    padding: tuple[float, float] | None
    has_convolutions: bool
    #: Share of the forward FLOPs in 2-D convolutions (0 without convolutions).
    conv_share: float
    #: Modules without children: a proxy for how much graph torch.compile has to trace.
    leaf_modules: int
    shapes_vary: bool
    #: Gradient communication per step over the step time under DDP; None in one process.
    comm_share: float | None = None


def gemm_speedups(device: torch.device) -> dict[str, float]:
    """Each low precision's matrix-product rate over fp32's, measured on ``device``.

    One square product at a size where the maths dominates (512 on a CPU, 4096 on a GPU), timed
    in interleaved rounds (fp32, bf16, fp16, tf32, then again) and the best of each kept: a busy
    machine stalls some timings, never speeds one up, and a stall then hits no precision alone.
    Enough to tell native units (2-16x) from emulation (0.01-1x) in about a second;
    ``measure.peak`` measures the full rate for MFU instead.
    """
    if device.type == "cpu":
        # One thread: a multi-threaded product waits for its slowest thread, and on a busy
        # machine that made the ratios swing 30x between runs; the ratio of one core's rates is
        # the question (native units or emulation) and holds steady under load.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return _gemm_speedups(device, 512)
        finally:
            torch.set_num_threads(threads)
    return _gemm_speedups(device, 4096)


def _gemm_speedups(device: torch.device, n: int) -> dict[str, float]:
    operands = {
        name: tuple(torch.randn(n, n, device=device).to(dtype) for _ in range(2))
        for name, dtype in _PRECISIONS.items()
    }
    best = dict.fromkeys(_PRECISIONS, math.inf)
    for round_index in range(_GEMM_ROUNDS):
        for name, (a, b) in operands.items():
            if round_index >= 2 and best[name] > _SLOW * best["fp32"]:
                continue  # emulated: two timings say enough, more would cost seconds
            with _matmul_precision(name):
                if round_index == 0:
                    torch.mm(a, b)  # kernel selection, first touch
                best[name] = min(best[name], time_once(lambda a=a, b=b: torch.mm(a, b), device))
    return {name: best["fp32"] / best[name] for name in _LOW_PRECISIONS}


#: The precisions timed and the dtype their products run in (tf32 keeps fp32 storage).
_PRECISIONS = {"fp32": torch.float32, **{k: v for k, v in _LOW_PRECISIONS.items()}}
_GEMM_ROUNDS = 5
#: A precision this many times slower than fp32 after two rounds is timed no further (one
#: round could be a stall of the machine).
_SLOW = 4.0


def _matmul_precision(name: str) -> Any:
    return float32_matmul_precision(PrecisionConfig(dtype="tf32" if name == "tf32" else "fp32"))


def conv_flop_share(forward: Callable[[], Any]) -> float:
    """Share of the FLOPs of ``forward()``, run without gradients, in convolutions."""
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        forward()
    by_op = counter.get_flop_counts().get("Global", {})
    total = sum(by_op.values())
    conv = sum(count for op, count in by_op.items() if "convolution" in str(op))
    return conv / total if total else 0.0


def leaf_module_count(model: nn.Module) -> int:
    return sum(1 for module in model.modules() if not any(True for _ in module.children()))


def shape_key(batch: Any) -> tuple[Any, ...]:
    """The shapes of a batch's tensors: batches with equal keys compile to the same graph."""
    if isinstance(batch, torch.Tensor):
        return (tuple(batch.shape),)
    if isinstance(batch, dict):
        return tuple((k, *shape_key(v)) for k, v in batch.items())
    if isinstance(batch, (list, tuple)):
        return tuple(s for item in batch for s in shape_key(item))
    return ()


def gather(
    recipe: Recipe,
    model: nn.Module,
    batches: Sequence[Any],
    device: torch.device,
    forward: Callable[[], Any],
    *,
    comm_share: float | None = None,
) -> Facts:
    """The facts for ``recipe``: ``model`` is a built model on ``device``, ``batches`` the
    batches it trains on, ``forward()`` one forward of it on the first batch (FLOPs are counted
    on it, without gradients)."""
    padding = None
    if recipe.lengths is not None:
        padding = padding_fractions(recipe.lengths, recipe.batch_size, recipe.seed)
    convolutions = has_2d_convolutions(model)
    return Facts(
        device=str(device),
        gemm_speedup=gemm_speedups(device),
        padding=padding,
        has_convolutions=convolutions,
        conv_share=conv_flop_share(forward) if convolutions else 0.0,
        leaf_modules=leaf_module_count(model),
        shapes_vary=len({shape_key(batch) for batch in batches}) > 1,
        comm_share=comm_share,
    )
