"""The machine a figure was measured on: what ``torchturbo version`` prints and every results
file embeds (``output.results_file``), from the system's facts (``measure.system``) and the
measured bf16 verdict (``measure.native``)."""

from __future__ import annotations

import platform

import torch

import torchturbo
from torchturbo.measure.native import emulated, gemm_speedup
from torchturbo.measure.system import cpu_bf16_support, cpu_model, usable_cores


def summary() -> dict[str, str]:
    """The facts `torchturbo version` prints and reports embed."""
    cuda = torch.version.cuda or "none (CPU build)"
    if torch.cuda.is_available():
        device = f"cuda: {torch.cuda.get_device_name(0)} (x{torch.cuda.device_count()})"
    else:
        device = f"cpu: {platform.processor() or platform.machine()}, {usable_cores()} cores"
    return {
        "torchturbo": torchturbo.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda": cuda,
        "device": device,
        "cpu": cpu_model(),
        "cpu capability": torch.backends.cpu.get_cpu_capability(),
        "cpu bf16 instructions": cpu_bf16_support(),
        "cpu bf16, measured": cpu_bf16_verdict(),
    }


def cpu_bf16_verdict() -> str:
    """Whether this CPU computes bf16 natively, as measured: the class of machine a figure comes
    from. Flags cannot tell (an Intel VM listing ``avx512_bf16`` ran bf16 GEMMs at 0.52x fp32);
    ``measure.native`` decides by a GEMM probe (about a second, once per process)."""
    reason = emulated("cpu", "bf16")
    if reason is None:
        return f"native (a bf16 matmul ran at {gemm_speedup('cpu', 'bf16'):.2f}x the fp32 rate)"
    return f"emulated ({reason})"
