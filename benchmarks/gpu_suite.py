"""Every technique on one device in one script: the figures for docs/gpu.md.

For each built-in workload, the techniques side by side against fp32 eager (interleaved, ratios,
MFU against the peak measured in the same process, memory) and a short ``tune`` on vision with
its confirmed ratio; then the benchmarks with a device path of their own, each in its own process
(``EXTRAS``: bucketed against naive text batches, device augmentation against CPU workers, the
custom op, inference), whose JSON goes into ``extras``. Writes one JSON and one markdown table.
Made for a lent CUDA GPU (budget: under 8 minutes; never run on one yet, so give the first device
call a timeout that leaves room for a second); ``--device cpu --quick`` is the dry run a test
executes so that the script cannot rot.

    python benchmarks/gpu_suite.py --device cuda --out benchmarks/results/gpu
    python benchmarks/gpu_suite.py --device cpu --quick --out /tmp/gpu-dry-run
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

from techniques import variants

from torchturbo.bench import compare_configs
from torchturbo.measure.peak import measured_peak_flops
from torchturbo.results import write_results
from torchturbo.system import summary
from torchturbo.tune.search import TuneOptions, tune
from torchturbo.workloads import WORKLOADS, get_workload

QUICK_OVERRIDES = {"batch_size": 4, "num_samples": 32}
HERE = Path(__file__).parent
#: Benchmarks run after the suite, with their device arguments ({device} is filled in).
EXTRAS = {
    "bucketing": ["--device", "{device}"],
    "augment": ["--device", "{device}"],
    "kernels": [],  # measures on the CPU and, when present, on CUDA
    "inference": ["--device", "{device}"],
}
#: Seconds one extra may take before it is stopped and recorded as failed.
EXTRA_TIMEOUT_S = 300


def run_extras(device: str, quick: bool, out: Path) -> dict[str, Any]:
    """Run each of ``EXTRAS`` in its own process; its JSON, or its error, by name."""
    extras: dict[str, Any] = {}
    for name, arguments in EXTRAS.items():
        path = out / f"{name}.json"
        command = [sys.executable, str(HERE / f"{name}.py"), "--json", str(path)]
        command += [argument.format(device=device) for argument in arguments]
        command += ["--quick"] if quick else []
        print(f"extra: {name}", file=sys.stderr)
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=EXTRA_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            extras[name] = {"error": f"stopped after {EXTRA_TIMEOUT_S} s"}
            continue
        if done.returncode != 0:
            extras[name] = {"error": done.stderr[-2000:]}
        else:
            extras[name] = json.loads(path.read_text())
    return extras


def run(device: str, quick: bool) -> dict[str, Any]:
    started = time.perf_counter()
    overrides = QUICK_OVERRIDES if quick else {}
    results: dict[str, Any] = {
        "system": summary(),
        "device": device,
        "torch": torch.__version__,
        "peak_tflops": {
            str(dtype): measured_peak_flops(device, dtype) / 1e12
            for dtype in (torch.float32, torch.bfloat16)
        },
        "workloads": {},
    }
    for name in sorted(WORKLOADS):
        recipe = get_workload(name, **overrides)
        rows = compare_configs(
            recipe,
            variants(device, with_compile=not quick),
            baseline="baseline",
            warmup=1 if quick else 3,
            repeats=2 if quick else 7,
            steps_per_repeat=1 if quick else 5,
        )
        results["workloads"][name] = [row.to_dict() for row in rows]
        print(f"{name}: done at {time.perf_counter() - started:.0f} s", file=sys.stderr)
    options = TuneOptions(time_budget_s=20 if quick else 150, device=device)
    _, tuned = tune(get_workload("vision", **overrides), options)
    results["tune_vision"] = {
        "confirmed_ratio": tuned.confirmation.ratio,
        "confirmation": tuned.confirmation.state,
        "adopted": list(tuned.adopted),
        "unit": tuned.unit,
    }
    results["elapsed_s"] = time.perf_counter() - started
    return results


def markdown(results: dict[str, Any]) -> str:
    lines = [
        f"Device: {results['system']['device']}, torch {results['torch']}, "
        f"{results['elapsed_s']:.0f} s in all.",
        "",
        "| workload | variant | ratio | step ms | MFU | step memory | activations |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for workload, rows in results["workloads"].items():
        for row in rows:
            mfu = "n/a" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%"
            memory = row["peak_memory_bytes"]
            activations = row["activation_bytes"]
            lines.append(
                f"| {workload} | {row['variant']} | {row['ratio']:.2f}x | "
                f"{row['step_ms_median']:.1f} | {mfu} | "
                f"{'n/a' if memory is None else f'{memory / 2**20:.0f} MiB'} | "
                f"{'n/a' if activations is None else f'{activations / 2**20:.0f} MiB'} |"
            )
    tuned = results["tune_vision"]
    lines += [
        "",
        f"`torchturbo tune` on vision: confirmed {tuned['confirmed_ratio']:.2f}x over fp32 "
        f"eager ({tuned['unit']}), adopting {', '.join(tuned['adopted']) or 'nothing'}.",
        "",
    ]
    for name, extra in results.get("extras", {}).items():
        state = f"failed: {extra['error'].strip().splitlines()[-1]}" if "error" in extra else "ok"
        lines.append(f"- `benchmarks/{name}.py`: {state} ({name}.json)")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, required=True, help="directory for JSON + markdown")
    parser.add_argument("--quick", action="store_true", help="dry run: tiny sizes, no compile")
    args = parser.parse_args()
    results = run(args.device, args.quick)
    args.out.mkdir(parents=True, exist_ok=True)
    results["extras"] = run_extras(args.device, args.quick, args.out)
    write_results(args.out / "gpu_suite.json", results)
    table = markdown(results)
    (args.out / "gpu_suite.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
