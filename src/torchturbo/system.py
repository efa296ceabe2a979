"""What this machine offers: torch build, CUDA devices, CPU instruction sets for bf16."""

from __future__ import annotations

import os
import platform
from functools import cache
from pathlib import Path

import torch

import torchturbo


@cache
def cpu_flags() -> frozenset[str]:
    """CPU feature flags from /proc/cpuinfo (empty where it does not exist, e.g. macOS)."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        return frozenset()
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def cpu_bf16_support() -> str:
    """Which native bf16 instructions the CPU has: bf16 autocast is only fast with them."""
    native = sorted(cpu_flags() & {"avx512_bf16", "amx_bf16", "avx_vnni"})
    return ", ".join(native) if native else "none (bf16 runs emulated and is usually slower)"


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
        "cpu capability": torch.backends.cpu.get_cpu_capability(),
        "cpu bf16 instructions": cpu_bf16_support(),
    }


@cache
def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what ``platform`` says."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()
