"""``torchturbo tune``: the tuner (:mod:`torchturbo.tune`) on a workload or recipe, and its
report."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torchturbo.cli.arguments import add_target_arguments, count, fraction
from torchturbo.cli.shared import check_writable, live_on_rank_zero, load_target, say_emulated
from torchturbo.output.units import parse_duration, parse_size

#: The folder beside turbo.toml that holds what tuning compiled (see techniques/compile.py).
COMPILE_CACHE = "compile-cache"


def add_parser(commands: Any) -> None:
    """Add ``torchturbo tune`` to the parser's ``commands``."""
    tune = commands.add_parser(
        "tune",
        help="find the fastest correct config for a workload or recipe, with a report",
        description=(
            "Measure the candidates of every stage (data loader, precision, memory format, "
            "compile, memory, dynamic batching), the highest expected gain per second of "
            "measuring first, each against the current best in paired rounds on the same "
            "batches until the ratio is decided, and keep one only if it is faster beyond the "
            "noise, keeps the loss within tolerance of fp32, fits the memory budget and makes the "
            "whole planned job faster, one-time costs such as compiling included (the job's "
            "length: --planned-steps, else the recipe's, else assumed; the headline says "
            "which). What it compiles is kept in --out/compile-cache, which the written "
            "turbo.toml names so that train loads it. The whole run keeps to --time-budget; "
            "what it cannot measure in time is reported with the time it needs. Tuning again "
            "into the same --out reuses what was measured there, also after Ctrl-C (kept in "
            "interrupted.json). Writes turbo.toml, "
            "results.json, report.md and report.html to --out. Under "
            "torchrun every rank measures DDP/FSDP trials, rank 0 decides (its decisions are "
            "broadcast), DDP comm hooks and bucket sizes are tuned too, and rank 0 writes."
        ),
    )
    add_target_arguments(tune)
    tune.add_argument(
        "--time-budget",
        type=parse_duration,
        default="5m",
        metavar="DURATION",
        help="wall time for the search, e.g. 90s, 5m, 1h",
    )
    tune.add_argument(
        "--memory-budget",
        type=parse_size,
        metavar="SIZE",
        help=(
            "total memory a step may use, e.g. 20GiB, 512MiB (default: no budget). Over it, "
            "the tuner plans: blocks to checkpoint, micro-batches that keep the global batch, "
            "bf16 activations (compile's own activation budget once compile is adopted), and "
            "a smaller optimizer state (bf16, 8-bit or 4-bit moments of Adam/AdamW) where "
            "nothing else should fit; it "
            "measures every plan that should fit and races them head to head for the fastest "
            "(docs/memory_planning.md)"
        ),
    )
    tune.add_argument(
        "--find-batch",
        nargs="?",
        const="keep",
        choices=("keep", "max"),
        default=None,
        metavar="keep|max",
        help=(
            "before tuning, find the largest micro-batch whose step fits --memory-budget (on a "
            "GPU, without one: 90%% of its memory), measured at a few sizes (every rank under "
            "torchrun; the smallest fit wins). "
            "keep (the default): keep the global batch (batch x processes): each batch runs "
            "as N micro-batches accumulated exactly ([accumulation] micro_batches = N in "
            "turbo.toml); max: when the recipe's batch fits, the largest batch that fits "
            "instead (up to 16x): the global batch grows, and the learning-rate rule for it "
            "is reported, not applied"
        ),
    )
    tune.add_argument(
        "--planned-steps",
        type=count(1, what="steps of your real job"),
        default=None,
        metavar="N",
        help=(
            "steps (batches per process) of your real job: a candidate is kept only if the "
            "whole job, one-time costs such as compiling included, is faster with it "
            "(default: the recipe's planned_steps, which recipe_from_trainer and "
            "recipe_from_lightning take from the trainer; else 1,000, assumed)"
        ),
    )
    tune.add_argument(
        "--loss-tolerance",
        type=fraction,
        default=0.05,
        metavar="FRACTION",
        help="largest relative loss difference from fp32 over the first steps",
    )
    tune.add_argument(
        "--out", type=Path, default=Path("turbo-report"), metavar="DIR", help="output directory"
    )
    tune.add_argument(
        "--only", type=stage_list, default=(), metavar="STAGE,...", help="run only these stages"
    )
    tune.add_argument(
        "--skip", type=stage_list, default=(), metavar="STAGE,...", help="leave these stages out"
    )
    tune.set_defaults(run=run)


