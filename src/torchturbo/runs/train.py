"""A checkpointed training run of a recipe: what ``torchturbo train`` runs.

It trains for a number of optimizer steps with the engine, saves a checkpoint every ``save_every``
steps and at the end, resumes from the newest valid checkpoint when asked, and reports the
micro-batch the run settled on when out-of-memory (or the activation budget) made the engine split
batches. The loop is the one ``docs/reliability.md`` shows, so that a resumed run continues
bit-identically. With a ``logger`` (``metrics_log``), every optimizer step's loss, throughput, MFU,
memory, learning rate, skipped steps and micro-batch split are logged (``step_meter``). With a
checkpoint directory, a stop signal (SIGTERM, SIGUSR1, SIGUSR2, Ctrl-C:
``torchturbo.reliability.preemption``) finishes the optimizer step under way, on every rank the same
one, and saves it before stopping (:class:`TrainInterrupted`); a second signal stops at once.
Before the first step, the checkpoint directory is proven writable, with room for a checkpoint of
this run, and locked for it (``resume.directory``, ``resume.lock``): a second run on it is
refused, naming the first.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from torchturbo.config import INT64_MAX, ConfigError, TurboConfig
from torchturbo.data.collate import SampleDtypeError
from torchturbo.data.length import length_or_none
from torchturbo.distributed.launch import current_env, init_distributed
from torchturbo.engine import Turbo
from torchturbo.engine.loader import recipe_data
from torchturbo.measure.timing import sync
from torchturbo.recipe import Recipe
from torchturbo.reliability.oom import leading_size
from torchturbo.reliability.preemption import StopRequest, stop_on_signals
from torchturbo.resume.checks import check_steps
from torchturbo.resume.directory import estimate_state_bytes, prepare_directory, room_problem
from torchturbo.resume.files import CheckpointError, checkpoint_name
from torchturbo.resume.lock import hold_directory
from torchturbo.runs.metrics_log import AnyLogger
from torchturbo.runs.step_meter import recipe_meter


@dataclass(frozen=True)
class TrainResult:
    """How a run ended."""

    optimizer_steps: int
    #: Mean loss of the last batch trained (None when no step was left to train).
    last_loss: float | None
    #: Optimizer steps skipped, over the whole run: non-finite (the guard) or fp16 overflow.
    skipped_steps: int
    #: The checkpoint the run resumed from, and the last one it wrote.
    resumed_from: Path | None
    saved: Path | None
    #: Pieces per batch and samples in the largest piece after out-of-memory splits.
    micro_batch_split: int
    micro_batch_size: int | None
    events: tuple[str, ...]
    #: Seconds of the first step (compiling included: what a compile cache saves) and of the
    #: steps after it, per step; None when no step ran (or only one, for the latter).
    first_step_s: float | None = None
    later_step_s: float | None = None


class TrainInterrupted(KeyboardInterrupt):
    """A stop signal (SIGTERM, SIGUSR1, SIGUSR2 or Ctrl-C) stopped :func:`train` between
    optimizer steps, after saving checkpoint ``saved`` at step ``optimizer_steps``:
    ``resume=True`` continues from it exactly. A KeyboardInterrupt, so that code written for
    Ctrl-C stops on it too."""

    def __init__(self, saved: Path | None, optimizer_steps: int, signal_name: str) -> None:
        where = "nothing new to save" if saved is None else f"saved {saved}"
        super().__init__(f"{signal_name}: stopped after optimizer step {optimizer_steps}, {where}")
        self.saved = saved
        self.optimizer_steps = optimizer_steps
        self.signal_name = signal_name


@dataclass(frozen=True)
class TrainProgress:
    """What :func:`train` reports after each optimizer step (``on_progress``)."""

    optimizer_steps: int
    steps: int
    loss: float
    #: Samples (leading batch size) trained by this run so far, all ranks together.
    samples: int
    #: The last checkpoint written or resumed from (None before the first).
    checkpoint: Path | None


def train(
    recipe: Recipe,
    config: TurboConfig,
    *,
    steps: int,
    checkpoint_dir: str | Path | None = None,
    save_every: int = 0,
    resume: bool = False,
    next_epoch: bool = False,
    on_event: Callable[[str], None] | None = None,
    logger: AnyLogger | None = None,
    on_progress: Callable[[TrainProgress], None] | None = None,
    tuned_dir: str | Path | None = None,
) -> TrainResult:
    """Train ``recipe`` for ``steps`` optimizer steps (counted across resumes).

    ``save_every`` > 0 saves every that many optimizer steps into ``checkpoint_dir``, which is
    also saved at the end; ``resume`` continues from its newest valid checkpoint, whose step must
    not exceed ``steps``; ``next_epoch`` (with ``resume``) starts the epoch after the checkpoint's
    instead of continuing it, as a resume onto changed data or another batch plan must (a
    mid-epoch resume onto them is refused). A run that ends on skipped non-finite steps raises
    :class:`~torchturbo.reliability.guard.NonFiniteError` instead of returning, and saves nothing.
    ``logger`` receives each optimizer step's metrics (under torchrun, pass it on every rank: the
    meter all-reduces the counts; ``metrics_log.open_loggers`` gives rank 0 the only writers).
    ``on_event`` receives the micro-batcher's events and how the loader resumed;
    ``on_progress`` a :class:`TrainProgress` after each optimizer step.

    With ``[tune] in_run`` the run tunes while it trains (``engine/in_run.py``): ``on_event``
    receives what it started with, measures and decides, and ``tuned_dir`` gets ``results.json``
    and the decided ``turbo.toml`` after each decision and at the end (rank 0 writes).

    With ``checkpoint_dir``, a stop signal (``torchturbo.reliability.preemption``: SIGTERM, SIGUSR1,
    SIGUSR2, Ctrl-C) finishes the optimizer step under way, saves it and raises
    :class:`TrainInterrupted`; under torchrun the ranks agree on that step. A second signal, or
    ``[reliability] stop_grace_s`` running out, raises
    :class:`~torchturbo.reliability.preemption.StopNow`.
    """
    _check_arguments(steps, save_every, checkpoint_dir, resume)
    if next_epoch and not resume:
        raise ValueError("next_epoch starts the epoch after a checkpoint's: it needs resume=True")
    graceful = checkpoint_dir is not None
    with (
        stop_on_signals(graceful, grace_s=config.reliability.stop_grace_s) as stop,
        _owned_directory(checkpoint_dir, resume=resume, device=config.device),
    ):
        return _train(
            recipe,
            config,
            stop,
            steps=steps,
            checkpoint_dir=checkpoint_dir,
            save_every=save_every,
            resume=resume,
            next_epoch=next_epoch,
            on_event=on_event or (lambda event: None),
            logger=logger,
            on_progress=on_progress,
            tuned_dir=tuned_dir,
        )


def _train(
    recipe: Recipe,
    config: TurboConfig,
    stop: StopRequest,
    *,
    steps: int,
    checkpoint_dir: str | Path | None,
    save_every: int,
    resume: bool,
    next_epoch: bool,
    on_event: Callable[[str], None],
    logger: AnyLogger | None,
    on_progress: Callable[[TrainProgress], None] | None,
    tuned_dir: str | Path | None,
) -> TrainResult:
    turbo = Turbo(config)
    model, optimizer = recipe.build()
    model, _, loader = turbo.setup(
        model,
        optimizer,
        recipe.dataset,
        **recipe_data(recipe),
        planned_steps=steps,
        loss_fn=recipe.loss_fn,
    )
    tuning = _InRunNews(turbo, on_event, tuned_dir)
    # Given a dataset, setup builds the loader; it always builds the micro-batcher.
    assert loader is not None and turbo.microbatcher is not None
    microbatcher = turbo.microbatcher
    world_size = current_env().world_size
    try:  # from here on turbo.close() restores what setup switched (TF32), whatever happens
        if checkpoint_dir is not None:
            _check_room(turbo, checkpoint_dir)
        batches_per_epoch = length_or_none(loader)  # None for a stream
        if batches_per_epoch is not None:
            _check_accumulation(config, recipe, batches_per_epoch)
        resumed_from: Path | None = None
        if resume:
            assert checkpoint_dir is not None  # _check_arguments refuses resume without one
            resumed_from = turbo.load(checkpoint_dir, next_epoch=next_epoch)
        if resumed_from is not None:
            check_steps(steps, turbo.optimizer_steps, resumed_from)
            on_event(
                f"resumed from {resumed_from} at optimizer step {turbo.optimizer_steps}; "
                f"data: {loader.resume_note}"
            )
        tuning.tell()
        saved, last_loss, seen_events, first_step = None, None, 0, turbo.optimizer_steps
        meter = recipe_meter(turbo, recipe, logger) if logger is not None else None
        samples, stopping = 0, False
        clock = _StepClock(turbo.device)
        while turbo.optimizer_steps < steps and not stopping:
            yielded = 0
            try:
                for batch in loader:
                    yielded += 1
                    samples += leading_size(batch) * world_size
                    metrics = turbo.step(recipe.loss_fn, batch)
                    clock.stepped()
                    if meter is not None:
                        meter.update(metrics)
                    for event in microbatcher.events[seen_events:]:
                        on_event(event)
                    seen_events = len(microbatcher.events)
                    if not metrics.optimizer_stepped:
                        continue
                    tuning.tell()
                    last_loss = float(metrics.loss)
                    # Every rank asks at every step boundary, so that they all stop after this one.
                    stopping = turbo.agree_to_stop(stop)
                    if save_every and turbo.optimizer_steps % save_every == 0:
                        assert checkpoint_dir is not None  # _check_arguments: needs one
                        saved = turbo.save(checkpoint_dir)
                    if on_progress is not None:
                        checkpoint = saved or resumed_from
                        on_progress(
                            TrainProgress(
                                turbo.optimizer_steps, steps, last_loss, samples, checkpoint
                            )
                        )
                    if turbo.optimizer_steps >= steps or stopping:
                        break
                else:  # the epoch ended
                    if not yielded:
                        raise ValueError(f"recipe {recipe.name!r}: the data loader yields no batch")
                    if batches_per_epoch is None:  # a stream: its length is known now
                        batches_per_epoch = loader.batches
                        _check_accumulation(config, recipe, batches_per_epoch)
            except SampleDtypeError as err:
                saved = _save_before_failing(turbo, checkpoint_dir, first_step, saved)
                why = _failed_at(err, turbo, checkpoint_dir, saved)
                raise SampleDtypeError(why, err.position) from err
        interrupted = stopping and turbo.optimizer_steps < steps
        turbo.guard.raise_if_ending_nonfinite(model, turbo.optimizer_steps)
        saved = _save_unsaved(turbo, checkpoint_dir, first_step, saved)
        tuning.keep()
    finally:
        turbo.close()
    if interrupted:
        raise TrainInterrupted(saved, turbo.optimizer_steps, stop.signal_name or "a signal")
    return TrainResult(
        optimizer_steps=turbo.optimizer_steps,
        last_loss=last_loss,
        skipped_steps=turbo.skipped_steps,
        resumed_from=resumed_from,
        saved=saved,
        micro_batch_split=microbatcher.split,
        micro_batch_size=microbatcher.micro_batch_size,
        events=tuple(microbatcher.events),
        first_step_s=clock.first_s,
        later_step_s=clock.later_s(),
    )


class _InRunNews:
    """Tells ``on_event`` what tuning inside the run said since last asked, and keeps its
    decisions in ``tuned_dir`` when it decided something new (and at the end)."""

    def __init__(
        self, turbo: Turbo, on_event: Callable[[str], None], tuned_dir: str | Path | None
    ) -> None:
        self.turbo, self.on_event, self.tuned_dir = turbo, on_event, tuned_dir
        self.told = 0

    def tell(self) -> None:
        tuner = self.turbo.in_run
        if tuner is None or len(tuner.events) == self.told:
            return
        for event in tuner.events[self.told :]:
            self.on_event(event)
        self.told = len(tuner.events)
        self.keep()

    def keep(self) -> None:
        tuner = self.turbo.in_run
        if tuner is not None and self.tuned_dir is not None and current_env().rank == 0:
            tuner.write(self.tuned_dir)


@contextlib.contextmanager
def _owned_directory(
    checkpoint_dir: str | Path | None, *, resume: bool, device: str
) -> Iterator[None]:
    """Before anything is built: the checkpoint directory made and proven writable (on every
    rank: under FSDP each writes its shards), then owned by this run for the block (rank 0
    holds the lock for the job). A refusal is raised on every rank alike."""
    if checkpoint_dir is None:
        yield
        return
    env = init_distributed(device)  # joins torchrun's group (setup would); the ranks agree
    _on_every_rank(lambda: prepare_directory(checkpoint_dir, resume=resume))
    with contextlib.ExitStack() as owned:
        if env.rank == 0:
            _on_every_rank(lambda: owned.enter_context(hold_directory(checkpoint_dir)))
        else:
            _on_every_rank(lambda: None)
        yield


def _check_room(turbo: Turbo, checkpoint_dir: str | Path) -> None:
    """Room for one checkpoint of this run (rank 0 writes them), before the first step."""
    assert turbo.model is not None and turbo.optimizer is not None and turbo.strategy is not None
    needed = estimate_state_bytes(turbo.strategy.unwrap(turbo.model), turbo.optimizer)

    def check() -> None:
        if current_env().rank != 0:
            return
        error, warning = room_problem(checkpoint_dir, needed, turbo.config.reliability.keep_last)
        if error:
            raise CheckpointError(error)
        if warning:
            warnings.warn(warning, RuntimeWarning, stacklevel=4)

    _on_every_rank(check)


def _on_every_rank(check: Callable[[], object]) -> None:
    """Run ``check`` on this rank; the first rank's :class:`CheckpointError` is raised on every
    rank, so that none goes on into a collective that the failing one never enters."""
    failure: CheckpointError | None = None
    try:
        check()
    except CheckpointError as err:
        failure = err
    if current_env().is_distributed:
        found: list[str | None] = [None] * current_env().world_size
        torch.distributed.all_gather_object(found, None if failure is None else str(failure))
        first = next((message for message in found if message is not None), None)
        if failure is None and first is not None:
            raise CheckpointError(first)
    if failure is not None:
        raise failure


class _StepClock:
    """The first step's seconds apart from the others': one-time costs land in the first."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.start = time.perf_counter()
        self.first_s: float | None = None
        self.first_end = 0.0
        self.steps = 0

    def stepped(self) -> None:
        self.steps += 1
        if self.steps == 1:
            sync(self.device)
            self.first_end = time.perf_counter()
            self.first_s = self.first_end - self.start

    def later_s(self) -> float | None:
        if self.steps < 2:
            return None
        sync(self.device)
        return (time.perf_counter() - self.first_end) / (self.steps - 1)


