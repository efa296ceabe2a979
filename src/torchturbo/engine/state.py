"""What a checkpoint of a training run holds, and putting it back: exact resume.

Saved at a window boundary (right after an optimizer step, so no gradient is in flight and under
torchrun every rank agrees on the point): ``Turbo.state_dict()`` (model, optimizer, loss scale,
counters, the micro-batch split, the loader's position in its epoch and the random state that
epoch began with, the process's random state) plus the LR scheduler's state and the config, as
TOML. The engine's strategy writes them (``distributed/strategy.py``): rank 0 writes the shared
files, every rank's random state travels beside them (``rng.rank1.pt``...), and under FSDP the
model and optimizer are sharded through ``torch.distributed.checkpoint``. Tensors go to ``.pt``
files, everything else to JSON, so ``torch.load(weights_only=True)`` can read the checkpoint back
(``torchturbo.resume.files``).

A run killed inside an accumulation window resumes from the checkpoint before that window and
re-trains the window from its first batch: the loader position makes that exact.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from torchturbo.config import ConfigError, TurboConfig
from torchturbo.distributed.strategy import Strategy
from torchturbo.reliability import remap
from torchturbo.reliability.epochs import EpochLoader, LoaderPosition
from torchturbo.reliability.guard import refuse_nonfinite_state
from torchturbo.resume.checks import (
    STATE_VERSION,
    check_resumable,
    data_changes,
    data_problems,
    lacking_files,
)
from torchturbo.resume.files import CheckpointError
from torchturbo.techniques.framework.steps import Steps


class Resumable(Protocol):
    """What saving and restoring a run reads of it: the engine (:class:`~torchturbo.Turbo`) is
    one. Declared here, not imported, so that the run checkpoints sit below the engine."""

    config: TurboConfig
    model: nn.Module | None
    optimizer: torch.optim.Optimizer | None
    strategy: Strategy | None
    loader: EpochLoader | None
    optimizer_steps: int
    batches_in_window: int
    steps: Steps

    @property
    def window_open(self) -> bool: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def save_training_state(turbo: Resumable, directory: str | Path, scheduler: Any = None) -> Path:
    """Write the state of ``turbo`` (a set-up :class:`~torchturbo.engine.Turbo`) atomically."""
    if turbo.model is None or turbo.optimizer is None or turbo.strategy is None:
        raise CheckpointError("Turbo.save needs Turbo.setup(model, optimizer, ...) first")
    refuse_nonfinite_state(turbo.model, turbo.optimizer)
    if turbo.window_open:
        raise CheckpointError(
            "Turbo.save was called inside an accumulation window (gradients of "
            f"{turbo.batches_in_window} micro-batches are pending); save right after a step "
            "whose metrics say optimizer_stepped=True"
        )
    state = turbo.state_dict()
    position: LoaderPosition | None = state["loader"]
    random_state = state["random"]
    files: dict[str, Any] = {
        "state.json": {
            "version": STATE_VERSION,
            "strategy": turbo.strategy.name,
            "optimizer": type(turbo.optimizer).__name__,
            "optimizer_steps": state["optimizer_steps"],
            "skipped_steps": state["skipped_steps"],
            "micro_batch_split": state["micro_batch_split"],
            "loader": None if position is None else [position.epoch, position.batches],
            # Where the ranks together got in the epoch's global order: what a resume on
            # another number of ranks continues from (reliability/remap.py).
            "loader_order": None if position is None else position.order,
            "world_size": turbo.strategy.env.world_size,
            # What the position counts in: a resume onto other data must not continue it.
            "data": None if turbo.loader is None else turbo.loader.identity,
        },
        "config.toml": turbo.config.to_toml(),
    }
    for name, kept in state["steps"].items():  # the step hooks' state (fp16's loss scale)
        files[f"{name}.pt"] = kept
    if state.get("in_run") is not None:  # what tuning inside the run measured and decided
        files["in_run.json"] = state["in_run"]
    if scheduler is not None:
        files["scheduler.pt"] = scheduler.state_dict()
    per_rank = {
        "rng.pt": {
            "torch": random_state["torch"],
            "cuda": random_state["cuda"],
            "numpy_keys": random_state["numpy_keys"],
            "loader_generator": None if position is None else position.generator_state,
            "loader_torch": None if position is None else position.torch_state,
        },
        "random.json": {"numpy": random_state["numpy"], "python": random_state["python"]},
    }
    if position is not None and position.source_state is not None:
        # A loader or stream that saves its own position: each rank's, after its last batch.
        per_rank["loader_state.pt"] = position.source_state
    return turbo.strategy.save_checkpoint(
        directory,
        turbo.optimizer_steps,
        files,
        tensors={"model": state["model"], "optimizer": state["optimizer"]},
        per_rank=per_rank,
        keep_last=turbo.config.reliability.keep_last,
    )


def load_training_state(
    turbo: Resumable, directory: str | Path, scheduler: Any = None, *, next_epoch: bool = False
) -> Path:
    """Restore the newest valid checkpoint under ``directory`` into ``turbo``; returns its path.

    ``next_epoch``: the loader starts the epoch after the checkpoint's (at its start, the one
    it was at) instead of continuing it: what a resume onto changed data or another batch plan
    asks for, since the checkpoint's position counts in the data it was saved with."""
    if turbo.model is None or turbo.optimizer is None or turbo.strategy is None:
        raise CheckpointError("Turbo.load needs Turbo.setup(model, optimizer, ...) first")
    # A checkpoint whose manifest lacks a file every checkpoint holds is skipped as corrupt.
    path, files = turbo.strategy.read_checkpoint(directory, required=lacking_files)
    # Before anything is restored: every way the checkpoint does not fit this run, at once.
    model = turbo.strategy.unwrap(turbo.model)
    saved_state = files.get("state.json")
    world = turbo.strategy.env.world_size
    identity = None if turbo.loader is None else turbo.loader.identity
    moved = [] if next_epoch else remap.world_problems(saved_state, turbo.loader, world)
    changed = [] if next_epoch else data_problems(saved_state, identity)
    check_resumable(
        path,
        files,
        model,
        turbo.optimizer,
        turbo.loader,
        position_problems=[*moved, *changed],
        # A new epoch counts no position of the old one: nothing to check it against.
        carried_over=next_epoch
        or (not moved and remap.carried_over_state(saved_state, turbo.loader)),
    )
    if not next_epoch:
        _warn_on_new_data(path, saved_state, identity)
    saved = files["state.json"]
    state = turbo.state_dict()  # the live state: what a sharded checkpoint is read into
    live = {"model": state["model"], "optimizer": state["optimizer"]}
    tensors = turbo.strategy.load_tensors(path, files, live)
    if scheduler is not None:
        if "scheduler.pt" not in files:
            raise CheckpointError(
                f"Turbo.load got a scheduler, but checkpoint {str(path)!r} holds none: it was "
                "saved without Turbo.save(..., scheduler=...)"
            )
        scheduler.load_state_dict(files["scheduler.pt"])
    rng = files["rng.pt"]
    plain = files.get("random.json", saved)  # version 1 kept them in state.json
    state.update(tensors)
    state.update(
        steps=turbo.steps.states_in(files),
        optimizer_steps=saved["optimizer_steps"],
        skipped_steps=saved["skipped_steps"],
        micro_batch_split=saved["micro_batch_split"],
        random={**rng, "numpy": plain["numpy"], "python": plain["python"]},
        loader=None,
        in_run=files.get("in_run.json"),
    )
    if saved["loader"] is not None and next_epoch:
        epoch, batches = saved["loader"]
        # The random state of the moment it was saved, as an uninterrupted run's next epoch.
        state["loader"] = LoaderPosition(epoch + (1 if batches else 0), 0, None, rng["torch"])
    elif saved["loader"] is not None:
        epoch, batches = saved["loader"]
        state["loader"] = LoaderPosition(
            epoch,
            batches,
            rng["loader_generator"],
            rng["loader_torch"],
            files.get("loader_state.pt"),
            saved.get("loader_order"),
        )
    turbo.load_state_dict(state)
    # After the load: tuning inside the run restores the config it had decided on.
    _warn_on_config_change(path, files["config.toml"], turbo.config)
    return path


def _warn_on_new_data(path: Path, saved: Any, identity: dict[str, Any] | None) -> None:
    """A checkpoint at an epoch's start resumed onto changed data: exact (the next epoch is the
    current data's), but said, since the run no longer trains what it began with."""
    changes = data_changes(saved, identity)
    if changes:
        warnings.warn(
            f"resuming from {path} at the start of an epoch onto changed data: "
            f"{'; '.join(changes)}; the next epoch trains the current data",
            RuntimeWarning,
            stacklevel=3,
        )


def _warn_on_config_change(path: Path, saved_toml: str, current: TurboConfig) -> None:
    try:
        saved = TurboConfig.from_toml(saved_toml).to_dict()
    except ConfigError as err:
        warnings.warn(f"{path}: its config.toml no longer loads ({err})", RuntimeWarning, 3)
        return
    now = current.to_dict()
    changed = sorted(k for k in saved.keys() | now.keys() if saved.get(k) != now.get(k))
    if changed:
        warnings.warn(
            f"resuming from {path} with a config that differs in {changed}: training continues "
            "with the current config, so it will not match the interrupted run exactly",
            RuntimeWarning,
            stacklevel=3,
        )
