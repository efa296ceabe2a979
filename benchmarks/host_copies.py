"""Host-to-device copies from pageable and from pinned (page-locked) memory, on CUDA.

What ``[data] pin_memory`` and ``non_blocking`` buy, in two figures per batch shape: the copy's
bandwidth (GB/s, copies timed interleaved with a device sync around each block), and how long
the calling thread is held by ``copy_(..., non_blocking=True)`` before it may go on (a pageable
source is staged through a pinned buffer by the driver, so the call returns only once the data
has left; a pinned source returns at once and the copy overlaps whatever the thread does next,
such as collating the next batch). Without a CUDA device there is nothing to copy to: the script
records why and exits 0, so that the GPU suite's CPU dry run stays green.

    python benchmarks/host_copies.py --device cuda --json out.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from torchturbo.measure.timing import measure_interleaved, ratio
from torchturbo.output.results_file import write_results

#: Batches as the built-in workloads hand them over, plus one large transfer.
SHAPES = {
    "vision batch 256x3x64x64 fp32": ((256, 3, 64, 64), torch.float32),
    "text batch 64x512 int64": ((64, 512), torch.int64),
    "256 MiB fp32": ((64, 1024, 1024), torch.float32),
}


def bench_shape(shape: tuple[int, ...], dtype: torch.dtype, repeats: int) -> dict[str, Any]:
    device = torch.device("cuda")
    pageable = torch.ones(shape, dtype=dtype)
    pinned = pageable.pin_memory()
    target = torch.empty(shape, dtype=dtype, device=device)
    copies = {
        "pageable": lambda: target.copy_(pageable, non_blocking=True),
        "pinned": lambda: target.copy_(pinned, non_blocking=True),
    }
    timings = measure_interleaved(
        copies, device=device, warmup=2, repeats=repeats, steps_per_repeat=5
    )
    nbytes = pageable.numel() * pageable.element_size()
    held = {name: _held_ms(copy, repeats) for name, copy in copies.items()}
    return {
        "bytes": nbytes,
        **{f"{name}_gb_s": nbytes / timings[name].median / 1e9 for name in copies},
        **{f"{name}_spread": timings[name].spread for name in copies},
        "pinned_speedup": ratio(timings["pinned"], timings["pageable"]),
        **{f"{name}_call_holds_ms": ms for name, ms in held.items()},
    }


def _held_ms(copy: Any, repeats: int) -> float:
    """Median ms until ``copy()`` returns to the caller (the device is idle before each call)."""
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        begin = time.perf_counter()
        copy()
        samples.append(time.perf_counter() - begin)
        torch.cuda.synchronize()
    return 1e3 * statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=9, help="interleaved rounds (default 9)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    args = parser.parse_args()
    payload: dict[str, Any] = {"device": args.device, "torch": torch.__version__}
    if not args.device.startswith("cuda") or not torch.cuda.is_available():
        payload["not_applicable"] = "host-to-device copies need a CUDA device; none here"
        print(payload["not_applicable"])
    else:
        repeats = 3 if args.quick else args.repeats
        payload["results"] = {}
        print(
            f"{'batch':30} {'GB/s pageable':>13} {'pinned':>7} {'ratio':>6} {'call holds ms':>14}"
        )
        for name, (shape, dtype) in SHAPES.items():
            row = bench_shape(shape, dtype, repeats)
            payload["results"][name] = row
            print(
                f"{name:30} {row['pageable_gb_s']:13.1f} {row['pinned_gb_s']:7.1f} "
                f"{row['pinned_speedup']:5.2f}x {row['pageable_call_holds_ms']:6.2f} vs "
                f"{row['pinned_call_holds_ms']:.2f}"
            )
    if args.json:
        write_results(args.json, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
