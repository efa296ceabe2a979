"""Facts about a recipe on this machine that take seconds to gather and order the tuner's work.

* the rate of a matrix product in bf16, fp16 and fp32-with-TF32 against plain fp32 on the
  device, and which of them it only emulates (``measure.native``): a CPU without bf16 units
  runs bf16 ~80x slower, and TF32 is a CUDA tensor-core mode that changes nothing on a CPU;
* the padding of random batches and of length-bucketed ones, from the recipe's lengths;
* the share of the forward's FLOPs in 2-D convolutions (``FlopCounterMode``), and whether batch
  shapes vary (compile then recompiles);
* the share of a step's time in dense maths: the step's matmul, attention and convolution FLOPs
  at the fp32 matrix-product rate measured here, over the step's measured time (what a faster
  precision can speed up; the rest, elementwise ops, norms, the optimizer, it cannot);
* for a model with a linear LM head (``get_output_embeddings``), the bytes of its float32
  logits in one forward and the bytes that forward holds for backward (``measure.memory``);
* on a GPU, the share of a training step in which the device computes (``measure.device_busy``):
  a small model's step is launch-bound, and the levers for that are not faster maths.

``levers`` turns them into expected gains.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from torchturbo.base.blocks import traced_leaf_modules
from torchturbo.base.language_models import language_models, output_embedding
from torchturbo.base.nhwc import has_2d_convolutions
from torchturbo.data.bucketing import padding_fractions
from torchturbo.measure.memory import activation_bytes
from torchturbo.measure.native import emulated, gemm_speedup
from torchturbo.measure.peak import measured_peak_flops
from torchturbo.recipe import Recipe

#: The low precisions compared with fp32.
_LOW_PRECISIONS = ("bf16", "fp16", "tf32")


@dataclass(frozen=True, kw_only=True)
class Facts:
    """What the tuner and the doctor know before training anything (see the module docstring)."""

    #: The device in words, for evidence strings: "cpu" or "cuda:0".
    device: str
    #: Matrix-product rate of each low precision over fp32's on this device.
    gemm_speedup: dict[str, float]
    #: The low precisions this device only emulates, with why (``measure.native``).
    emulated: dict[str, str]
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
    #: The optimizer step's share of a training step, from the baseline's phases; None unknown.
    optimizer_share: float | None = None
    #: Bytes of the linear LM head's logits in one forward, as float32 (tokens x vocab x 4: the
    #: loss upcasts them); None for a model without such a head, or whose head was not run.
    logits_bytes: int | None = None
    #: Bytes that forward holds for backward (parameters excluded); None without an LM head.
    activation_bytes: int | None = None
    #: Share of a training step's time in dense maths (see the module docstring); None when the
    #: step time was not given.
    dense_share: float | None = None
    #: Leaf modules regional compilation traces (one block of each repeated kind,
    #: ``repeated_blocks``); None when the model repeats no block.
    block_leaf_modules: int | None = None
    #: Share of a training step's wall time in which the GPU runs a kernel or a copy
    #: (``measure.device_busy``); None on a CPU, or where not measured.
    device_busy: float | None = None


def gemm_speedups(device: torch.device) -> dict[str, float]:
    """Each low precision's matrix-product rate over fp32's on ``device`` (``measure.native``:
    one thread on a CPU, interleaved rounds, cached per process)."""
    return {name: gemm_speedup(device, name) for name in _LOW_PRECISIONS}


def emulated_precisions(device: torch.device) -> dict[str, str]:
    """Why each low precision that ``device`` only emulates cannot pay off, by name."""
    return {name: why for name in _LOW_PRECISIONS if (why := emulated(device, name))}


def forward_flops(forward: Callable[[], Any]) -> dict[str, int]:
    """FLOPs of ``forward()``, run without gradients, by aten op (``FlopCounterMode`` counts
    the dense ones: matmuls, attention, convolutions)."""
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        forward()
    return {str(op): count for op, count in counter.get_flop_counts().get("Global", {}).items()}


def conv_flop_share(by_op: dict[str, int]) -> float:
    """Share of a forward's FLOPs (``forward_flops``) in convolutions."""
    total = sum(by_op.values())
    conv = sum(count for op, count in by_op.items() if "convolution" in op)
    return conv / total if total else 0.0


