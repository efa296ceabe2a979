"""``torchturbo tune``: the tuner (:mod:`torchturbo.tune`) on a workload or recipe, and its
report."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from torchturbo.cli.arguments import add_target_arguments, count, fraction
from torchturbo.cli.shared import check_writable, live_on_rank_zero, load_target, say_emulated
from torchturbo.output.units import parse_duration, parse_size

#: The folder beside turbo.toml that holds what tuning compiled (see techniques/compile.py).
COMPILE_CACHE = "compile-cache"
#: The run's record so far in --out (``tune.report.write.PROGRESS``, named here without
#: importing torch).
PROGRESS = "progress.json"


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
            "what it cannot measure in time is reported with the time it needs. Writes "
            "turbo.toml, results.json, report.md and report.html to --out, replacing a previous "
            "report there all at once; one tune per --out at a time. Every decided row is kept "
            "in --out/progress.json as it is decided: SIGTERM, SIGUSR1, SIGUSR2 or Ctrl-C stops "
            "at once, writes the report of what was measured and exits 75, and tuning again "
            "into the same --out reuses what was measured there (also after a kill). Under "
            "torchrun every rank measures DDP/FSDP trials, rank 0 decides (its decisions are "
            "broadcast), DDP comm hooks and bucket sizes are tuned too, and rank 0 writes. "
            "Exit status: 0 tuned; 75 stopped by a signal, what was measured kept; 2 a problem "
            "with the input, printed in one line."
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


#: Room the report needs in --out (results, reports, four plots, the trainer settings: about
#: 2 MiB measured), with a margin; a compile cache needs more, and only warns.
REPORT_ROOM = 16 * 2**20
COMPILE_CACHE_ROOM = 1024 * 2**20
#: How --out is named when another tune holds it (``resume.lock.Owner``).
TUNE_OUT = ("tune --out", "two tunes writing one folder would mix their reports")


def check_room(out: Path, compiles: bool) -> str:
    """Fail before the search when --out has no room for the report; a warning ("" if none)
    when a compile stage may fill it with its cache."""
    from torchturbo.resume.files import format_bytes, free_space

    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    free = free_space(existing)
    if free < REPORT_ROOM:
        raise ValueError(
            f"--out {str(out)!r} has {format_bytes(free)} free, and the report needs about "
            f"{format_bytes(REPORT_ROOM)}: free some space or give another directory"
        )
    if compiles and free < COMPILE_CACHE_ROOM:
        return (
            f"--out {str(out)!r} has {format_bytes(free)} free: the compile stage's cache "
            f"(kept in {COMPILE_CACHE}) may need more; --skip compile leaves it out"
        )
    return ""


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
    from torchturbo.reliability.preemption import EXIT_STOPPED, StopNow, raise_on_stop_signals

    # From here on: importing torch and loading the recipe take seconds, and a signal then
    # must stop the run as cleanly as one during the search.
    try:
        with raise_on_stop_signals():
            stopped = _tune_command(args)
    except StopNow as stop:  # before the baseline was measured, or a second signal
        progress = args.out / PROGRESS
        kept = (
            f"the rows decided are kept in {progress}, and the same command goes on from there"
            if progress.exists()
            else "nothing was decided"
        )
        if os.environ.get("RANK", "0") == "0":  # the group may be gone: torchrun's variable
            print(f"{stop.signal_name}: stopped at once; {kept}", file=sys.stderr)
        return EXIT_STOPPED
    return EXIT_STOPPED if stopped else 0


def _tune_command(args: argparse.Namespace) -> bool:
    """Tune and write the report; whether a stop signal cut the search short."""
    from rich.console import Console
    from rich.text import Text

    from torchturbo.distributed import is_main_process, launched
    from torchturbo.engine import resolve_device
    from torchturbo.measure.footprint import MemoryEstimate, describe
    from torchturbo.output.live import TuneLine
    from torchturbo.resume.lock import Owner, hold_directory
    from torchturbo.tune.report.write import finish_replacement, read_previous
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
    # A misspelt stage is refused before anything runs.
    selected = select_stages(tuner_stages(), options)
    if options.find_batch is not None:  # a budget to fit, before anything runs
        batch_budget(options.memory_budget, resolve_device(args.device or "auto"))
    check_writable(args.out)
    console = Console()  # the terminal's width; 80 columns when piped

    def say(text: str) -> None:
        console.print(Text(text), soft_wrap=True)

    if room := check_room(args.out, "compile" in selected):
        say(f"warning: {room}")
    recipe = load_target(args)
    say_emulated(
        args.device or "auto",
        PRECISION_FORMATS,
        lambda notice: console.print(notice, markup=False, highlight=False, soft_wrap=True),
    )
    line = TuneLine(f"tune {recipe.name}", options.time_budget_s)

    def print_estimate(estimate: MemoryEstimate) -> None:
        if is_main_process():
            for text in describe(estimate):
                say(text)

    fresh = not args.out.exists()
    # The lock after the launch: only then does each process know its rank.
    with launched(args.device or "auto"), contextlib.ExitStack() as owned:
        if is_main_process():  # rank 0 writes, so rank 0 owns --out
            args.out.mkdir(parents=True, exist_ok=True)
            owned.enter_context(_nothing_left_on_failure(args.out, fresh))
            owned.enter_context(hold_directory(args.out, Owner(*TUNE_OUT)))
            finish_replacement(args.out)
        record = _progress_keeper(args.out, say) if is_main_process() else None
        stop: str | None = None
        try:
            with live_on_rank_zero(line):
                config, result = tune(
                    recipe,
                    options,
                    on_progress=line.report,
                    previous=read_previous(args.out),
                    on_estimate=print_estimate,
                    on_record=record,
                )
        except TuneInterrupted as interrupted:
            config, result, stop = interrupted.config, interrupted.result, interrupted.why
        if is_main_process():
            _report(args, console, config, result, stop)
    return stop is not None


def _progress_keeper(out: Path, say: Callable[[str], None]) -> Callable[[dict[str, Any]], None]:
    """``tune``'s ``on_record``: progress.json rewritten after every decided row. A write that
    fails (a full disk) is said once and the search goes on: its rows are printed at the end."""
    from torchturbo.tune.report.write import keep_progress

    failed: list[OSError] = []

    def record(partial: dict[str, Any]) -> None:
        try:
            keep_progress(out, partial)
        except OSError as err:
            if not failed:
                say(
                    f"warning: the search's progress could not be kept in {str(out)!r} "
                    f"({err.strerror or err}); it goes on, and prints its results at the end"
                )
            failed.append(err)

    return record


def _report(
    args: argparse.Namespace, console: Any, config: Any, result: Any, stop: str | None
) -> None:
    """Print what was measured, then write the report: a report that cannot be written (a full
    disk) loses nothing printed, and says so."""
    from rich.text import Text

    from torchturbo.output.table_fit import print_table
    from torchturbo.tune.report.plots import plots_left_out
    from torchturbo.tune.report.summary import batch_line, headline
    from torchturbo.tune.report.write import incremental_table, write_report

    def say(text: str) -> None:
        console.print(Text(text), soft_wrap=True)

    results = result.to_dict()
    # The report's "how to use" line repeats what the user typed to name the target.
    results["recipe"] = args.recipe or f"--workload {result.recipe}"
    if config.compile.cache_dir:  # relative to turbo.toml, which sits beside it
        config = config.replace(compile__cache_dir=COMPILE_CACHE)
    if result.reuse_note:
        say(result.reuse_note)
    print_table(console, incremental_table(results))
    if (accuracy := estimate_accuracy(results.get("memory_estimate") or {})) is not None:
        say(accuracy)
    say(headline(results))
    if chosen := batch_line(results):
        say(chosen)
    try:
        paths = write_report(args.out, results, config.to_toml())
    except OSError as err:
        raise OSError(
            err.errno,
            f"the report could not be written ({err.strerror}); what was measured is printed above",
            err.filename,
        ) from err
    if (left_out := plots_left_out()) is not None:
        say(f"plots left out of the report: {left_out}")
    say(f"report: {paths['html']}")
    if stop is not None:
        decided = sum(c.verdict in ("adopted", "rejected") for c in result.candidates)
        say(
            f"{stop}: {decided} decided candidate(s) kept in {paths['results']} and the "
            "report; the same command goes on from there"
        )
    say(f"use it: torchturbo bench {results['recipe']} --config {paths['config']}")
