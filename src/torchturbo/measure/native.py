"""Which number formats the hardware computes natively, and which it only emulates.

bf16 autocast on a CPU without bf16 instructions runs its matmuls through fp32 units plus
conversions, 20-100x slower than fp32 (1.3 against 220 GFLOP/s measured on a 2-core AVX-512 CPU
with oneDNN capped at AVX2); fp16 on a CPU without fp16 instructions is as slow; TF32 does
nothing on a CPU. Training such a candidate to find that out costs minutes; this answers in
about a second, so that the tuner and the doctor can skip it and every report can say why, and
so that MFU in an emulated format is stated against the fp32 peak, the unit that really does the
math (see ``peak.stated_peak``).

How it decides: on CUDA, from the compute capability (tensor cores for fp16 from 7.0, bf16 and
TF32 from 8.0, fp8 from 8.9). On a CPU, an x86 flag list without the format's instructions is
emulated outright; otherwise (the instructions exist, or the flags are unknown, e.g. on ARM) a
GEMM micro-benchmark in that format against fp32 decides, because instructions can be present
and unused (``ONEDNN_MAX_CPU_ISA``, ``ATEN_CPU_CAPABILITY``, an old oneDNN). Results are cached
per process.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch

from torchturbo.measure.gemm import gemm_rate
from torchturbo.measure.system import cpu_flags

#: The formats asked about: the precision names of the config plus fp8 (float8 training).
FORMATS = ("fp32", "tf32", "bf16", "fp16", "fp8")
_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: x86 instructions that compute the format natively on a CPU.
CPU_INSTRUCTIONS = {"bf16": ("avx512_bf16", "amx_bf16"), "fp16": ("avx512_fp16", "amx_fp16")}
#: Compute capability from which NVIDIA GPUs have tensor cores for the format.
CUDA_CAPABILITY = {"fp16": (7, 0), "tf32": (8, 0), "bf16": (8, 0), "fp8": (8, 9)}
#: A format counts as native on a CPU when its GEMM runs at least this many times the fp32 rate.
#: Native bf16 measured 4x (avx512_bf16) and emulated 0.01x here; emulation with AVX-512
#: conversions reaches about fp32's rate but never beyond, so 1.2 separates the two with margin.
NATIVE_SPEEDUP = 1.2
#: GEMM size of the micro-benchmark: large enough to be compute-bound on one CPU core, small
#: enough that an emulated product (~1 GFLOP/s per core) takes about 30 ms.
_PROBE_N = 256
#: Alternating rounds of the two formats; each keeps its best.
_ROUNDS = 5


def emulated(device: torch.device | str, fmt: str) -> str | None:
    """Why ``device`` has no native unit for ``fmt`` (fp32, tf32, bf16, fp16, fp8), or None if it
    has one. Decided once per process and device (a micro-benchmark on a CPU: about a second)."""
    if fmt not in FORMATS:
        raise ValueError(f"emulated(fmt={fmt!r}) is invalid: expected one of {', '.join(FORMATS)}")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _emulated(device.type, device.index, fmt)


def native_dtypes(device: torch.device | str) -> dict[str, bool]:
    """Every format of :data:`FORMATS` mapped to whether ``device`` computes it natively."""
    return {fmt: emulated(device, fmt) is None for fmt in FORMATS}


def emulation_notice(device: torch.device | str, formats: Iterable[str]) -> str | None:
    """A note naming the formats among ``formats`` that ``device`` emulates, a line per reason;
    None when it computes all of them natively. The CLI prints it before a run."""
    reasons = {fmt: why for fmt in dict.fromkeys(formats) if (why := emulated(device, fmt))}
    if not reasons:
        return None
    them = "them" if len(reasons) > 1 else "it"
    lines = [
        f"note: this {torch.device(device).type} emulates {', '.join(reasons)}: expect no "
        f"speedup from {them};",
        f"  MFU in {them} is stated against the fp32 peak",
        *(f"  {fmt}: {why}" for fmt, why in reasons.items()),
    ]
    return "\n".join(lines)


@functools.cache
def _emulated(device_type: str, index: int | None, fmt: str) -> str | None:
    if fmt == "fp32":
        return None
    if device_type == "cuda":
        assert index is not None  # emulated() resolved the current CUDA device
        return _cuda_reason(torch.device("cuda", index), fmt)
    if device_type == "cpu":
        return _cpu_reason(fmt)
    # torch.device(type, None) is valid: torch's stub types the index as int.
    return _measured_reason(torch.device(device_type, index), fmt)  # type: ignore[arg-type]


def _cuda_reason(device: torch.device, fmt: str) -> str | None:
    capability = torch.cuda.get_device_capability(device)
    if capability >= CUDA_CAPABILITY[fmt]:
        return None
    needed = ".".join(map(str, CUDA_CAPABILITY[fmt]))
    return (
        f"{torch.cuda.get_device_name(device)} has compute capability "
        f"{'.'.join(map(str, capability))}; {fmt} tensor cores need >= {needed}"
    )


def _cpu_reason(fmt: str) -> str | None:
    if fmt == "tf32":
        return "CPUs have no TF32 units: tf32 matmuls run as fp32"
    if fmt == "fp8":
        return "CPUs have no fp8 units (float8 needs CUDA compute capability >= 8.9)"
    flags = cpu_flags()
    instructions = CPU_INSTRUCTIONS[fmt]
    if flags and not flags & set(instructions):
        return f"no {' or '.join(instructions)} instructions"
    return _measured_reason(torch.device("cpu"), fmt)


def _measured_reason(device: torch.device, fmt: str) -> str | None:
    dtype = _TORCH_DTYPES.get(fmt)
    if dtype is None:  # tf32/fp8 on a device that is neither a CPU nor CUDA: no way to check
        return f"no {fmt} check for {device.type} devices"
    speedup = _speedup(device, dtype)
    if speedup >= NATIVE_SPEEDUP:
        return None
    # Two decimals read 0.00x for the 0.003x of bf16 emulated on AVX2: two significant digits.
    ratio = f"{speedup:.2f}" if speedup >= 0.1 else f"{speedup:.2g}"
    return f"a {fmt} matmul ran at {ratio}x the fp32 rate"


def gemm_speedup(device: torch.device | str, fmt: str) -> float:
    """How many times fp32's rate a GEMM in ``fmt`` (bf16, fp16, tf32) runs at on ``device``:
    measured as below, cached per process; 1.0 for TF32 on a CPU, which has no TF32 units."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _gemm_speedup(device.type, device.index, fmt)


