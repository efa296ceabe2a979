"""An epoch batched a chunk at a time, each chunk by the plan named as it is drawn.

The in-run tuner measures a batch plan (length buckets) on the job's own steps with this
sampler. An epoch's samples are shuffled once, from ``(seed, epoch)``, and drawn in chunks:
consecutive runs of that order. As the loader reaches a chunk, ``draw(epoch, index)`` names its
size and the plan that batches it: a measuring chunk holds ``measure_batches`` of the user's
batches' worth of samples, a holding chunk ``hold_batches``, the last one all that is left;
"with" batches it by the run's plan (``plan(indices, seed)``), "without" by the user's rows in
the shuffled order. So:

- every sample is trained once per epoch, whatever the sides;
- each chunk keeps the user's real tokens per step (a plan over a chunk draws no more batches
  than the user's rows of it would: ``data.batch_plan.matched_budget``);
- the plan can change at any chunk's edge, the safe point, not only at an epoch's;
- the sides drawn are the caller's to remember (the tuner keeps them in its state), so a
  resumed run that draws the epoch again from its start gets the same batches.

Batches are yielded as ``(side, index)`` keys, which :class:`SidedDataset` and
:class:`SidedCollate` turn into the samples collated the way their plan collates them (in
loader workers too: both pickle). Written here: no library batches one epoch by two plans
chosen as it goes.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from torch.utils.data import Dataset

#: The user's batches' worth of samples in a measuring chunk, and in a holding one.
MEASURE_BATCHES = 4
HOLD_BATCHES = 64

Side = Literal["with", "without"]
Size = Literal["measure", "hold", "rest"]
#: The key of each side in the batches' ``(side, index)`` pairs, and of its collate.
SIDES: tuple[Side, Side] = ("with", "without")


@dataclass(frozen=True)
class Draw:
    """What the next chunk is: the plan that batches it and its size."""

    side: Side
    size: Size


@dataclass(frozen=True)
class Chunk:
    """A chunk as drawn: its place in the epoch's batches, the real tokens it holds, and the
    seconds its plan took to batch it. Measured: a measuring chunk drawn whole (the epoch's
    last may be cut short)."""

    index: int
    side: Side
    measured: bool
    first: int
    batches: int
    real_tokens: int
    plan_s: float = 0.0


class SidedDataset(Dataset):
    """``dataset`` read by ``(side, index)`` keys: ``(side, dataset[index])``."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> tuple[int, Any]:
        side, index = key
        return side, self.dataset[index]


@dataclass(frozen=True)
class SidedCollate:
    """Collates a batch of :class:`SidedDataset` samples by its side's collate."""

    collates: tuple[Callable[[list[Any]], Any], Callable[[list[Any]], Any]]

    def __call__(self, samples: list[tuple[int, Any]]) -> Any:
        return self.collates[samples[0][0]]([sample for _, sample in samples])


class ChunkedPlanSampler:
    """Yields each batch's ``(side, index)`` keys for ``DataLoader(batch_sampler=...)``
    (module docstring). ``plan(indices, seed)`` batches dataset ``indices`` by the run's plan
    and returns the batches of dataset indices; ``draw(epoch, index)`` names chunk ``index``.
    :meth:`chunk_at` says which chunk a batch of the epoch came from."""

    def __init__(
        self,
        lengths: Sequence[int],
        batch_size: int,
        plan: Callable[[np.ndarray, int], list[list[int]]],
        draw: Callable[[int, int], Draw],
        *,
        seed: int = 0,
        measure_batches: int = MEASURE_BATCHES,
        hold_batches: int = HOLD_BATCHES,
    ) -> None:
        if batch_size < 1 or measure_batches < 1 or hold_batches < 1:
            raise ValueError(
                "batch_size, measure_batches and hold_batches must be >= 1, got "
                f"{batch_size}, {measure_batches}, {hold_batches}"
            )
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.batch_size = batch_size
        self.plan, self.draw = plan, draw
        self.seed, self.epoch = seed, 0
        self.sizes = {"measure": measure_batches * batch_size, "hold": hold_batches * batch_size}
        #: The chunks of the epoch drawn so far, and the samples they took.
        self.chunks: list[Chunk] = []
        self._taken = 0
        #: Seconds spent batching chunks so far, all epochs together: planning happens when the
        #: loader draws ahead, inside another chunk's time, which ``ChunkClock`` takes it from.
        self.planning_s = 0.0

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.chunks, self._taken = epoch, [], 0

    def __len__(self) -> int:
        """The epoch's batches: those drawn, and the user's rows of the samples left (no plan
        over a chunk draws more). Exact once the last chunk is drawn."""
        left = len(self.lengths) - self._taken
        return sum(c.batches for c in self.chunks) + math.ceil(left / self.batch_size)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        epoch = self.epoch
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.lengths))
        self.chunks, self._taken = [], 0
        position = 0
        while self._taken < len(order):
            index = len(self.chunks)
            draw = self.draw(epoch, index)
            size = self.sizes.get(draw.size, len(order))
            indices = order[self._taken : self._taken + size]
            began = time.perf_counter()
            if draw.side == "with":
                batches = self.plan(indices, _chunk_seed(self.seed, epoch, index))
            else:
                step = self.batch_size
                batches = [indices[i : i + step].tolist() for i in range(0, len(indices), step)]
            plan_s = time.perf_counter() - began
            self.planning_s += plan_s
            chunk = Chunk(
                index,
                draw.side,
                draw.size == "measure" and len(indices) == size,
                position,
                len(batches),
                int(self.lengths[indices].sum()),
                plan_s,
            )
            self.chunks.append(chunk)
            self._taken += len(indices)
            key = SIDES.index(draw.side)
            for batch in batches:
                yield [(key, int(i)) for i in batch]
            position += len(batches)

    def chunk_at(self, position: int) -> Chunk | None:
        """The chunk that holds the epoch's ``position``-th batch (0-based), None if not drawn."""
        at = bisect.bisect_right(self.chunks, position, key=lambda c: c.first) - 1
        if at < 0:
            return None
        chunk = self.chunks[at]
        return chunk if position < chunk.first + chunk.batches else None


def _chunk_seed(seed: int, epoch: int, index: int) -> int:
    """A plan's seed for one chunk: its batches' order differs from chunk to chunk."""
    return int(np.random.default_rng([seed, epoch, index]).integers(2**31))