def _save_unsaved(
    turbo: Turbo, checkpoint_dir: str | Path | None, first_step: int, saved: Path | None
) -> Path | None:
    """The last optimizer step saved, when there is a directory and the run trained since it
    began and since its last save; else ``saved`` as it was."""
    just_saved = saved is not None and saved.name == checkpoint_name(turbo.optimizer_steps)
    if checkpoint_dir is None or turbo.optimizer_steps == first_step or just_saved:
        return saved
    return turbo.save(checkpoint_dir)


def _save_before_failing(
    turbo: Turbo, checkpoint_dir: str | Path | None, first_step: int, saved: Path | None
) -> Path | None:
    """Before a run ends on bad data: its last optimizer step saved (:func:`_save_unsaved`), in
    one process and between windows only, so that a resume loses nothing."""
    if turbo.window_open or current_env().world_size > 1:  # a save is collective: the other
        return saved  # ranks are not here; inside a window there is no step to save
    return _save_unsaved(turbo, checkpoint_dir, first_step, saved)


def _failed_at(
    err: Exception, turbo: Turbo, checkpoint_dir: str | Path | None, saved: Path | None
) -> str:
    """``err`` with the step it stopped and what was kept."""
    if saved is not None:
        kept = f"the last optimizer step is saved in {saved}: fix the sample and --resume"
    elif checkpoint_dir is None:
        kept = "nothing saved (give --checkpoint-dir to keep the steps trained)"
    else:
        kept = "no step was trained since the run began: nothing to save"
    return f"{err} (at optimizer step {turbo.optimizer_steps + 1}); {kept}"