@functools.cache
def _gemm_speedup(device_type: str, index: int | None, fmt: str) -> float:
    # torch.device(type, None) is valid: torch's stub types the index as int.
    device = torch.device(device_type, index)  # type: ignore[arg-type]
    if fmt == "tf32":
        return _tf32_speedup(device) if device_type == "cuda" else 1.0
    if fmt not in _TORCH_DTYPES:
        raise ValueError(f"gemm_speedup(fmt={fmt!r}) is invalid: expected bf16, fp16 or tf32")
    return _speedup(device, _TORCH_DTYPES[fmt])


def _tf32_speedup(device: torch.device) -> float:
    """fp32 GEMM rate with TF32 tensor cores allowed over the rate without (CUDA)."""
    saved = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        strict = gemm_rate(device, torch.float32, 4096, repeats=3)
        torch.backends.cuda.matmul.allow_tf32 = True
        return gemm_rate(device, torch.float32, 4096, repeats=3) / strict
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


@functools.cache
def _speedup(device: torch.device, dtype: torch.dtype) -> float:
    """Best-of rate of a GEMM in ``dtype`` over fp32's.

    On one thread: a parallel GEMM on a busy machine waits at every barrier for its slowest
    thread, which made a native bf16 GEMM measure 0.38x fp32 on 2 loaded cores; one thread's
    ratio is the same per core and barely moved under that load. The two formats alternate for
    a few rounds, each keeping its best block, so that load hits both alike.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fp32_iters = _iters_for(device, torch.float32)
        low_iters = _iters_for(device, dtype)
        fp32 = low = 0.0
        for _ in range(_ROUNDS):
            fp32 = max(
                fp32, gemm_rate(device, torch.float32, _PROBE_N, iters=fp32_iters, repeats=1)
            )
            low = max(low, gemm_rate(device, dtype, _PROBE_N, iters=low_iters, repeats=1))
        return low / fp32
    finally:
        torch.set_num_threads(threads)


def _iters_for(device: torch.device, dtype: torch.dtype) -> int:
    """Products per timed block so that a block lasts about 5 ms (at least one product)."""
    seconds = 2 * _PROBE_N**3 / gemm_rate(device, dtype, _PROBE_N, repeats=1)
    return max(1, min(64, round(0.005 / seconds)))
