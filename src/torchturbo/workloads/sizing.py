"""Built-in workloads sized for the device they run on, from its measured properties.

The CPU sizes (``small``, ``large``) make a step of 0.05-5 s on a 2-core CPU. On a GPU they made
a step of ~11 ms whose device was mostly idle (the first H200 run: MFU 0.2-0.4%, bf16 at 0.91x of
fp32): a workload that measures launch overhead shows none of the article's gains. The ``gpu``
size widens the models (:data:`GPU_DIMS`) and picks the batch from two measurements on the device:

- its bf16 (or fp32, if faster) matrix-product rate (``measure.peak``): the batch's FLOPs per
  step (``FlopCounterMode``, per sample on a few samples) should take :data:`DENSE_S` seconds at
  that rate, enough that kernels, not launches, set the step time in every precision;
- its memory: the batch's activations (bytes held for backward, per sample) stay within
  :data:`MEMORY_SHARE` of the device's memory, leaving room for the techniques the tuner tries.

The batch is a multiple of :data:`BATCH_MULTIPLE`, never below the CPU size's; the dataset holds
:data:`BATCHES` batches. What was chosen and why is said in one line (:meth:`Sizing.describe`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from torchturbo.base.device import to_device
from torchturbo.measure.flops import count_step_flops
from torchturbo.measure.memory import activation_bytes
from torchturbo.measure.peak import measured_peak_flops
from torchturbo.recipe import Recipe

#: The models' dimensions at the ``gpu`` size: channels and resolution where convolutions fill
#: tensor cores (ResNet stages of 64-256 channels at 128 px, a U-Net to 256 channels at 256 px),
#: and a 6-layer Transformer of width 512 (~20M parameters).
GPU_DIMS: dict[str, dict[str, Any]] = {
    "vision": {"image_size": 128, "widths": (64, 128, 256)},
    "segmentation": {"image_size": 256, "widths": (32, 64, 128, 256)},
    "text": {"d_model": 512, "num_layers": 6},
}
#: Seconds of dense maths per step at the measured peak: ~7.6 TFLOP on an H200 (762 TFLOP/s
#: bf16 measured), twice ResNet-50's step at batch 256 where published AMP gains (2.6x on an
#: A100) are measured: a bf16 step of it (twice this at a realistic share of the peak) outlasts
#: the few milliseconds of its kernel launches.
DENSE_S = 0.01
#: The share of the device's memory a step's activations may take at the chosen batch.
MEMORY_SHARE = 0.3
#: Batches are multiples of this (tensor-core-friendly row counts).
BATCH_MULTIPLE = 32
#: The dataset holds this many batches, so that trials see different batches.
BATCHES = 8
#: Samples the per-sample FLOPs and bytes are counted on.
PROBE_SAMPLES = 4


@dataclass(frozen=True)
class Sizing:
    """What a device-sized workload was sized from, and the batch it got."""

    device: str
    batch_size: int
    flops_per_sample: float
    bytes_per_sample: float
    peak_flops: float
    memory_bytes: int
    #: Which bound set the batch: "compute" (the FLOP target), "memory" or "floor" (the CPU
    #: size's batch).
    bound: str

    def describe(self, name: str) -> str:
        step = self.batch_size * self.flops_per_sample
        return (
            f"{name} sized for {self.device}: batch {self.batch_size} ({self.bound}-bound: "
            f"{step / 1e12:.2f} TFLOP a step, {step / self.peak_flops * 1e3:.1f} ms at the "
            f"measured {self.peak_flops / 1e12:.0f} TFLOP/s; activations "
            f"{self.batch_size * self.bytes_per_sample / 2**30:.1f} GiB of "
            f"{self.memory_bytes / 2**30:.0f} GiB)"
        )


def batch_for(
    flops_per_sample: float,
    bytes_per_sample: float,
    peak_flops: float,
    memory_bytes: int,
    floor: int,
) -> tuple[int, str]:
    """(batch, bound): the batch whose step takes :data:`DENSE_S` at ``peak_flops``, within
    :data:`MEMORY_SHARE` of ``memory_bytes``, a multiple of :data:`BATCH_MULTIPLE`, at least
    ``floor``."""
    by_compute = DENSE_S * peak_flops / max(flops_per_sample, 1.0)
    by_memory = MEMORY_SHARE * memory_bytes / max(bytes_per_sample, 1.0)
    bound = "compute" if by_compute <= by_memory else "memory"
    rounded = BATCH_MULTIPLE * math.floor(min(by_compute, by_memory) / BATCH_MULTIPLE)
    if rounded <= floor:
        return floor, "floor"
    return rounded, bound


def best_peak(device: torch.device) -> float:
    """The faster of the measured bf16 and fp32 matrix-product rates on ``device``."""
    return max(measured_peak_flops(device, dtype) for dtype in (torch.bfloat16, torch.float32))


def per_sample(recipe: Recipe, device: torch.device) -> tuple[float, float]:
    """(FLOPs of a training step, bytes held for backward) per sample of ``recipe``, counted on
    a batch of :data:`PROBE_SAMPLES` samples on ``device``."""
    model = recipe.model().to(device)
    samples = [recipe.dataset[i] for i in range(PROBE_SAMPLES)]
    batch = to_device(recipe.collate_fn()(samples), device)

    def forward() -> torch.Tensor:
        output = recipe.loss_fn(model, batch)
        return output[0] if isinstance(output, tuple) else output

    held = activation_bytes(forward, model=model)
    flops = count_step_flops(lambda: forward().backward())
    return flops / PROBE_SAMPLES, held / PROBE_SAMPLES
