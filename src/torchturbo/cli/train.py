"""``torchturbo train``: a checkpointed training run (:mod:`torchturbo.runs.train`), stopped
cleanly by a signal, with its progress line and loggers.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from torchturbo.cli.arguments import (
    DEFAULT_PRESETS,
    LOGGERS,
    add_config_arguments,
    add_target_arguments,
    count,
)
from torchturbo.cli.shared import chosen_config, load_target
from torchturbo.output.suggest import did_you_mean
from torchturbo.output.units import parse_size

#: Seconds between plain progress lines of ``train`` when its output is not a terminal.
PROGRESS_EVERY_S = 30.0


def add_parser(commands: Any) -> None:
    """Add ``torchturbo train`` to the parser's ``commands``."""
    train = commands.add_parser(
        "train",
        help="train a recipe with a config, checkpointing atomically; --resume continues exactly",
        description=(
            "Train for --steps optimizer steps with the given config, saving an atomic, "
            "checksummed checkpoint every --save-every steps to --checkpoint-dir. --resume "
            "continues from the newest valid checkpoint there (falling back to the previous one "
            "if the newest is corrupt) and reproduces the uninterrupted run bit for bit. Under "
            "`torchrun --nproc-per-node N -m torchturbo train ...` every rank trains its share "
            "of the data as DDP or FSDP per [distributed]; rank 0 writes and prints. "
            "Preemption: with --checkpoint-dir, SIGTERM, SIGUSR1, SIGUSR2 or Ctrl-C finishes "
            "the optimizer step under way (every rank the same one) and saves it; a second "
            "signal, or [reliability] stop_grace_s running out, stops at once and keeps the "
            "checkpoints already saved. Exit status: 0 trained to --steps; 75 stopped by a "
            "signal after saving (run again with --resume); 128+N stopped at once by signal N; "
            "2 a problem with the input, printed in one line."
        ),
    )
    add_target_arguments(train)
    add_config_arguments(train, default_preset=DEFAULT_PRESETS["train"])
    train.add_argument(
        "--steps",
        type=count(1, what="optimizer steps"),
        required=True,
        metavar="N",
        help="optimizer steps to train",
    )
    train.add_argument(
        "--checkpoint-dir",
        type=Path,
        metavar="DIR",
        help="where checkpoints go, checked writable with room for one before the first step "
        "and owned by this run (a second run on it is refused); with it, SIGTERM, SIGUSR1, "
        "SIGUSR2 or Ctrl-C finishes the step under way, saves it and exits with status 75 (a "
        "second signal, 2 s or more later, stops at once)",
    )
    train.add_argument(
        "--save-every",
        type=count(0, what="steps between checkpoints, 0: at the end only"),
        default=0,
        metavar="N",
        help="steps between checkpoints; 0 saves at the end only",
    )
    train.add_argument("--resume", action="store_true", help="continue from --checkpoint-dir")
    train.add_argument(
        "--next-epoch",
        action="store_true",
        help="with --resume: start the epoch after the checkpoint's instead of continuing it "
        "(a resume mid-epoch onto changed data, or another [data] batches, is refused: the "
        "checkpoint's position counts in the data it was saved with)",
    )
    train.add_argument(
        "--activation-budget",
        type=parse_size,
        metavar="SIZE",
        help="bytes of activations one micro-batch may hold (e.g. 64MiB); above it the batch is "
        "split into smaller micro-batches with accumulation, and the split is reported",
    )
    train.add_argument(
        "--log-dir",
        type=Path,
        help="write each optimizer step's metrics (loss, throughput, MFU, memory, learning "
        "rate, skipped steps, micro-batch split) here, as TensorBoard event files and "
        "metrics.csv unless --logger says otherwise; under torchrun only rank 0 writes",
    )
    train.add_argument(
        "--logger",
        type=logger_list,
        metavar="NAME,...",
        help="where the metrics go, of tensorboard, csv (both into --log-dir), wandb (a W&B run; "
        "WANDB_MODE=offline keeps it local) and mlflow (an MLflow run in --log-dir/mlruns, or "
        "MLFLOW_TRACKING_URI's); the run's config goes along (default: tensorboard,csv with "
        "--log-dir)",
    )
    train.add_argument(
        "--tuned-out",
        type=Path,
        default=Path("tuned"),
        metavar="DIR",
        help="with --tune.in_run (tuning while training: the facts choose where the run starts, "
        "then each choice a step can switch is measured on the job's own steps and kept only "
        "where it is faster at the same loss): where results.json, with every verdict, and the "
        "decided turbo.toml go, after each decision and at the end (default: %(default)s)",
    )
    train.set_defaults(run=run)