#: A training step's FLOPs over its forward's: backward computes two products per forward one.
STEP_FLOPS_PER_FORWARD = 3
#: At most this share of a step is taken as dense maths: some time always goes elsewhere.
MAX_DENSE_SHARE = 0.95


def dense_time_share(forward_flops: int, step_s: float, device: torch.device) -> float:
    """The step's dense FLOPs at this device's measured fp32 matrix-product rate, over the
    step's time: the part a faster precision can speed up (``precision.precision_gain``)."""
    rate = measured_peak_flops(device, torch.float32)
    dense_s = STEP_FLOPS_PER_FORWARD * forward_flops / rate if rate > 0 else 0.0
    return min(MAX_DENSE_SHARE, dense_s / step_s) if step_s > 0 else MAX_DENSE_SHARE


def leaf_module_count(model: nn.Module) -> int:
    return sum(1 for module in model.modules() if not any(True for _ in module.children()))


def lm_head_census(model: nn.Module, forward: Callable[[], Any]) -> tuple[int | None, int | None]:
    """(float32 bytes of the linear LM heads' logits, bytes held for backward) over one
    ``forward()``; (None, None) when no module of the model has a linear output embedding (the
    heads of the LMs a LightningModule or another wrapper holds count: ``language_models``)."""
    heads = [output_embedding(lm) for _, lm in language_models(model)]
    if not heads:
        return None, None
    seen: list[int] = []
    handles = [
        head.register_forward_hook(lambda module, args, output: seen.append(output.numel()))
        for head in heads
        if head is not None
    ]
    try:
        held = activation_bytes(forward, model=model)
    finally:
        for handle in handles:
            handle.remove()
    return (4 * sum(seen) if seen else None), held


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
    optimizer_share: float | None = None,
    step_s: float | None = None,
    device_busy: float | None = None,
) -> Facts:
    """The facts for ``recipe``: ``model`` is a built model on ``device``, ``batches`` the
    batches it trains on, ``forward()`` one forward of it on the first batch (FLOPs are counted
    on it, without gradients), ``step_s`` the seconds of a training step on that batch and
    ``device_busy`` the device's busy share of one."""
    padding = None
    if recipe.lengths is not None:
        padding = padding_fractions(recipe.lengths, recipe.batch_size, recipe.seed)
    convolutions = has_2d_convolutions(model)
    logits, held = lm_head_census(model, forward)
    by_op = forward_flops(forward)
    dense = None if step_s is None else dense_time_share(sum(by_op.values()), step_s, device)
    return Facts(
        device=str(device),
        gemm_speedup=gemm_speedups(device),
        emulated=emulated_precisions(device),
        padding=padding,
        has_convolutions=convolutions,
        conv_share=conv_flop_share(by_op) if convolutions else 0.0,
        leaf_modules=leaf_module_count(model),
        shapes_vary=len({shape_key(batch) for batch in batches}) > 1,
        comm_share=comm_share,
        optimizer_share=optimizer_share,
        logits_bytes=logits,
        activation_bytes=held,
        dense_share=dense,
        block_leaf_modules=traced_leaf_modules(model),
        device_busy=device_busy,
    )


def before_training(
    model: nn.Module | None,
    device: torch.device,
    lengths: Sequence[int] | None,
    batch_size: int,
    seed: int,
    forward: Callable[[], Any] | None = None,
) -> Facts:
    """The facts measured before any step runs, in seconds: each precision's matrix-product
    rate here, the padding ``lengths`` imply in batches of ``batch_size`` and, given
    ``forward()`` (one forward of the model on a small batch), the LM head's logits against what
    the forward holds for backward. FLOP shares are left unknown, and the model's facts too when
    it is not built yet (None); tuning inside a run starts from these (``engine/in_run.py``)."""
    padding = None if lengths is None else padding_fractions(lengths, batch_size, seed)
    logits, held = (None, None)
    if model is not None and forward is not None:
        logits, held = lm_head_census(model, forward)
    return Facts(
        device=str(device),
        gemm_speedup=gemm_speedups(device),
        emulated=emulated_precisions(device),
        padding=padding,
        has_convolutions=model is not None and has_2d_convolutions(model),
        conv_share=0.0,
        leaf_modules=0 if model is None else leaf_module_count(model),
        shapes_vary=lengths is not None and len(set(lengths)) > 1,
        logits_bytes=logits,
        activation_bytes=held,
    )
