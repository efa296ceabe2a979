"""Inference speed: eager fp32 vs BatchNorm-folded vs torch.compile vs bf16, latency and throughput.

Variants, all on the same eval-mode model and inputs, timed interleaved in one run under
``torch.inference_mode()``:

* ``eager``: fp32, the baseline of every ratio;
* ``fused``: Conv/Linear + BatchNorm folded by ``techniques.tools.fusion.fuse_for_inference``;
* ``bf16``: eager under ``torch.autocast(device, torch.bfloat16)``;
* ``fused+compile``: ``torch.compile`` of the fused model; on CPU with inductor's ``freezing``
  option (weights become constants: constant folding, weight prepacking for oneDNN), passed
  through ``torch.compile(options=...)``, its public route to inductor settings;
* ``fused+compile+bf16``: the same compiled model under bf16 autocast.

Batch 1 gives latency, ``--large-batch`` gives throughput. Compile time (the first call at each
batch size and precision, which compiles with ``dynamic=False`` for shape-specialised kernels) is
reported apart, in ``compile_s``. ``max_rel_diff`` is ``max|y - y_eager| / max|y_eager|`` on the
timed inputs: the parity cost of each variant.

    python benchmarks/inference.py --workload vision --json out.json [--quick] [--no-compile]
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

from torchturbo.measure import measure_interleaved, noise_band, time_once
from torchturbo.output.results_file import write_results
from torchturbo.output.table_fit import print_table
from torchturbo.techniques.tools.export import capture_model_inputs
from torchturbo.techniques.tools.fusion import fuse_for_inference
from torchturbo.workloads import WORKLOADS, get_workload

BASELINE = "eager"


def to_device(value: Any, device: str) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device) for v in value)
    return value


def first_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    items = value.values() if isinstance(value, dict) else value
    return next(first_tensor(v) for v in items if isinstance(v, (torch.Tensor, dict, list, tuple)))


def build_variants(
    model: nn.Module, device: str, with_compile: bool
) -> dict[str, tuple[Callable[..., Any], bool]]:
    """Variant name -> (callable model, runs under bf16 autocast)."""
    fused, report = fuse_for_inference(model)
    print(
        f"fused {len(report.fused)} pairs; traced={report.traced}; skipped={list(report.skipped)}"
    )
    variants: dict[str, tuple[Callable[..., Any], bool]] = {
        BASELINE: (model, False),
        "fused": (fused, False),
        "bf16": (model, True),
    }
    if with_compile:
        # Freezing treats parameters as constants; valid because inference never updates them.
        options = {"freezing": True} if device == "cpu" else None
        compiled = torch.compile(fused, dynamic=False, options=options)
        variants["fused+compile"] = (compiled, False)
        variants["fused+compile+bf16"] = (compiled, True)
    return variants


def runner(fn: Callable[..., Any], bf16: bool, inputs: tuple[Any, ...], device: str):
    def run() -> Any:
        autocast = (
            torch.autocast(device_type=device, dtype=torch.bfloat16)
            if bf16
            else contextlib.nullcontext()
        )
        with torch.inference_mode(), autocast:
            return fn(*inputs)

    return run


def measure_batch(
    variants: dict[str, tuple[Callable[..., Any], bool]],
    inputs: tuple[Any, ...],
    batch: int,
    device: str,
    repeats: int,
    small_steps: int,
) -> list[dict[str, Any]]:
    runs = {name: runner(fn, bf16, inputs, device) for name, (fn, bf16) in variants.items()}
    # First call of each variant apart: it compiles the compiled ones (and warms the others).
    first_s = {name: time_once(run, device) for name, run in runs.items()}
    reference = first_tensor(runs[BASELINE]()).float()
    diffs = {
        name: ((first_tensor(run()).float() - reference).abs().max() / reference.abs().max()).item()
        for name, run in runs.items()
    }
    # Small batches are fast: several calls per timed block keep the clock's resolution out.
    steps = small_steps if batch == 1 else 1
    timings = measure_interleaved(
        runs, device=device, warmup=1, repeats=repeats, steps_per_repeat=steps
    )
    print(f"batch {batch}: noise band {100 * noise_band(timings):.0f}%")
    base = timings[BASELINE].median
    rows = []
    for name, timing in timings.items():
        ms = 1000 * timing.median
        rows.append(
            {
                "variant": name,
                # Both spellings: the task brief asks for batch_size/ms_median, issue 7 for
                # batch/latency_ms; they are the same numbers.
                "batch_size": batch,
                "batch": batch,
                "ms_median": ms,
                "latency_ms": ms,
                "spread": timing.spread,
                "throughput": batch / timing.median,
                "ratio": base / timing.median,
                "compile_s": first_s[name] if "compile" in name else None,
                "max_rel_diff": diffs[name],
            }
        )
    return rows


def print_results(rows: list[dict[str, Any]], unit: str) -> None:
    table = Table(title="inference (ratio = eager fp32 median / variant median, same batch)")
    for header in (
        "variant",
        "batch",
        "ratio",
        "ms (median ± IQR%)",
        unit,
        "compile s",
        "rel diff",
    ):
        table.add_column(header, justify="left" if header == "variant" else "right")
    for r in rows:
        table.add_row(
            r["variant"],
            str(r["batch_size"]),
            f"{r['ratio']:.2f}x",
            f"{r['ms_median']:.2f} ± {100 * r['spread']:.0f}%",
            f"{r['throughput']:,.0f}",
            "-" if r["compile_s"] is None else f"{r['compile_s']:.1f}",
            f"{r['max_rel_diff']:.1e}",
        )
    print_table(Console(), table)  # the terminal's width (80 columns when piped), in parts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="vision")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--large-batch", type=int, default=128, help="throughput batch (128)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile variants")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: large batch 4, 2 rounds, no compile"
    )
    args = parser.parse_args()
    large = 4 if args.quick else args.large_batch
    repeats = 2 if args.quick else args.repeats
    small_steps = 2 if args.quick else 10
    with_compile = not (args.no_compile or args.quick)

    recipe = get_workload(args.workload, num_samples=max(large, 2))
    torch.manual_seed(recipe.seed)
    model = recipe.model().eval().to(args.device)
    variants = build_variants(model, args.device, with_compile)
    rows: list[dict[str, Any]] = []
    for batch in (1, large):
        # The model's own inputs, as the recipe's loss function passes them (any input format).
        # The hook stops before forward runs, so CPU batches are fine for a model on the device.
        inputs = to_device(capture_model_inputs(model, recipe, batch), args.device)
        rows += measure_batch(variants, inputs, batch, args.device, repeats, small_steps)
    print_results(rows, "samples/s")
    if args.json:
        payload = {
            "benchmark": "inference",
            "command": " ".join(["python", *sys.argv]),
            "workload": args.workload,
            "device": args.device,
            "torch": torch.__version__,
            "machine": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
            "results": rows,
        }
        write_results(args.json, payload)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
