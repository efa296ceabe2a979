"""Strategies: how the engine's model is wrapped, kept in step and checkpointed across processes.

``Turbo.setup`` picks one with ``distributed.select.select_strategy`` from the config and the
launch environment, with no call from the user: one process -> :class:`Strategy` itself; under
torchrun -> ``[distributed] strategy`` (``ddp``: ``DDPStrategy`` in ``ddp.py``, ``fsdp``:
``FSDPStrategy`` in ``fsdp.py``). A strategy owns what differs between them:

- step 5 of composition, the distributed wrap (``wrap``; steps 1-4 are in ``engine.compose``);
- the context each micro-step's backward runs in (``backward_context``: DDP's ``no_sync``);
- turning this rank's sample/token count into the global one (``reduce_count``, see
  ``distributed/normalize.py``);
- which batches this rank loads (``batch_sampler``);
- model and optimizer state dicts, and writing and reading checkpoints (rank 0 writes the shared
  files; under FSDP every rank writes its shards through ``torch.distributed.checkpoint``).

The base class is the single-process strategy and its hooks are what one process needs, as
Lightning Fabric's strategies are. Pipeline parallelism (``distributed/pipeline.py``) is not a
strategy of the engine: its schedule runs forward and backward of every stage itself and takes
``loss_fn(output, target)``, while ``Turbo.step`` runs ``loss_fn(model, batch)`` and calls
backward; use :func:`~torchturbo.distributed.pipeline.build_pipeline` directly.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Collection
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import BatchSampler, Dataset, DistributedSampler

from torchturbo.config import TurboConfig
from torchturbo.distributed.comm import CommStats
from torchturbo.distributed.consensus import any_rank
from torchturbo.distributed.launch import DistEnv
from torchturbo.distributed.normalize import Reference, global_count
from torchturbo.resume.files import (
    SHARDS,
    CheckpointError,
    Required,
    checkpoint_name,
    read_latest,
    write_checkpoint,
)

_NULL = contextlib.nullcontext()
#: ``rng.rank1.pt``: a file of rank 1; ``shards/__1_0.distcp``: the shard rank 1 wrote.
_RANK_FILE = re.compile(r"\.rank(\d+)\.[^.]+$")
_SHARD = re.compile(r"/__(\d+)_\d+\.distcp$")


class Strategy:
    """One process on one device. Distributed strategies override the hooks they change."""

    name: ClassVar[str] = "single_device"

    def __init__(self, config: TurboConfig, device: torch.device, env: DistEnv) -> None:
        self.config = config
        self.device = device
        self.env = env

    @property
    def auto_microbatch_off(self) -> str | None:
        """Why out-of-memory micro-batching must stay off under this strategy; None if it may
        run."""
        return None

    def wrap(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        reference: Reference,
        comm_stats: CommStats | None,
    ) -> nn.Module:
        """Composition step 5: the model as training runs it. ``reference`` reads the open
        window's count reference (for exact normalization across ranks)."""
        if comm_stats is not None:
            raise ValueError(
                "comm_stats= counts DDP's gradient communication, but this run has one process: "
                "launch with torchrun --nproc-per-node N and [distributed] strategy = 'ddp'"
            )
        return model

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside the wrapper (state dict keys without ``module.``)."""
        return model

    def backward_context(self, closing: bool) -> contextlib.AbstractContextManager[Any]:
        """The context a micro-step's forward and backward run in; ``closing`` when its window
        ends with this micro-step."""
        return _NULL

    def reduce_count(self, total: torch.Tensor) -> torch.Tensor:
        """The count that normalizes the window's gradients, from this rank's ``total``."""
        return total

    def batch_sampler(
        self, dataset: Dataset, batch_size: int, *, shuffle: bool, seed: int
    ) -> BatchSampler | None:
        """This rank's batches of ``dataset``; None: the loader's own sampler (all of it)."""
        return None

    def state_dicts(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """(model, optimizer) state dicts as checkpoints hold them."""
        return self.unwrap(model).state_dict(), optimizer.state_dict()

    def load_state_dicts(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        model_state: dict[str, Any],
        optimizer_state: dict[str, Any],
    ) -> None:
        self.unwrap(model).load_state_dict(model_state)
        optimizer.load_state_dict(optimizer_state)

    def save_checkpoint(
        self,
        root: str | Path,
        step: int,
        files: dict[str, Any],
        *,
        tensors: dict[str, Any],
        per_rank: dict[str, Any],
        keep_last: int,
    ) -> Path:
        """Write checkpoint ``step``: ``files`` (shared), ``tensors`` (``model``/``optimizer``
        state dicts) and ``per_rank`` (this rank's random state). Every rank calls it; rank 0
        writes, the others' ``per_rank`` files travel to it. Returns the checkpoint directory."""
        shared = {**files, **self._verified_files(step), **self._gather_rank_files(per_rank)}
        shards = self._save_tensors(root, step, tensors, shared)
        if self.env.rank == 0:
            path = write_checkpoint(root, step, shared, keep_last, shards=shards)
        else:
            path = Path(root) / checkpoint_name(step)
        self._barrier()  # every rank returns once the checkpoint is complete
        return path

    def read_checkpoint(
        self, root: str | Path, required: Required | None = None
    ) -> tuple[Path, dict[str, Any]]:
        """(path, files) of the newest checkpoint under ``root`` that verifies and holds what
        ``required`` asks for, with this rank's ``per_rank`` files under their plain names.
        Nothing is restored yet."""
        if not self.env.is_distributed:
            return read_latest(root, required=required)
        path, files = read_latest(root, self._files_read_here, self._any_rank_failed, required)
        return path, self._own_rank_files(files)

    def _files_read_here(self, names: Collection[str]) -> set[str]:
        """Of a checkpoint's ``names``, those this rank reads, the only ones it verifies: the
        shared files, its own per-rank files (rank 0's when it has none: more processes than
        when it was saved) and, of FSDP shards, the metadata and every world-size-th shard
        from its rank on, so that the ranks verify every shard once between them."""
        rank, world = self.env.rank, self.env.world_size
        chosen = set()
        for name in names:
            if name.startswith(f"{SHARDS}/"):
                shard = _SHARD.search(name)
                if shard is None or int(shard[1]) % world == rank:
                    chosen.add(name)
            elif (owner := _RANK_FILE.search(name)) is not None:
                if int(owner[1]) == rank:
                    chosen.add(name)
            elif rank == 0 or rank_file(name, rank) not in names:
                chosen.add(name)
        return chosen

    def _any_rank_failed(self, failed: bool) -> bool:
        return any_rank(failed, self.device)

    def load_tensors(
        self, path: Path, files: dict[str, Any], live: dict[str, Any]
    ) -> dict[str, Any]:
        """The ``model``/``optimizer`` state dicts of checkpoint ``path`` (``files`` is what
        :meth:`read_checkpoint` returned; ``live`` the current ones, which sharded strategies
        load into)."""
        if (path / SHARDS).is_dir():
            raise CheckpointError(
                f"checkpoint {str(path)!r} holds FSDP shards, not whole state dicts: resume it "
                "under torchrun with [distributed] strategy = 'fsdp'"
            )
        return {name: files.pop(f"{name}.pt") for name in live}

    def _verified_files(self, step: int) -> dict[str, Any]:
        """Shared files recording a check that the ranks agree, made before anything is
        written (it may refuse to save)."""
        return {}

    def _save_tensors(
        self, root: str | Path, step: int, tensors: dict[str, Any], shared: dict[str, Any]
    ) -> Path | None:
        """Put the model and optimizer state where checkpoints keep them: here whole state dicts
        among the shared files; returns a directory of shards to move in, if any."""
        shared.update({f"{name}.pt": state for name, state in tensors.items()})
        return None

    def _gather_rank_files(self, per_rank: dict[str, Any]) -> dict[str, Any]:
        """Every rank's ``per_rank`` files on rank 0, named by :func:`rank_file`."""
        if not self.env.is_distributed:
            return dict(per_rank)
        gathered: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(gathered, per_rank)
        return {
            rank_file(name, rank): value
            for rank, files in enumerate(gathered)
            for name, value in files.items()
        }

    def _own_rank_files(self, files: dict[str, Any]) -> dict[str, Any]:
        """``files`` with this rank's per-rank files under their plain names. A rank the
        checkpoint has no files for (more processes than when it was saved) keeps rank 0's."""
        rank = self.env.rank
        if rank == 0:
            return files
        suffix = f".rank{rank}"
        own = {name.replace(suffix, "", 1): v for name, v in files.items() if suffix in name}
        return {**files, **own}

    def _barrier(self) -> None:
        if self.env.is_distributed:
            dist.barrier()


def rank_file(name: str, rank: int) -> str:
    """The checkpoint file holding rank ``rank``'s ``name``: ``rng.pt`` for rank 0 (the name a
    single process writes), ``rng.rank1.pt`` for rank 1."""
    if rank == 0:
        return name
    stem, dot, suffix = name.rpartition(".")
    return f"{stem}.rank{rank}{dot}{suffix}"


class DataParallel(Strategy):
    """What DDP and FSDP share: each rank trains on its own batches, the global count
    normalizes every rank's gradients, and the ranks' collectives must stay paired."""

    name: ClassVar[str] = "data_parallel"

    def __init__(self, config: TurboConfig, device: torch.device, env: DistEnv) -> None:
        super().__init__(config, device, env)
        if config.reliability.memory_budget_bytes is not None:
            raise ValueError(
                "[reliability] memory_budget_bytes splits each rank's batches on its own, which "
                "leaves the ranks' collectives out of step under torchrun: use [accumulation] "
                "steps (the same on every rank) to shrink the micro-batch"
            )
        self._reference: Reference | None = None

    @property
    def auto_microbatch_off(self) -> str | None:
        # A split decided on the rank that ran out of memory, replaying that rank's window alone,
        # leaves the ranks running different numbers of forwards (DDP broadcasts buffers in each)
        # and reductions (FSDP reduce-scatters each piece): the run hangs instead of failing.
        return (
            "off under torchrun: a retry after out-of-memory would replay one rank's steps "
            "alone, out of step with the others; an out-of-memory error stops the run instead"
        )

    def reduce_count(self, total: torch.Tensor) -> torch.Tensor:
        if self._reference is None:
            raise RuntimeError("the strategy's model is not wrapped yet: call Turbo.setup first")
        return global_count(total, reference=self._reference, world_size=self.env.world_size)

    def batch_sampler(
        self, dataset: Dataset, batch_size: int, *, shuffle: bool, seed: int
    ) -> BatchSampler | None:
        # DistributedSampler pads by repetition so that every rank has as many batches as the
        # others: an uneven count leaves one rank waiting in an all-reduce that never comes.
        sampler: DistributedSampler[Any] = DistributedSampler(
            dataset,
            num_replicas=self.env.world_size,
            rank=self.env.rank,
            shuffle=shuffle,
            seed=seed,
        )
        return BatchSampler(sampler, batch_size, drop_last=False)
