"""Dense peak FLOP/s of known NVIDIA GPUs, from their datasheets, per number format.

Published MFU figures (torchtitan: 33-58% on H100s) divide by the datasheet's dense peak, so a
GPU figure is only comparable with them against the same number; ``peak.py`` uses this table for
a known GPU and the measured matmul rate for anything else. No maintained library ships such a
table (torch has none; torchtitan keeps a private one of three entries), hence this one.

All figures are **dense** TFLOP/s: NVIDIA's datasheets print tensor-core figures "with sparsity"
(2:4 structured sparsity, which dense training never uses), and those are halved here. fp32 is
the CUDA-core (non-tensor-core) rate, what a float32 matmul gets with TF32 off. ``None``: the GPU
has no unit for that format.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: Number formats the table knows, in the order peaks are listed.
FORMATS = ("fp32", "tf32", "bf16", "fp16", "fp8")


@dataclass(frozen=True)
class GpuPeaks:
    """One GPU model: the datasheet it comes from and its dense TFLOP/s per format."""

    name: str
    source: str
    fp32: float
    tf32: float | None
    bf16: float | None
    fp16: float | None
    fp8: float | None

    def tflops(self, fmt: str) -> float | None:
        return getattr(self, fmt)


#: The datasheet each row comes from (all at nvidia.com; the year is the edition read).
SOURCES = {
    "h100": "NVIDIA H100 Tensor Core GPU datasheet (2023)",
    "h200": "NVIDIA H200 Tensor Core GPU datasheet (2024)",
    "a100": "NVIDIA A100 Tensor Core GPU datasheet (2021)",
    "a10": "NVIDIA A10 Tensor Core GPU datasheet (2021)",
    "l40s": "NVIDIA L40S GPU datasheet (2023)",
    "l4": "NVIDIA L4 Tensor Core GPU datasheet (2023)",
    "ada": "NVIDIA Ada GPU architecture whitepaper v2.1, appendix A, table 2",
    "v100": "NVIDIA V100 Tensor Core GPU datasheet (2020)",
    "v100s": "NVIDIA V100S datasheet (2019)",
    "t4": "NVIDIA T4 Tensor Core GPU datasheet (2019)",
}

#: (pattern on torch.cuda.get_device_name(), name, source, dense TFLOP/s: fp32, tf32, bf16,
#: fp16, fp8). First match wins, so the more specific names (H100 NVL, H100 PCIe) come before
#: the plain one (an H100 SXM reports "NVIDIA H100 80GB HBM3"). Word boundaries keep "A10" from
#: matching "A100" and "L4" from matching "L40S".
_ROWS: tuple[
    tuple[str, str, str, float, float | None, float | None, float | None, float | None], ...
] = (
    # Hopper. Sparse figures printed: H100/H200 SXM TF32 989, BF16/FP16 1979, FP8 3958; NVL
    # TF32 835, BF16/FP16 1671, FP8 3341; H100 PCIe TF32 756, BF16/FP16 1513, FP8 3026.
    (r"H100.*NVL", "H100 NVL", "h100", 60, 417.5, 835.5, 835.5, 1670.5),
    (r"H100.*PCIe", "H100 PCIe", "h100", 51, 378, 756.5, 756.5, 1513),
    (r"H100", "H100 SXM", "h100", 67, 494.5, 989.5, 989.5, 1979),
    (r"H200.*NVL", "H200 NVL", "h200", 60, 417.5, 835.5, 835.5, 1670.5),
    (r"H200", "H200 SXM", "h200", 67, 494.5, 989.5, 989.5, 1979),
    # Ampere: TF32 156 | 312 sparse, BF16/FP16 312 | 624 (A100); 62.5 | 125, 125 | 250 (A10).
    (r"A100", "A100", "a100", 19.5, 156, 312, 312, None),
    (r"\bA10\b", "A10", "a10", 31.2, 62.5, 125, 125, None),
    # Ada. L4 prints sparse only (TF32 120, BF16/FP16 242, FP8 485); L40S prints both. GeForce
    # tensor cores run fp32 accumulation at half rate and torch accumulates in fp32, so the
    # RTX 4090 row is the whitepaper's "with FP32 accumulate" one (FP16 accumulate: 330).
    (r"\bL40S\b", "L40S", "l40s", 91.6, 183, 362.05, 362.05, 733),
    (r"\bL4\b", "L4", "l4", 30.3, 60, 121, 121, 242.5),
    (r"RTX 4090", "RTX 4090", "ada", 82.6, 82.6, 165.2, 165.2, 330.3),
    # Volta and Turing: fp16 tensor cores only (bf16 and tf32 run emulated there).
    (r"V100S", "V100S PCIe", "v100s", 16.4, None, None, 130, None),
    (r"V100.*PCIE", "V100 PCIe", "v100", 14, None, None, 112, None),
    (r"V100", "V100 SXM2", "v100", 15.7, None, None, 125, None),
    (r"\bT4\b", "T4", "t4", 8.1, None, None, 65, None),
)
TABLE: tuple[tuple[str, GpuPeaks], ...] = tuple(
    (pattern, GpuPeaks(name, SOURCES[source], fp32, tf32, bf16, fp16, fp8))
    for pattern, name, source, fp32, tf32, bf16, fp16, fp8 in _ROWS
)


def known_gpu(device_name: str) -> GpuPeaks | None:
    """The table entry for a ``torch.cuda.get_device_name()`` string, or None if unknown."""
    for pattern, peaks in TABLE:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return peaks
    return None


def datasheet_peak_flops(device_name: str, fmt: str) -> float | None:
    """Dense datasheet FLOP/s of ``fmt`` on the named GPU; None for an unknown GPU or a format
    it has no unit for."""
    if fmt not in FORMATS:
        raise ValueError(
            f"datasheet_peak_flops(fmt={fmt!r}) is invalid: expected one of {', '.join(FORMATS)}"
        )
    peaks = known_gpu(device_name)
    tflops = None if peaks is None else peaks.tflops(fmt)
    return None if tflops is None else tflops * 1e12
