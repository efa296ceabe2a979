"""Is the tuner's pick as good as an exhaustive grid over the same knobs, for much less time?

Runs ``tune`` on a workload with its precision, memory-format and compile stages, then measures
the full grid of those knobs (precision x channels_last x compile). Every combination whose
number format this machine computes natively is measured side by side in one interleaved run;
the tuner's pick is read from that same run, so both throughputs come from one measurement.
Combinations in a format the GEMM probe shows cannot pay off here (``measure.native``: emulated
bf16/fp16, TF32 on a CPU) get a short fixed measurement instead: one step after the first
(compiling) one, beside fp32 eager, marked as such in the JSON and never crowned the grid's best.
On a CPU that emulates bf16 at 0.02-0.5x fp32 their full measurement took most of a 15-minute
run and could only confirm they lose; a smaller batch would be quicker still, but at 2 samples
emulated bf16 read 0.95-2.8x fp32 (overhead, not arithmetic). The times are wall-clock seconds
of each search, compile included.

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

from torchturbo.config import TurboConfig
from torchturbo.measure.machine import summary
from torchturbo.measure.native import emulated, gemm_speedup
from torchturbo.output.results_file import write_results
from torchturbo.trials.variants import compare_configs
from torchturbo.tune.search.run import TuneOptions, tune
from torchturbo.tune.search.stages import tuner_stages
from torchturbo.workloads import WORKLOADS, get_workload

KNOB_STAGES = ("precision", "memory_format", "compile")
#: The job the tuner is told of: the grid compares steady-state steps (compile apart), so the
#: tuner judges a job long enough that one-time costs vanish, the same question.
PLANNED_STEPS = 1_000_000
#: The tuner's budget: the demo's 150 s and a margin. With 600 s a busy machine let it spend
#: 545 s confirming, more than the grid it is meant to save.
TUNER_BUDGET_S = 180


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
    stages = {
        name: tuner_stages()[name] for name in KNOB_STAGES if with_compile or name != "compile"
    }
    options = TuneOptions(
        time_budget_s=60 if args.quick else TUNER_BUDGET_S,
        planned_steps=PLANNED_STEPS,
        device=args.device,
    )

    started = time.perf_counter()
    chosen, tuned = tune(recipe, options, stages=stages)
    tuner_seconds = time.perf_counter() - started
    print(f"tuner: {tuner_seconds:.0f} s", file=sys.stderr)

    configs = grid(args.device, with_compile)
    formats = probe_formats(args.device)
    full, short = split_by_payoff(configs, formats)
    started = time.perf_counter()
    rows = compare_configs(
        recipe,
        full,
        baseline="fp32",
        repeats=2 if args.quick else 5,
        steps_per_repeat=1 if args.quick else 2,
    )
    full_seconds = time.perf_counter() - started
    short_rows = []
    if short:
        print(f"short measurement of {len(short)} that cannot pay off", file=sys.stderr)
        reference = {"fp32": configs["fp32"]}
        short_rows = compare_configs(
            recipe, reference | short, baseline="fp32", warmup=0, repeats=1, steps_per_repeat=1
        )
        short_rows = [row for row in short_rows if row.variant in short]
    grid_seconds = time.perf_counter() - started
    # Each row's ratio is against the fp32 eager run measured beside it, so rows of the two
    # measurements compare through that common reference.
    ratio = {row.variant: row.ratio for row in [*rows, *short_rows]}
    pick = next(name for name, config in configs.items() if _same_knobs(config, chosen))
    # The best is taken over the full measurement: one step of a short row is too noisy to
    # crown, and its format cannot pay off. A short row far above it means the probe was wrong.
    best = max((row.variant for row in rows), key=ratio.__getitem__)
    short_best = max((row.variant for row in short_rows), key=ratio.__getitem__, default=None)
    result = {
        "workload": recipe.name,
        "device": args.device,
        "torch": torch.__version__,
        "machine": summary(),
        "formats": formats,
        "tuner_pick": pick,
        "grid_best": best,
        "tuner_ratio": ratio[pick],
        "grid_best_ratio": ratio[best],
        "pick_over_best": ratio[pick] / ratio[best],
        "short_best": short_best,
        "short_beats_best": short_best is not None and ratio[short_best] > 1.1 * ratio[best],
        "tuner_seconds": tuner_seconds,
        "grid_seconds": grid_seconds,
        "grid_full_seconds": full_seconds,
        "time_fraction": tuner_seconds / grid_seconds,
        "tuner_verdicts": {o.name: f"{o.verdict}: {o.reason}" for o in tuned.candidates},
        "grid": {
            row.variant: {
                "ratio": row.ratio,
                "throughput": row.throughput,
                "measurement": (
                    "interleaved"
                    if row.variant in full
                    else "short: 1 step after the first, beside fp32 eager"
                ),
            }
            for row in [*rows, *short_rows]
        },
    }
    print(json.dumps(result, indent=2))
    if args.json:
        write_results(args.json, result)
    return 0


def probe_formats(device: str) -> dict[str, dict[str, float | str | None]]:
    """Each reduced format's GEMM rate over fp32's here, and why it is emulated (None: native)."""
    return {
        fmt: {"gemm_speedup": gemm_speedup(device, fmt), "emulated": emulated(device, fmt)}
        for fmt in ("tf32", "bf16", "fp16")
    }


def split_by_payoff(
    configs: dict[str, TurboConfig], formats: dict[str, dict[str, float | str | None]]
) -> tuple[dict[str, TurboConfig], dict[str, TurboConfig]]:
    """(combinations measured in full, those in a format that cannot pay off here)."""
    full, short = {}, {}
    for name, config in configs.items():
        dtype = config.precision.dtype
        cannot_pay = dtype != "fp32" and formats[dtype]["emulated"] is not None
        (short if cannot_pay else full)[name] = config
    return full, short


def _same_knobs(a: TurboConfig, b: TurboConfig) -> bool:
    return (
        a.precision.dtype == b.precision.dtype
        and a.memory_format.channels_last == b.memory_format.channels_last
        and a.compile.mode == b.compile.mode
    )


if __name__ == "__main__":
    raise SystemExit(main())