def logger_list(text: str) -> tuple[str, ...]:
    """``wandb,csv`` as a tuple of logger names, each one torchturbo.runs.metrics_log can open."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in LOGGERS]
    if not names or unknown:
        guess = did_you_mean(unknown[0], LOGGERS) if unknown else ""
        raise argparse.ArgumentTypeError(
            f"{text!r}{guess}: give logger names separated by commas, of {', '.join(LOGGERS)}"
        )
    return names


def run(args: argparse.Namespace) -> int:
    from torchturbo.reliability.preemption import StopNow, stop_on_signals

    # From here on, not only once training runs: importing torch and building the recipe take
    # seconds, and a SIGTERM then would kill the run instead of stopping it after one step.
    # A torchrun worker whose agent dies stops (and saves) rather than train on unsupervised.
    torchrun_worker = "TORCHELASTIC_RUN_ID" in os.environ
    try:
        with stop_on_signals(args.checkpoint_dir is not None, watch_parent=torchrun_worker):
            return _train_command(args)
    except StopNow as stop:
        from torchturbo.distributed import main_print

        main_print(
            f"{stop}: stopped at once, inside a step; the checkpoints already in "
            f"{args.checkpoint_dir} are intact, --resume goes on from the newest"
        )
        return stop.exit_status


def _train_command(args: argparse.Namespace) -> int:
    from torchturbo.distributed import is_main_process, launched, main_print
    from torchturbo.reliability.preemption import EXIT_STOPPED
    from torchturbo.runs.train import TrainInterrupted, train

    if args.resume and args.checkpoint_dir is None:
        raise ValueError("--resume needs --checkpoint-dir to know where to resume from")
    if args.next_epoch and not args.resume:
        raise ValueError("--next-epoch starts the epoch after a checkpoint's: give --resume too")
    if args.save_every and args.checkpoint_dir is None:
        raise ValueError("--save-every needs --checkpoint-dir to know where to save")
    config = chosen_config(args)
    if args.activation_budget:
        config = config.replace(reliability__memory_budget_bytes=args.activation_budget)
    recipe = load_target(args)
    # Under torchrun every rank trains its share of each batch (the engine wraps the model per
    # [distributed]); rank 0 writes the checkpoints, the logs and prints.
    loggers = _train_loggers(args.log_dir, args.logger, config.to_dict())
    with (
        launched(config.device),
        loggers as logger,
        _train_progress(f"train {recipe.name}", args.steps) as on_progress,
    ):
        try:
            result = train(
                recipe,
                config,
                steps=args.steps,
                checkpoint_dir=args.checkpoint_dir,
                save_every=args.save_every,
                resume=args.resume,
                next_epoch=args.next_epoch,
                on_event=main_print,
                logger=logger,
                on_progress=on_progress,
                tuned_dir=args.tuned_out if config.tune.in_run else None,
            )
        except TrainInterrupted as stopped:
            again = "again" if args.resume else "with --resume"
            main_print(
                f"{stopped.signal_name}: stopped after optimizer step "
                f"{stopped.optimizer_steps} and saved it in {stopped.saved}; run the same "
                f"command {again} to go on from there",
                flush=True,  # a peer's exit may make torchrun end this process any moment
            )
            return EXIT_STOPPED
        if not is_main_process():
            return 0
    if result.first_step_s is not None:
        later = "" if result.later_step_s is None else f", then {result.later_step_s:.3f} s a step"
        print(f"first step {result.first_step_s:.2f} s (one-time costs included){later}")
    loss = "n/a" if result.last_loss is None else f"{result.last_loss:.4f}"
    resumed = "" if result.resumed_from is None else f"; resumed from {result.resumed_from}"
    saved = (
        f"; last checkpoint {result.saved}"
        if result.saved is not None
        else "; no checkpoint (give --checkpoint-dir to keep one)"
    )
    print(
        f"trained to optimizer step {result.optimizer_steps}, last loss {loss}"
        + (f" ({result.skipped_steps} steps skipped)" if result.skipped_steps else "")
        + ", micro-batch "
        f"split {result.micro_batch_split} (size {result.micro_batch_size})" + resumed + saved
    )
    if config.tune.in_run:
        print(f"tuned in the run: the decided turbo.toml and every verdict are in {args.tuned_out}")
    return 0


@contextlib.contextmanager
def _train_progress(title: str, steps: int) -> Iterator[Callable[[Any], None]]:
    """``train``'s ``on_progress`` on rank 0: a live line on a terminal, else a plain line
    every :data:`PROGRESS_EVERY_S` seconds, checked at each step and by a heartbeat between
    them (and nothing on other ranks)."""
    from torchturbo.distributed import is_main_process
    from torchturbo.output.live import TrainLine, live

    line = TrainLine(title, steps)
    if not is_main_process():
        yield lambda progress: None
        return
    with live(line, every_s=PROGRESS_EVERY_S) as plain:
        if plain is None:
            yield line.report
            return

        def report(progress: Any) -> None:
            line.report(progress)
            plain.tick()

        yield report


@contextlib.contextmanager
def _train_loggers(
    log_dir: Path | None, names: Sequence[str] | None, config: dict[str, Any]
) -> Iterator[Any]:
    """``train --log-dir/--logger``'s loggers (rank 0 writes, other ranks log to nothing), with
    the run's ``config``, closed at the end; None with neither option."""
    if log_dir is None and names is None:
        yield None
        return
    from torchturbo.runs.metrics_log import open_loggers

    with open_loggers(log_dir, names, config=config) as loggers:
        for note in loggers.notes:
            print(f"{'--logger' if names else '--log-dir'}: {note}")
        yield loggers
