"""Process group start-up under torchrun, and rank-aware output.

``torchrun`` (``python -m torch.distributed.run``) sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT`` in every process it starts, on one machine or many
(``--nnodes M --rdzv-endpoint host:port``). :func:`init_distributed` reads them, picks the backend
(NCCL when the device is CUDA, gloo on CPU), binds the process to its GPU and joins the group. A
script run without torchrun gets a one-process :class:`DistEnv` and no process group, so the same
script runs on a laptop and on a cluster. A half-set environment (``RANK`` without ``WORLD_SIZE``,
a hand-exported ``MASTER_ADDR`` left over in a shell) is an error that lists what is missing:
otherwise ``init_process_group`` waits forever for peers that never come.

Only rank 0 prints and writes files (:func:`is_main_process`, :func:`main_print`): N processes
writing one report would race.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

#: Variables torchrun sets in every worker; all or none must be present.
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits: its global rank, its rank on the machine, the process count."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    #: "nccl" or "gloo" when a process group is running, None for a single process.
    backend: str | None = None

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def read_launch_env(environ: Mapping[str, str] | None = None) -> DistEnv | None:
    """The rank layout torchrun put in the environment, or None when not launched by it."""
    environ = os.environ if environ is None else environ
    present = [name for name in LAUNCH_VARIABLES if name in environ]
    if not present:
        return None
    missing = [name for name in LAUNCH_VARIABLES if name not in environ]
    if missing:
        raise ValueError(
            f"the distributed environment is half set up: {present} are set but {missing} are "
            "not. Launch with `torchrun --nproc-per-node N ...` (which sets all of "
            f"{list(LAUNCH_VARIABLES)}), or unset {present} to run as a single process"
        )
    values = {name: _int_variable(environ, name) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    if not 0 <= values["RANK"] < values["WORLD_SIZE"]:
        raise ValueError(
            f"RANK = {values['RANK']} is invalid for WORLD_SIZE = {values['WORLD_SIZE']}: "
            f"expected 0 <= RANK < WORLD_SIZE"
        )
    return DistEnv(values["RANK"], values["LOCAL_RANK"], values["WORLD_SIZE"])


def _int_variable(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise ValueError(f"{name} = {environ[name]!r} is invalid: expected an integer") from None


def backend_for(device: torch.device) -> str:
    """NCCL for CUDA tensors, gloo for CPU tensors (NCCL cannot move host memory)."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(device: str = "auto", *, timeout_s: float = 600.0) -> DistEnv:
    """Join the process group torchrun prepared (once; later calls return the same layout).

    ``device`` is the engine's ``TurboConfig.device``: ``auto`` means CUDA when available. On CUDA
    each process is bound to GPU ``LOCAL_RANK`` *before* the engine runs, so ``"cuda"`` means that
    process's own GPU everywhere afterwards. ``timeout_s`` bounds how long a collective may wait
    for a missing peer before failing instead of hanging.
    """
    if dist.is_available() and dist.is_initialized():
        return current_env()
    env = read_launch_env()
    if env is None:
        return DistEnv()
    use_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if use_cuda and ":" in device and env.is_distributed:
        raise ValueError(
            f"device = {device!r} names one GPU for every process; under torchrun each process "
            "uses GPU LOCAL_RANK: pass device 'cuda'"
        )
    if use_cuda:
        if env.local_rank >= torch.cuda.device_count():
            raise ValueError(
                f"LOCAL_RANK = {env.local_rank} but this machine has "
                f"{torch.cuda.device_count()} CUDA device(s): lower --nproc-per-node"
            )
        torch.cuda.set_device(env.local_rank)
    backend = backend_for(torch.device("cuda" if use_cuda else "cpu"))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return DistEnv(env.rank, env.local_rank, env.world_size, backend)


def current_env() -> DistEnv:
    """The layout of the running process group, or a single process when there is none."""
    if not (dist.is_available() and dist.is_initialized()):
        return DistEnv()
    local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    return DistEnv(dist.get_rank(), local_rank, dist.get_world_size(), dist.get_backend())


def shutdown() -> None:
    """Leave the process group (a no-op without one); call once at the end of a script.

    DDP objects caught in reference cycles still hold the group: they are freed first, or gloo
    work they reference can outlive the group into interpreter shutdown and abort the process
    ("terminate called without an active exception", pytorch/pytorch#190489).
    """
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


@contextlib.contextmanager
def launched(device: str = "auto") -> Iterator[DistEnv]:
    """Run a command inside torchrun's process group when launched by torchrun.

    Joins the group on entry (a single process without torchrun) and, if it joined, leaves it on
    exit: after a barrier when the command succeeded, so that no rank tears the group down while
    a peer still communicates. A rank that fails exits at once; torchrun then stops the others.
    """
    joined = not (dist.is_available() and dist.is_initialized())
    env = init_distributed(device)
    yield env
    if joined and env.is_distributed:
        dist.barrier()
        shutdown()  # frees what still holds the group first


def is_main_process() -> bool:
    """True on rank 0, and in a single process: the one that prints and writes files."""
    return current_env().rank == 0


def main_print(*args: Any, **kwargs: Any) -> None:
    """``print`` on rank 0 only, so that N processes do not print N copies."""
    if is_main_process():
        print(*args, **kwargs)
