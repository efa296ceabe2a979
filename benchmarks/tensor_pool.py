"""Plain allocation vs TensorPool vs preallocated ``out=`` buffers, on a loop of matmul + add.

Each step computes ``z = x @ w + b`` (``--op add``: ``z = (x + 1) + b``, no matmul, where
allocation is a larger share) through a temporary ``y``: "alloc" lets PyTorch allocate
``y`` and ``z`` every step, "pool" borrows them from a TensorPool and writes with ``out=``,
"out=" writes into two buffers allocated once before the loop. Sizes range from tiny (allocation
and Python overhead dominate) to large (the matmul dominates). Interleaved in one process; ratio
is alloc_ms / variant_ms (> 1: faster than plain allocation).

    python benchmarks/tensor_pool.py --json out.json
    python benchmarks/tensor_pool.py --op add --sizes 1024 2048 4096
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from torchturbo.measure import measure_interleaved, noise_band, ratio, time_once
from torchturbo.output.results_file import write_results
from torchturbo.techniques.tools.tensor_pool import TensorPool


def variants(n: int, device: str, loop: int, op: str = "matmul") -> dict:
    x = torch.randn(n, n, device=device)
    w = torch.randn(n, n, device=device)
    b = torch.randn(n, device=device)
    pool = TensorPool()
    y_buf, z_buf = torch.empty(n, n, device=device), torch.empty(n, n, device=device)

    def first(out: torch.Tensor | None = None) -> torch.Tensor:
        if op == "matmul":
            return torch.matmul(x, w, out=out)
        return torch.add(x, 1.0, out=out)

    def alloc() -> None:
        for _ in range(loop):
            torch.add(first(), b)

    def pooled() -> None:
        for _ in range(loop):
            with pool.borrow((n, n), device=device) as y, pool.borrow((n, n), device=device) as z:
                first(out=y)
                torch.add(y, b, out=z)

    def preallocated() -> None:
        for _ in range(loop):
            first(out=y_buf)
            torch.add(y_buf, b, out=z_buf)

    return {"alloc": alloc, "pool": pooled, "out=": preallocated}


def _calibrate(n: int, device: str, op: str, target_s: float) -> int:
    """Inner iterations per step so that one timed block lasts ~target_s even for tiny sizes
    (short blocks are dominated by timer and scheduler noise)."""
    probe = variants(n, device, 10, op)["alloc"]
    probe()
    seconds = time_once(probe, device) / 10
    return max(1, min(20_000, round(target_s / max(seconds, 1e-9))))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 256, 1024])
    parser.add_argument("--op", choices=["matmul", "add"], default="matmul", help="first op")
    parser.add_argument("--repeats", type=int, default=9, help="interleaved rounds (default 9)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on a busy machine OpenMP wake-ups swamp small ops)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny run for smoke tests")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.quick:
        args.sizes, args.repeats = [8, 64], 3
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; us per {args.op}+add")
    print(
        f"{'device':6} {'n':>5} {'alloc us':>9} {'pool us':>9} {'out= us':>9} "
        f"{'pool x':>7} {'out= x':>7} {'noise':>6}"
    )
    results = []
    for device in devices:
        for n in args.sizes:
            loop = _calibrate(n, device, args.op, target_s=0.005 if args.quick else 0.03)
            timings = measure_interleaved(
                variants(n, device, loop, args.op),
                device=device,
                warmup=2,
                repeats=args.repeats,
                steps_per_repeat=1,
            )
            us = {name: t.median / loop * 1e6 for name, t in timings.items()}
            row = {
                "device": device,
                "op": args.op,
                "n": n,
                "inner_loop": loop,
                "alloc_us": us["alloc"],
                "pool_us": us["pool"],
                "out_us": us["out="],
                "pool_ratio": ratio(timings["pool"], timings["alloc"]),
                "out_ratio": ratio(timings["out="], timings["alloc"]),
                "noise_band": noise_band(timings),
            }
            results.append(row)
            print(
                f"{device:6} {n:5d} {row['alloc_us']:9.2f} {row['pool_us']:9.2f} "
                f"{row['out_us']:9.2f} {row['pool_ratio']:7.2f} {row['out_ratio']:7.2f} "
                f"{row['noise_band']:6.1%}"
            )
    if args.json:
        payload = {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "results": results,
        }
        write_results(args.json, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
