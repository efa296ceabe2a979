"""What this machine offers: torch build, CUDA devices, CPU instruction sets for bf16."""

from __future__ import annotations

import os
import platform
from functools import cache
from pathlib import Path

import torch

import torchturbo

#: Replaces the flag list read from /proc/cpuinfo (space-separated), to see how torchturbo decides
#: on a CPU whose flags differ from this one's: the test suite runs under it with bf16 claimed on
#: a CPU without it, and withheld on one with it. Measurements are not faked: where the flags
#: claim an instruction, the GEMM probe of ``measure.native`` still decides.
CPU_FLAGS_OVERRIDE = "TORCHTURBO_CPU_FLAGS"


@cache
def cpu_flags() -> frozenset[str]:
    """CPU feature flags from /proc/cpuinfo (empty where it does not exist, e.g. macOS), or from
    ``$TORCHTURBO_CPU_FLAGS`` when it is set."""
    override = os.environ.get(CPU_FLAGS_OVERRIDE)
    if override is not None:
        return frozenset(override.split())
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        return frozenset()
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def cpu_bf16_support() -> str:
    """Which bf16 instructions the CPU's flags list: bf16 autocast can only be fast with them,
    and is not always fast with them (see :func:`cpu_bf16_verdict`)."""
    native = sorted(cpu_flags() & {"avx512_bf16", "amx_bf16", "avx_vnni"})
    return ", ".join(native) if native else "none listed"


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


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
    from torchturbo.measure.native import emulated, gemm_speedup  # native imports this module

    reason = emulated("cpu", "bf16")
    if reason is None:
        return f"native (a bf16 matmul ran at {gemm_speedup('cpu', 'bf16'):.2f}x the fp32 rate)"
    return f"emulated ({reason})"


@cache
def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what ``platform`` says."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()
