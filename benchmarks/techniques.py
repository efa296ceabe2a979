"""Each technique alone, and the fast combination, against fp32 eager on one workload.

All variants train fresh copies of the same model (same initial weights, same batches) and are
timed interleaved in one process, so the ratios hold even on a noisy shared machine. Compile
variants pay their compile time in the first step, reported apart ("first step s").

    python benchmarks/techniques.py --workload vision --json out.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from torchturbo.config import TurboConfig
from torchturbo.output.results_file import write_results
from torchturbo.output.tables import print_rows
from torchturbo.trials.variants import compare_configs
from torchturbo.workloads import WORKLOADS, get_workload


def variants(device: str, with_compile: bool) -> dict[str, TurboConfig]:
    base = TurboConfig(device=device)
    fast = base.replace(precision__dtype="bf16", memory_format__channels_last=True)
    configs = {
        "baseline": base,
        "tf32": base.replace(precision__dtype="tf32"),
        "bf16": base.replace(precision__dtype="bf16"),
        "channels_last": base.replace(memory_format__channels_last=True),
        "checkpointing": base.replace(checkpointing__mode="full"),
        "fast (bf16+channels_last)": fast,
    }
    if device != "cpu":
        configs["fp16+scaler"] = base.replace(precision__dtype="fp16")
        configs["cudnn_benchmark"] = base.replace(backend__cudnn_benchmark=True)
    if with_compile:
        configs["compile"] = base.replace(compile__mode="default")
        configs["fast+compile"] = fast.replace(compile__mode="default")
    return configs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="vision")
    parser.add_argument("--device", default="cpu" if not torch.cuda.is_available() else "cuda")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved rounds (default 7)")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile variants")
    parser.add_argument("--quick", action="store_true", help="tiny run for smoke tests")
    args = parser.parse_args()

    overrides = {"batch_size": 8, "num_samples": 64} if args.quick else {}
    recipe = get_workload(args.workload, **overrides)
    configs = variants(args.device, with_compile=not (args.no_compile or args.quick))
    rows = compare_configs(
        recipe,
        configs,
        baseline="baseline",
        warmup=1 if args.quick else 2,
        repeats=2 if args.quick else args.repeats,
        steps_per_repeat=1 if args.quick else 3,
        on_progress=lambda message: print(f"  {message}", file=sys.stderr),
    )
    print_rows(f"techniques on {recipe.name} ({args.device}, torch {torch.__version__})", rows)
    if args.json:
        payload = {
            "workload": recipe.name,
            "device": args.device,
            "torch": torch.__version__,
            "results": [row.to_dict() for row in rows],
        }
        write_results(args.json, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
