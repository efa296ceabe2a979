"""What this machine says it offers: CPU flags and model, usable cores.

Read from the system, never measured: what is measured of the machine (is bf16 native?) is
``measure.native``, which builds on this module; ``measure.machine`` puts both together.
"""

from __future__ import annotations

import os
import platform
from functools import cache
from pathlib import Path

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
    and is not always fast with them (see :func:`torchturbo.measure.machine.cpu_bf16_verdict`)."""
    native = sorted(cpu_flags() & {"avx512_bf16", "amx_bf16", "avx_vnni"})
    return ", ".join(native) if native else "none listed"


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@cache
def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what ``platform`` says."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()