def stage_list(text: str) -> tuple[str, ...]:
    """``precision,compile`` as a tuple of stage names (checked against the stages by the tuner)."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r}: give stage names separated by commas")
    return names


def estimate_accuracy(record: dict[str, Any]) -> str | None:
    """How far the memory estimate made before launch was from the measured baseline step."""
    if record.get("error_reason"):
        return f"memory estimate: not made ({record['error_reason']})"
    measured, error = record.get("measured_bytes"), record.get("error")
    if not measured or error is None:
        return None
    return (
        f"memory: {record['total_bytes'] / 2**20:.1f} MiB estimated before launch, "
        f"{measured / 2**20:.1f} MiB measured ({error:+.1%})"
    )


@contextlib.contextmanager
def _nothing_left_on_failure(out: Path, fresh: bool) -> Iterator[None]:
    """A run that fails leaves no empty folders behind: the compile cache the tuner pointed
    inductor at before anything compiled, and ``out`` itself when this run made it."""
    try:
        yield
    except BaseException:
        for folder in (out / COMPILE_CACHE, *((out,) if fresh else ())):
            with contextlib.suppress(OSError):  # not empty, or gone: leave it
                folder.rmdir()
        raise


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.text import Text

    from torchturbo.distributed import is_main_process, launched
    from torchturbo.engine import resolve_device
    from torchturbo.measure.footprint import MemoryEstimate, describe
    from torchturbo.output.live import TuneLine
    from torchturbo.output.table_fit import print_table
    from torchturbo.tune.report.plots import plots_left_out
    from torchturbo.tune.report.summary import batch_line, headline
    from torchturbo.tune.report.write import (
        incremental_table,
        keep_interrupted,
        read_previous,
        write_report,
    )
    from torchturbo.tune.search.run import (
        TuneInterrupted,
        TuneOptions,
        batch_budget,
        select_stages,
        tune,
    )
    from torchturbo.tune.search.stages import PRECISION_FORMATS, tuner_stages

    options = TuneOptions(
        time_budget_s=args.time_budget,
        memory_budget=args.memory_budget,
        planned_steps=args.planned_steps,
        loss_tolerance=args.loss_tolerance,
        device=args.device,
        only=args.only,
        skip=args.skip,
        compile_cache_dir=str(args.out / COMPILE_CACHE),
        find_batch=args.find_batch,
        refuse_impossible=True,
    )
    select_stages(tuner_stages(), options)  # a misspelt stage is refused before anything runs
    if options.find_batch is not None:  # a budget to fit, before anything runs
        batch_budget(options.memory_budget, resolve_device(args.device or "auto"))
    check_writable(args.out)
    previous = read_previous(args.out)
    recipe = load_target(args)
    console = Console()  # the terminal's width; 80 columns when piped
    say_emulated(
        args.device or "auto",
        PRECISION_FORMATS,
        lambda notice: console.print(notice, markup=False, highlight=False, soft_wrap=True),
    )
    line = TuneLine(f"tune {recipe.name}", options.time_budget_s)

    def print_estimate(estimate: MemoryEstimate) -> None:
        if is_main_process():
            for text in describe(estimate):
                console.print(Text(text), soft_wrap=True)

    fresh = not args.out.exists()
    with launched(args.device or "auto"), _nothing_left_on_failure(args.out, fresh):
        try:
            with live_on_rank_zero(line):
                config, result = tune(
                    recipe,
                    options,
                    on_progress=line.report,
                    previous=previous,
                    on_estimate=print_estimate,
                )
        except TuneInterrupted as interrupted:
            if is_main_process() and interrupted.measured:
                kept = keep_interrupted(args.out, interrupted.partial)
                console.print(
                    Text(
                        f"interrupted: {interrupted.measured} measured candidate(s) kept in "
                        f"{kept}; the same command measures the rest"
                    ),
                    soft_wrap=True,
                )
            raise
        if not is_main_process():
            return 0
    results = result.to_dict()
    # The report's "how to use" line repeats what the user typed to name the target.
    results["recipe"] = args.recipe or f"--workload {recipe.name}"
    if config.compile.cache_dir:  # relative to turbo.toml, which sits beside it
        config = config.replace(compile__cache_dir=COMPILE_CACHE)
    paths = write_report(args.out, results, config.to_toml())
    if result.reuse_note:
        console.print(Text(result.reuse_note), soft_wrap=True)
    if (left_out := plots_left_out()) is not None:
        console.print(Text(f"plots left out of the report: {left_out}"), soft_wrap=True)
    print_table(console, incremental_table(results))
    if (accuracy := estimate_accuracy(results.get("memory_estimate") or {})) is not None:
        console.print(Text(accuracy), soft_wrap=True)
    console.print(Text(headline(results)), soft_wrap=True)
    if chosen := batch_line(results):
        console.print(Text(chosen), soft_wrap=True)
    console.print(Text(f"report: {paths['html']}"), soft_wrap=True)
    console.print(
        Text(f"use it: torchturbo bench {results['recipe']} --config {paths['config']}"),
        soft_wrap=True,
    )
    return 0
