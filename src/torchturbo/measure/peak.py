"""The peak FLOP/s an MFU is stated against, one per row, and MFU itself.

One stated peak per row: the dense peak of the unit that does the math. For a GPU in the
datasheet table (``datasheet.py``) that is the datasheet figure, so that MFU compares with
published ones; elsewhere it is measured here by a large matrix product in that format, because a
datasheet peak is wrong for CPUs (it depends on cores, clocks, ISA and threads). A format the
hardware only emulates (``native.py``: bf16 on a CPU without bf16 instructions) runs on the fp32
units, so its MFU is stated against the fp32 peak and labelled emulated; a per-format measured
peak there was the emulated GEMM's own rate and gave a 20x slower variant a 5x higher MFU.
Measuring takes about a second per format and is cached for the process.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from torchturbo.measure.datasheet import known_gpu
from torchturbo.measure.gemm import gemm_rate
from torchturbo.measure.native import emulated

_DTYPES = {
    "fp32": torch.float32,
    # tf32 keeps float32 storage; only the matmul precision setting differs.
    "tf32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}

#: Seconds one timed block of matmuls should take: long enough to dwarf timer and launch overhead,
#: short enough that measuring a peak costs about a second.
_TARGET_SECONDS = 0.2
#: Size bounds: below 256 a CPU matmul is overhead-bound; 8192^2 operands fit any device here.
_MIN_N, _MAX_N = 256, 8192
_REPEATS = 5

if sys.version_info >= (3, 11):
    from math import cbrt
else:  # pragma: no cover - exercised only on Python 3.10, whose math has no cbrt

    def cbrt(x: float) -> float:
        return x ** (1 / 3)


def dtype_for_precision(name: str) -> torch.dtype:
    """The dtype matmuls run in for a ``[precision] dtype`` name: fp32, tf32, bf16 or fp16."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(
            f"dtype_for_precision(name={name!r}) is invalid: expected one of {', '.join(_DTYPES)}"
        ) from None


def measured_peak_flops(device: torch.device | str, dtype: torch.dtype) -> float:
    """FLOP/s of the best of a few timed square matmuls in ``dtype`` on ``device``.

    The size is chosen from a quick probe so that a timed block lasts about 0.2 s. The result is
    cached per device, dtype and the settings that change the rate: float32 matmul precision
    (tf32 on CUDA) and, on CPU, the intra-op thread count.
    """
    device = torch.device(device)
    index = device.index
    if device.type == "cuda" and index is None:
        index = torch.cuda.current_device()
    precision = torch.get_float32_matmul_precision() if dtype == torch.float32 else ""
    threads = torch.get_num_threads() if device.type == "cpu" else 0
    return _measure_peak(device.type, index, dtype, precision, threads)


@functools.cache
def _measure_peak(
    device_type: str, index: int | None, dtype: torch.dtype, _precision: str, _threads: int
) -> float:
    # _precision and _threads are cache keys only: the rate is measured under the current settings.
    # torch.device(type, None) is valid: torch's stub types the index as int.
    device = torch.device(device_type, index)  # type: ignore[arg-type]
    rate = _probe(device, dtype)
    # A busy machine can make the probe underestimate the rate and so pick too short a block;
    # re-plan from the better estimate until a block lasts at least half the target.
    for _ in range(3):
        n, iters = _plan(rate)
        rate = max(rate, gemm_rate(device, dtype, n, iters=iters, repeats=_REPEATS))
        if 2 * n**3 * iters / rate >= _TARGET_SECONDS / 2:
            break
    return rate


