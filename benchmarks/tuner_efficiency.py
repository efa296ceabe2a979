"""Is the tuner's pick as good as an exhaustive grid over the same knobs, for much less time?

Runs ``tune`` on a workload with its precision, memory-format and compile stages, then measures
the full grid of those knobs (precision x channels_last x compile) side by side in one
interleaved run. The tuner's pick is read from that same grid run, so both throughputs come from
one measurement; the times are wall-clock seconds of each search, compile included.

    python benchmarks/tuner_efficiency.py --workload vision --json out.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

from torchturbo.bench import compare_configs
from torchturbo.config import TurboConfig
from torchturbo.results import write_results
from torchturbo.tune.search import TuneOptions, tune
from torchturbo.tune.stages import STAGES
from torchturbo.workloads import WORKLOADS, get_workload

KNOB_STAGES = ("precision", "memory_format", "compile")


def grid(device: str, with_compile: bool) -> dict[str, TurboConfig]:
    """Every combination of the knobs the tuner's stages vary."""
    base = TurboConfig(device=device)
    precisions = ("fp32", "tf32", "bf16", "fp16")
    layouts = (False, True)
    compiles = ("off", "default") if with_compile else ("off",)
    configs = {}
    for dtype, channels_last, mode in itertools.product(precisions, layouts, compiles):
        name = f"{dtype}{'+cl' if channels_last else ''}{'+compile' if mode != 'off' else ''}"
        configs[name] = base.replace(
            precision__dtype=dtype,
            memory_format__channels_last=channels_last,
            compile__mode=mode,
        )
    return configs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="vision")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--no-compile", action="store_true", help="leave compile out of both")
    parser.add_argument("--quick", action="store_true", help="tiny run for smoke tests")
    args = parser.parse_args()

    with_compile = not (args.no_compile or args.quick)
    # Every compiled variant of the grid is the same model class, so all share one Dynamo cache
    # entry per code object; past the default of 8 recompiles Dynamo silently runs eager, which
    # would make the grid's later compile rows lie. The documented knob raises that limit.
    torch._dynamo.config.recompile_limit = 64
    overrides = {"batch_size": 8, "num_samples": 64} if args.quick else {}
    recipe = get_workload(args.workload, **overrides)
    stages = {name: STAGES[name] for name in KNOB_STAGES if with_compile or name != "compile"}
    options = TuneOptions(time_budget_s=60 if args.quick else 600, device=args.device)

    started = time.perf_counter()
    chosen, _ = tune(recipe, options, stages=stages)
    tuner_seconds = time.perf_counter() - started
    print(f"tuner: {tuner_seconds:.0f} s", file=sys.stderr)

    configs = grid(args.device, with_compile)
    started = time.perf_counter()
    rows = compare_configs(
        recipe,
        configs,
        baseline="fp32",
        repeats=2 if args.quick else 5,
        steps_per_repeat=1 if args.quick else 2,
    )
    grid_seconds = time.perf_counter() - started
    throughput = {row.variant: row.throughput for row in rows}
    pick = next(name for name, config in configs.items() if _same_knobs(config, chosen))
    best = max(throughput, key=throughput.get)
    result = {
        "workload": recipe.name,
        "device": args.device,
        "torch": torch.__version__,
        "tuner_pick": pick,
        "grid_best": best,
        "tuner_throughput": throughput[pick],
        "grid_best_throughput": throughput[best],
        "pick_over_best": throughput[pick] / throughput[best],
        "tuner_seconds": tuner_seconds,
        "grid_seconds": grid_seconds,
        "time_fraction": tuner_seconds / grid_seconds,
        "grid": {row.variant: row.ratio for row in rows},
    }
    print(json.dumps(result, indent=2))
    if args.json:
        write_results(args.json, result)
    return 0


def _same_knobs(a: TurboConfig, b: TurboConfig) -> bool:
    return (
        a.precision.dtype == b.precision.dtype
        and a.memory_format.channels_last == b.memory_format.channels_last
        and a.compile.mode == b.compile.mode
    )


if __name__ == "__main__":
    raise SystemExit(main())
