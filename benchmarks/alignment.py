"""Does dimension alignment matter for matmul speed here? Linear layers of width 1001, 1000, 1024.

For each dtype, ``F.linear`` on (tokens, width) @ (width, width) runs for each width, interleaved
in one process. Reported per variant: milliseconds, GFLOP/s on the FLOPs it computes, and the
time per *useful* FLOP relative to the 1000-wide layer, where the useful work is always the
1000-wide job (so padding 1000 -> 1024 wins only if its 4.9% extra FLOPs cost less than the speed
it gains). 1001 is odd, 1000 a multiple of 8 but not of 64, 1024 a multiple of everything.

    python benchmarks/alignment.py --json out.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from torchturbo.measure import measure_interleaved, noise_band
from torchturbo.output.results_file import write_results

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def bench_dtype(dtype_name: str, device: str, tokens: int, widths: list[int], useful: int, args):
    dtype = DTYPES[dtype_name]
    tensors = {
        w: (
            torch.randn(tokens, w, device=device, dtype=dtype),
            torch.randn(w, w, device=device, dtype=dtype),
        )
        for w in widths
    }
    variants = {str(w): (lambda x=x, wt=wt: F.linear(x, wt)) for w, (x, wt) in tensors.items()}
    timings = measure_interleaved(
        variants,
        device=device,
        warmup=args.warmup,
        repeats=args.repeats,
        steps_per_repeat=args.steps,
    )
    base = timings[str(useful)].median
    rows = []
    for w in widths:
        seconds = timings[str(w)].median
        flops = 2 * tokens * w * w
        rows.append(
            {
                "device": device,
                "dtype": dtype_name,
                "tokens": tokens,
                "width": w,
                "ms": seconds * 1e3,
                "gflops": flops / seconds / 1e9,
                # < 1: this width does the useful 1000-wide job in less time than width 1000 itself.
                "time_per_useful_flop_vs_useful": seconds / base,
                "spread": timings[str(w)].spread,
            }
        )
    return rows, noise_band(timings)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--tokens", type=int, default=2048, help="rows of the input (default 2048)")
    parser.add_argument("--repeats", type=int, default=9, help="interleaved rounds (default 9)")
    parser.add_argument("--quick", action="store_true", help="tiny run for smoke tests")
    args = parser.parse_args()
    args.warmup, args.steps = (1, 1) if args.quick else (3, 3)
    useful, widths = 1000, [1001, 1000, 1024]
    if args.quick:
        args.tokens, args.repeats, useful, widths = 64, 3, 120, [121, 120, 128]
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, tokens={args.tokens}")
    print(f"{'device':6} {'dtype':5} {'width':>6} {'ms':>9} {'GFLOP/s':>9} {'t/useful':>9} spread")
    results, noise = [], {}
    for device in devices:
        for dtype_name in DTYPES:
            rows, band = bench_dtype(dtype_name, device, args.tokens, widths, useful, args)
            noise[f"{device}/{dtype_name}"] = band
            results.extend(rows)
            for r in rows:
                print(
                    f"{device:6} {dtype_name:5} {r['width']:6d} {r['ms']:9.3f} {r['gflops']:9.1f} "
                    f"{r['time_per_useful_flop_vs_useful']:9.3f} {r['spread']:7.1%}"
                )
    if args.json:
        payload = {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "useful_width": useful,
            "noise_band": noise,
            "results": results,
        }
        write_results(args.json, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
