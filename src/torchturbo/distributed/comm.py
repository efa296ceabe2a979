"""Communication accounting: bytes all-reduced and time spent in DDP gradient communication.

:func:`counting_hook` wraps any DDP comm hook. While one of its bucket reductions is in flight
(from the hook's call until the future it returns completes), every ``torch.distributed.all_reduce``
is counted: calls and bytes of the tensor sent. The wall time during which at least one bucket
reduction is in flight is the step's communication time (overlapping buckets count once).

Why the counting sits on ``torch.distributed.all_reduce`` and not inside the hook: a hook sees its
bucket, not what it sends. fp16 sends half the bucket; PowerSGD sends its P and Q factors, plus the
rank-1 tensors uncompressed, from callbacks chained on futures, which run on the backend's thread
where a ``TorchDispatchMode`` (thread-local) sees nothing. torch's hooks call the module function
``torch.distributed.all_reduce`` on every path, so a wrapper there sees every byte, on every
thread, for every hook. It is installed by the first counting hook and forwards every call
unchanged; calls made while no counted reduction is in flight (a loss all-reduced for logging)
are not counted.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

CommHook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


@dataclass
class CommStats:
    """Totals since the last :meth:`reset`. Read them after a step's backward has finished."""

    #: Bytes of the tensors all-reduced (what this process contributes to the wire).
    bytes: int = 0
    #: all_reduce calls made by the hooks.
    collectives: int = 0
    #: Bucket reductions, i.e. hook calls (one per bucket per synchronizing backward).
    reductions: int = 0
    #: Wall seconds during which at least one bucket reduction was in flight.
    seconds: float = 0.0
    #: False once a reduction ran on CUDA: an NCCL future completes when the collective is
    #: queued on the GPU, not when it is done, so ``seconds`` would understate it there.
    timed: bool = True
    _in_flight: int = field(default=0, repr=False)
    _since: float = field(default=0.0, repr=False)

    def reset(self) -> None:
        self.bytes = self.collectives = self.reductions = 0
        self.seconds = 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "bytes": self.bytes,
            "collectives": self.collectives,
            "reductions": self.reductions,
            "seconds": self.seconds,
        }


_LOCK = threading.Lock()
#: Stats objects with a bucket reduction in flight right now, by id.
_ACTIVE: dict[int, CommStats] = {}


def counting_hook(hook: CommHook, stats: CommStats) -> CommHook:
    """A comm hook that runs ``hook`` and adds what it sends to ``stats``."""
    _install_all_reduce_counter()

    @functools.wraps(hook)
    def counted(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        _enter(stats)
        stats.reductions += 1
        stats.timed = stats.timed and not bucket.buffer().is_cuda
        future = hook(state, bucket)

        def finished(done: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            _leave(stats)
            return done.value()

        return future.then(finished)

    return counted


def _enter(stats: CommStats) -> None:
    with _LOCK:
        if stats._in_flight == 0:
            stats._since = time.perf_counter()
            _ACTIVE[id(stats)] = stats
        stats._in_flight += 1


def _leave(stats: CommStats) -> None:
    with _LOCK:
        stats._in_flight -= 1
        if stats._in_flight == 0:
            stats.seconds += time.perf_counter() - stats._since
            del _ACTIVE[id(stats)]


def _install_all_reduce_counter() -> None:
    if getattr(dist.all_reduce, "_torchturbo_counter", False):
        return
    original = dist.all_reduce

    @functools.wraps(original)
    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        with _LOCK:
            for stats in _ACTIVE.values():
                stats.bytes += tensor.numel() * tensor.element_size()
                stats.collectives += 1
        return original(tensor, *args, **kwargs)

    all_reduce._torchturbo_counter = True  # type: ignore[attr-defined]
    dist.all_reduce = all_reduce
