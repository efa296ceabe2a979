"""Measurement: synchronized timing, FLOPs and MFU, memory, and the phase split of a step.

Everything the tuner and the benchmarks report is read through this package; see
docs/measurement.md for how each number is obtained and what it does and does not include.
"""

from torchturbo.measure.breakdown import PHASES, NullRecorder, PhaseRecorder, Recorder
from torchturbo.measure.datasheet import datasheet_peak_flops
from torchturbo.measure.flops import count_forward_flops, count_step_flops
from torchturbo.measure.memory import (
    CHECKPOINT_MARKER,
    PeakMemory,
    activation_bytes,
    track_peak_memory,
)
from torchturbo.measure.native import emulated, emulation_notice, native_dtypes
from torchturbo.measure.peak import Peak, dtype_for_precision, measured_peak_flops, mfu, stated_peak
from torchturbo.measure.timing import (
    Timing,
    measure_interleaved,
    noise_band,
    paired_noise,
    ratio,
    sync,
    time_once,
)

__all__ = [
    "CHECKPOINT_MARKER",
    "PHASES",
    "NullRecorder",
    "Peak",
    "PeakMemory",
    "PhaseRecorder",
    "Recorder",
    "Timing",
    "activation_bytes",
    "count_forward_flops",
    "count_step_flops",
    "datasheet_peak_flops",
    "dtype_for_precision",
    "emulated",
    "emulation_notice",
    "measure_interleaved",
    "measured_peak_flops",
    "mfu",
    "native_dtypes",
    "noise_band",
    "paired_noise",
    "ratio",
    "stated_peak",
    "sync",
    "time_once",
    "track_peak_memory",
]
