"""The fused bias+GELU custom op against the eager composite and the torch.compile'd composite.

Forward, and forward+backward, in float32 and bfloat16, timed interleaved in one process; ratio is
eager_ms / custom_ms (> 1: the custom op is faster). The C++ build (cold: tens of seconds) and the
compile time are reported apart, never in step time. On CUDA the op runs its Triton kernel
(``torchturbo[triton]``; without triton it runs the composite and the row says so in a warning);
Triton's JIT compile happens in the warm-up, outside the timed rounds.

    python benchmarks/custom_kernels.py --json out.json
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch

from torchturbo.kernels import bias_gelu, bias_gelu_reference, load_cpu_kernels
from torchturbo.measure import measure_interleaved, noise_band, ratio, time_once
from torchturbo.output.results_file import write_results

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _step(fn: Callable, x: torch.Tensor, bias: torch.Tensor, grad: torch.Tensor, backward: bool):
    if not backward:
        return lambda: fn(x, bias)
    xg, bg = x.detach().requires_grad_(), bias.detach().requires_grad_()
    return lambda: torch.autograd.grad(fn(xg, bg), (xg, bg), grad)


def verdict(speedup: float, noise: float) -> str:
    if speedup > 1 + noise:
        return "custom op faster"
    if speedup < 1 - noise:
        return "custom op slower: keep eager"
    return "no difference within noise"


def bench_case(device: str, dtype_name: str, shape: tuple[int, int], backward: bool, args) -> dict:
    dtype = DTYPES[dtype_name]
    x = torch.randn(shape, device=device, dtype=dtype)
    bias = torch.randn(shape[-1], device=device, dtype=dtype)
    grad = torch.randn(shape, device=device, dtype=dtype)
    compiled = torch.compile(bias_gelu_reference, dynamic=False)
    variants = {
        "eager": _step(bias_gelu_reference, x, bias, grad, backward),
        "custom": _step(bias_gelu, x, bias, grad, backward),
        "compiled": _step(compiled, x, bias, grad, backward),
    }
    compile_s = time_once(variants["compiled"], device)
    timings = measure_interleaved(
        variants,
        device=device,
        warmup=args.warmup,
        repeats=args.repeats,
        steps_per_repeat=args.steps,
    )
    noise = noise_band(timings)
    speedup = ratio(timings["custom"], timings["eager"])
    return {
        "op": "bias_gelu",
        "device": device,
        "dtype": dtype_name,
        "shape": list(shape),
        "pass": "fwd+bwd" if backward else "fwd",
        "eager_ms": timings["eager"].median * 1e3,
        "custom_ms": timings["custom"].median * 1e3,
        "compiled_ms": timings["compiled"].median * 1e3,
        "ratio": speedup,
        "compiled_ratio": ratio(timings["compiled"], timings["eager"]),
        "noise_band": noise,
        "compile_s": compile_s,
        "verdict": verdict(speedup, noise),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--rows", type=int, default=4096, help="rows of x (tokens; default 4096)")
    parser.add_argument("--cols", type=int, default=1024, help="features (default 1024)")
    parser.add_argument("--repeats", type=int, default=9, help="interleaved rounds (default 9)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="tiny run for smoke tests")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    args.warmup, args.steps = (1, 1) if args.quick else (3, 5)
    if args.quick:
        args.rows, args.cols, args.repeats = 256, 256, 3
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

    build_s = time_once(load_cpu_kernels, "cpu")
    print(
        f"C++ kernels built/loaded in {build_s:.1f} s; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; x = ({args.rows}, {args.cols})"
    )
    header = (
        f"{'device':6} {'dtype':5} {'pass':8} {'eager ms':>9} {'custom ms':>10} "
        f"{'compiled ms':>12} {'custom x':>9} {'compiled x':>11} {'noise':>6}  verdict"
    )
    print(header)
    results = []
    for device in devices:
        for dtype_name in ["fp32"] if args.quick else DTYPES:
            for backward in (False, True):
                row = bench_case(device, dtype_name, (args.rows, args.cols), backward, args)
                results.append(row)
                print(
                    f"{device:6} {dtype_name:5} {row['pass']:8} {row['eager_ms']:9.3f} "
                    f"{row['custom_ms']:10.3f} {row['compiled_ms']:12.3f} {row['ratio']:9.2f} "
                    f"{row['compiled_ratio']:11.2f} {row['noise_band']:6.1%}  {row['verdict']}"
                )
    if args.json:
        payload = {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "build_s": build_s,
            "results": results,
        }
        write_results(args.json, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