def _check_arguments(
    steps: int, save_every: int, checkpoint_dir: str | Path | None, resume: bool
) -> None:
    """Refuse arguments no run can use, each error naming the argument and what is allowed."""
    for name, value, low in (("steps", steps, 1), ("save_every", save_every, 0)):
        is_int = isinstance(value, int) and not isinstance(value, bool)
        if not is_int or not low <= value <= INT64_MAX:
            raise ValueError(
                f"{name} = {value!r} is invalid: expected an int >= {low}"
                + (" and <= 2**63 - 1" if is_int and value > INT64_MAX else "")
                + (" (0 = save at the end only)" if name == "save_every" else "")
            )
    if (resume or save_every) and checkpoint_dir is None:
        raise ValueError("resume and save_every need a checkpoint directory (checkpoint_dir=)")


def _check_accumulation(config: TurboConfig, recipe: Recipe, batches_per_epoch: int) -> None:
    """A window closes at the end of an epoch (so that no gradient is lost): more micro-steps
    than an epoch has batches would silently make every window one epoch."""
    steps = config.accumulation.steps
    if steps > batches_per_epoch:
        raise ConfigError(
            f"[accumulation] steps = {steps} is more than the {batches_per_epoch} batches of an "
            f"epoch of recipe {recipe.name!r}: every window would close at the epoch's end "
            f"after {batches_per_epoch}; use steps <= {batches_per_epoch}"
        )
