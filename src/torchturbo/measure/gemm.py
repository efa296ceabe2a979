"""The rate of one square matrix product, timed with a device sync: the probe behind the measured
peak (``peak.py``) and the native-format check (``native.py``).

``torch.utils.benchmark.Timer`` would time one statement well, but the two callers need the best
of a few blocks of ``iters`` products on a chosen size, which is these few lines.
"""

from __future__ import annotations

import math
import time

import torch

from torchturbo.measure.timing import sync


def gemm_rate(
    device: torch.device, dtype: torch.dtype, n: int, *, iters: int = 1, repeats: int = 3
) -> float:
    """FLOP/s of the fastest of ``repeats`` blocks of ``iters`` ``(n, n) @ (n, n)`` products."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    torch.mm(a, b, out=out)  # warm-up: kernel selection, first-touch of `out`
    best = math.inf
    for _ in range(repeats):
        sync(device)
        begin = time.perf_counter()
        for _ in range(iters):
            torch.mm(a, b, out=out)
        sync(device)
        best = min(best, time.perf_counter() - begin)
    return 2 * n**3 * iters / best
