"""A stream (an ``IterableDataset``) dealt out to the ranks of a torchrun job.

A map-style dataset is split across ranks by a ``DistributedSampler``, which needs ``len()``; a
stream has no index to split by. Given to every rank as it is, each rank would train all of it
(every sample N times a step), and a stream that shards itself unevenly leaves one rank with a
batch the others never reach: that rank waits in DDP's all-reduce forever. So the engine deals a
stream out: of each complete round of ``num_replicas`` items, rank r takes the r-th, and the last
incomplete round (fewer than ``num_replicas`` items) is dropped, so that every rank gets as many
items, and as many batches, as the others. Each rank reads the whole stream and keeps its share:
reading is repeated ``num_replicas`` times, which is what any stream without random access pays.

Written by hand: torch offers no rank split for streams (``DistributedSampler`` is for indexable
datasets; torchdata's ``ShardingFilter`` has gone with its DataPipes), and Hugging Face's
``split_dataset_by_node`` is for its own datasets. A stream that already shards itself per rank
is split twice: pass its DataLoader to ``Turbo.setup`` to use it as given.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import IterableDataset


class RankShare(IterableDataset):
    """Rank ``rank``'s share of ``stream`` among ``num_replicas`` ranks (module docstring)."""

    def __init__(self, stream: IterableDataset, num_replicas: int, rank: int) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not one of {num_replicas} ranks")
        self.stream = stream
        self.num_replicas = num_replicas
        self.rank = rank

    def __iter__(self) -> Iterator[Any]:
        round_: list[Any] = []
        for item in self.stream:
            round_.append(item)
            if len(round_) == self.num_replicas:
                yield round_[self.rank]
                round_ = []

    def __len__(self) -> int:
        """This rank's items, when the stream knows its length (else a TypeError, as a stream
        without ``__len__`` raises)."""
        return len(self.stream) // self.num_replicas  # type: ignore[arg-type]
