"""What a checkpoint of a training run holds, and putting it back: exact resume.

Saved at a window boundary (right after an optimizer step, so no gradient is in flight and under
DDP every rank agrees on the point): model, optimizer, GradScaler and LR scheduler state; the
random states (torch CPU and CUDA, numpy, Python ``random``); the loader's position in its epoch
and the random state that epoch began with (``torchturbo.epochs``); the engine's counters and the
micro-batch split it settled on; and the config, as TOML. Tensors go to ``.pt`` files, everything
else to JSON, so ``torch.load(weights_only=True)`` can read the checkpoint back
(``torchturbo.checkpoint``).

A run killed inside an accumulation window resumes from the checkpoint before that window and
re-trains the window from its first batch: the loader position makes that exact.
"""

from __future__ import annotations

import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from torchturbo.checkpoint import CheckpointError, read_latest, write_checkpoint
from torchturbo.config import ConfigError, TurboConfig
from torchturbo.epochs import EpochLoader, LoaderPosition
from torchturbo.guard import refuse_nonfinite_state
from torchturbo.resume_checks import STATE_VERSION, check_resumable


def save_training_state(turbo: Any, directory: str | Path, scheduler: Any = None) -> Path:
    """Write the state of ``turbo`` (a set-up :class:`~torchturbo.engine.Turbo`) atomically."""
    if turbo.model is None or turbo.optimizer is None:
        raise CheckpointError("Turbo.save needs Turbo.setup(model, optimizer, ...) first")
    refuse_nonfinite_state(turbo.model, turbo.optimizer)
    if turbo.window_open:
        raise CheckpointError(
            "Turbo.save was called inside an accumulation window (gradients of "
            f"{turbo.batches_in_window} micro-batches are pending); save right after a step "
            "whose metrics say optimizer_stepped=True"
        )
    loader = turbo.loader
    position = loader.position() if isinstance(loader, EpochLoader) else None
    files: dict[str, Any] = {
        "model.pt": turbo.model.state_dict(),
        "optimizer.pt": turbo.optimizer.state_dict(),
        "rng.pt": _tensor_random_state(position),
        "state.json": {
            "version": STATE_VERSION,
            "optimizer": type(turbo.optimizer).__name__,
            "optimizer_steps": turbo.optimizer_steps,
            "skipped_steps": turbo.skipped_steps,
            "micro_batch_split": turbo.microbatcher.split,
            "loader": None if position is None else [position.epoch, position.batches],
            "numpy": list(np.random.get_state()[2:]),
            "python": _python_state(),
        },
        "config.toml": turbo.config.to_toml(),
    }
    if turbo.scaler is not None:
        files["scaler.pt"] = turbo.scaler.state_dict()
    if scheduler is not None:
        files["scheduler.pt"] = scheduler.state_dict()
    return write_checkpoint(
        directory, turbo.optimizer_steps, files, turbo.config.reliability.keep_last
    )


def load_training_state(turbo: Any, directory: str | Path, scheduler: Any = None) -> Path:
    """Restore the newest valid checkpoint under ``directory`` into ``turbo``; returns its path."""
    if turbo.model is None or turbo.optimizer is None:
        raise CheckpointError("Turbo.load needs Turbo.setup(model, optimizer, ...) first")
    path, files = read_latest(directory)
    check_resumable(path, files, turbo.model, turbo.optimizer, turbo.loader)
    state = files["state.json"]
    _warn_on_config_change(path, files["config.toml"], turbo.config)
    turbo.model.load_state_dict(files["model.pt"])
    turbo.optimizer.load_state_dict(files["optimizer.pt"])
    if turbo.scaler is not None and "scaler.pt" in files:
        turbo.scaler.load_state_dict(files["scaler.pt"])
    if scheduler is not None:
        if "scheduler.pt" not in files:
            raise CheckpointError(
                f"Turbo.load got a scheduler, but checkpoint {str(path)!r} holds none: it was "
                "saved without Turbo.save(..., scheduler=...)"
            )
        scheduler.load_state_dict(files["scheduler.pt"])
    turbo.optimizer_steps = state["optimizer_steps"]
    turbo.skipped_steps = state["skipped_steps"]
    turbo.microbatcher.split = state["micro_batch_split"]
    rng = files["rng.pt"]

    def restore_random_state() -> None:
        _set_random_state(rng, state)

    restore_random_state()
    if state["loader"] is not None and isinstance(turbo.loader, EpochLoader):
        epoch, batches = state["loader"]
        position = LoaderPosition(epoch, batches, rng["loader_generator"], rng["loader_torch"])
        # The loader replays the epoch's shuffle up to the saved position, then puts back the
        # random state of the moment of the save.
        turbo.loader.resume(position, after=restore_random_state)
    return path


def _tensor_random_state(position: LoaderPosition | None) -> dict[str, Any]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return {
        "torch": torch.get_rng_state(),
        "cuda": cuda,
        "numpy_keys": torch.from_numpy(np.random.get_state()[1].astype(np.int64)),
        "loader_generator": None if position is None else position.generator_state,
        "loader_torch": None if position is None else position.torch_state,
    }


def _python_state() -> list[Any]:
    version, internal, gauss_next = random.getstate()
    return [version, list(internal), gauss_next]


def _set_random_state(rng: dict[str, Any], state: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] and torch.cuda.is_available():
        if len(rng["cuda"]) != torch.cuda.device_count():
            warnings.warn(
                f"the checkpoint holds CUDA RNG states of {len(rng['cuda'])} devices, this "
                f"process sees {torch.cuda.device_count()}: CUDA random numbers will differ",
                RuntimeWarning,
                stacklevel=3,
            )
        else:
            torch.cuda.set_rng_state_all(rng["cuda"])
    keys = rng["numpy_keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, *state["numpy"]))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))


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