def _plan(rate: float) -> tuple[int, int]:
    """Matrix size and matmuls per timed block so that the block takes about the target time."""
    # n^3 grows fast, so pick n for the target time, then repeat the matmul if n hit its bound.
    n = max(_MIN_N, min(_MAX_N, int(cbrt(rate * _TARGET_SECONDS / 2)) // 256 * 256))
    iters = max(1, round(rate * _TARGET_SECONDS / (2 * n**3)))
    return n, iters


def _probe(device: torch.device, dtype: torch.dtype) -> float:
    """A first rate estimate, the best seen while doubling n until the rate saturates.

    Starting small matters: fp16 matmul on a CPU without fp16 units runs at ~1 GFLOP/s, where a
    fixed 1024^3 probe would take seconds. Stopping only once doubling n no longer raises the
    rate much matters too: on a busy CPU each parallel matmul can stall for a scheduler slice,
    and a small n would mistake that stall for the machine's speed.
    """
    n = _MIN_N
    rate = best = gemm_rate(device, dtype, n, repeats=2)
    # Double while the next size is predicted to take at most twice the target (8x the work).
    while n < _MAX_N and 16 * n**3 / rate <= 2 * _TARGET_SECONDS:
        bigger = gemm_rate(device, dtype, 2 * n, repeats=2)
        best = max(best, bigger)
        if 2 * n**3 / rate >= 0.02 and bigger < 1.25 * rate:
            break
        n, rate = 2 * n, bigger
    return best


@dataclass(frozen=True)
class Peak:
    """The peak one row's MFU is stated against, and where it comes from."""

    #: FLOP/s; None where no peak is known (fp8 on a GPU outside the datasheet table).
    flops: float | None
    #: The row's number format: fp32, tf32, bf16, fp16 or fp8.
    fmt: str
    #: The format of the unit that does the math: ``fmt``, or fp32 where ``fmt`` is emulated.
    unit: str
    #: "measured", "datasheet <GPU>", or why there is no peak.
    source: str
    #: Why ``fmt`` is emulated on this device (``native.emulated``); None when it is native.
    emulated: str | None = None

    def describe(self) -> str:
        """E.g. "bf16 peak 0.906 TFLOP/s, measured", or "fp32 peak 0.217 TFLOP/s, measured
        (bf16 emulated)", or "no fp8 peak (why)"."""
        if self.flops is None:
            return f"no {self.fmt} peak ({self.source})"
        text = f"{self.unit} peak {self.flops / 1e12:.3g} TFLOP/s, {self.source}"
        return text + (f" ({self.fmt} emulated)" if self.emulated else "")


def stated_peak(device: torch.device | str, fmt: str) -> Peak:
    """The dense peak of the unit that does ``fmt``'s math on ``device``: the datasheet figure
    for a GPU in the table, else measured; the fp32 peak where ``fmt`` is emulated."""
    device = torch.device(device)
    why = emulated(device, fmt)
    unit = "fp32" if why else fmt
    if device.type == "cuda":
        gpu = known_gpu(torch.cuda.get_device_name(device))
        tflops = None if gpu is None else gpu.tflops(unit)
        if gpu is not None and tflops is not None:
            return Peak(tflops * 1e12, fmt, unit, f"datasheet {gpu.name}", why)
    measured = measured_format_peak(device, unit)
    if measured is None:
        return Peak(None, fmt, unit, "fp8 is not measured and this GPU is not in the table", why)
    return Peak(measured, fmt, unit, "measured", why)


def measured_format_peak(device: torch.device | str, fmt: str) -> float | None:
    """:func:`measured_peak_flops` of a format's unit, with TF32 on for tf32 and off for fp32
    whatever a live session has set; None for fp8 (measuring it needs ``torch._scaled_mm``, a
    private API)."""
    if fmt == "fp8":
        return None
    with _matmul_precision("high" if fmt == "tf32" else "highest"):
        return measured_peak_flops(device, dtype_for_precision(fmt))


@contextlib.contextmanager
def _matmul_precision(precision: str) -> Iterator[None]:
    """Measure fp32 and tf32 under their own setting, whatever a live Turbo session has set."""
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved)


def mfu(flops_per_step: int, step_seconds: float, peak: float) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s over ``peak``; None where it is undefined.

    Undefined (None) when the step counts no FLOPs or a time or peak is zero. Not clamped: a value
    above 1 means the peak was under-measured (e.g. the machine was busy), and the caller reports
    it rather than hiding it.
    """
    arguments = {"flops_per_step": flops_per_step, "step_seconds": step_seconds, "peak": peak}
    for name, value in arguments.items():
        if value < 0:
            raise ValueError(f"mfu({name}={value!r}) is invalid: expected a value >= 0")
    if flops_per_step == 0 or step_seconds == 0 or peak == 0:
        return None
    return flops_per_step / step_seconds / peak
