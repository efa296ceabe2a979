"""A checkpoint directory checked before the first step: writable, and with room for a checkpoint.

A directory that cannot take a checkpoint (a read-only file system, a path under a file, a
directory without write permission, a full disk) used to be found at the first save, after the
steps before it were trained: all of them lost. :func:`prepare_directory` creates the directory
and writes, fsyncs and removes a probe file in it, so that every reason the system has for
refusing a write is found before the work starts, named in one :class:`CheckpointError`.
:func:`room_problem` compares the free space with the size of one checkpoint of this run,
estimated from the model's and the optimizer's state (:func:`estimate_state_bytes`, before the
optimizer has any state: it is created by the first step).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import torch
from torch import nn

from torchturbo.base.paths import loop_words, symlink_loop
from torchturbo.resume.files import CheckpointError, format_bytes, free_space, list_checkpoints

#: Bytes of the small files of a checkpoint (random states, counters, config, manifest).
SMALL_FILES_BYTES = 64 * 1024
#: Optimizer state per parameter, in parameter sizes, where it is known before the first step
#: creates it (momentum buffers, moment estimates); an optimizer not named here counts as 0,
#: so that the estimate stays a lower bound.
_STATE_PER_PARAMETER = {
    "Adam": 2,
    "AdamW": 2,
    "Adamax": 2,
    "NAdam": 2,
    "RAdam": 2,
    "Adadelta": 2,
    "Adagrad": 1,
    "ASGD": 1,
}


def prepare_directory(directory: str | Path, *, resume: bool) -> Path:
    """Create ``directory`` unless ``resume`` (which needs it to exist) and prove it writable."""
    path = Path(directory)
    shown = repr(str(path))
    if (loop := symlink_loop(path)) is not None:
        raise CheckpointError(f"checkpoint directory {shown}: {loop_words(loop)}")
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"checkpoint directory {shown} is not a directory")
    if resume and not path.exists():
        raise CheckpointError(f"cannot resume: {shown} does not exist")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CheckpointError(
            f"cannot create checkpoint directory {shown}: {_reason(err, path)}"
        ) from err
    probe = path / f".probe-{os.getpid()}"
    try:
        descriptor = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(descriptor, b"\0")
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        probe.unlink()
    except OSError as err:
        with_probe = probe.exists()
        if with_probe:
            probe.unlink(missing_ok=True)
        raise CheckpointError(
            f"checkpoint directory {shown} is not writable: {_reason(err, path)}"
        ) from err
    return path


def _reason(err: OSError, path: Path) -> str:
    """The system's reason, with what it means for a checkpoint directory."""
    if err.errno == errno.ENOTDIR:
        parent = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
        return f"{str(parent)!r} is a file" if parent is not None else "a parent is a file"
    if err.errno == errno.EROFS:
        return "it is on a read-only file system"
    if err.errno == errno.EACCES:
        return "permission denied"
    if err.errno == errno.EPERM:
        return "operation not permitted (an immutable or append-only directory?)"
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"{err.strerror} (the disk or the quota is full)"
    return err.strerror or str(err)


def estimate_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The bytes of a checkpoint of ``model`` and ``optimizer``: parameters and buffers, the
    optimizer's state (its present tensors, or before its first step what its type creates per
    parameter), and the small files."""
    model_bytes = sum(_nbytes(t) for t in (*model.parameters(), *model.buffers()))
    present = [t for state in optimizer.state.values() for t in state.values()]
    tensors = [t for t in present if isinstance(t, torch.Tensor)]
    if tensors:
        optimizer_bytes = sum(_nbytes(t) for t in tensors)
    else:
        trainable = sum(_nbytes(p) for group in optimizer.param_groups for p in group["params"])
        optimizer_bytes = trainable * _per_parameter(optimizer)
    return model_bytes + optimizer_bytes + SMALL_FILES_BYTES


def _per_parameter(optimizer: torch.optim.Optimizer) -> int:
    name = type(optimizer).__name__
    defaults = optimizer.defaults
    if name == "SGD":
        return 1 if defaults.get("momentum") else 0
    if name == "RMSprop":
        return 1 + bool(defaults.get("momentum")) + bool(defaults.get("centered"))
    return _STATE_PER_PARAMETER.get(name, 0)


def _nbytes(tensor: torch.Tensor) -> int:
    # numel() of a DTensor (FSDP) is its global size: the checkpoint holds every shard.
    return tensor.numel() * tensor.element_size()


def room_problem(directory: str | Path, needed: int, keep_last: int) -> tuple[str | None, str]:
    """(error, warning) about the room on ``directory`` for checkpoints of ``needed`` bytes:
    an error when one does not fit; a warning when the ``keep_last`` kept and the one being
    written (older ones are pruned only once the new one is in place) will not all fit."""
    free = free_space(directory)
    shown = repr(str(directory))
    if free < needed:
        return (
            f"checkpoint directory {shown} has {format_bytes(free)} free, and a checkpoint of "
            f"this run needs about {format_bytes(needed)} (the model's and the optimizer's "
            "state): free some space or give another directory"
        ), ""
    present = min(len(list_checkpoints(directory)), keep_last)
    slots = keep_last + 1 - present
    if free < slots * needed:
        fits = free // needed
        return None, (
            f"checkpoint directory {shown} has room for {fits} more checkpoint(s) of about "
            f"{format_bytes(needed)} ({format_bytes(free)} free); keeping {keep_last} "
            f"([reliability] keep_last) needs {slots}: a later save will fail, keeping the "
            "checkpoints before it"
        )
    return None, ""
