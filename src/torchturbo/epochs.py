"""The loader that ``Turbo.setup`` returns: epochs, the last-batch signal, and a resumable position.

It iterates the DataLoader one batch ahead so that it knows when the epoch's last batch comes and
says so (:attr:`EpochLoader.at_last_batch`, which the engine reads to close its accumulation
window: without that a trailing partial window is silently lost, and under DDP its gradients
would never be all-reduced), calls ``set_epoch`` on the sampler, and counts the batches handed
to the training loop, so that a checkpoint can say where in the epoch training stood.

Resuming mid-epoch replays the epoch's shuffle rather than storing it: the loader's random state
(its ``generator``, or the global torch RNG when it has none) is captured when each epoch starts,
and on resume it is restored, the iterator is rebuilt and the batches already trained are skipped:
by the sampler's own ``load_state_dict`` for :class:`BucketBatchSampler` (no data is loaded), by
drawing and discarding them otherwise. The loader's position counts batches *trained*, not
batches the DataLoader (or its workers) fetched ahead. Why hand-written: torchdata's
``StatefulDataLoader`` does this but replaces the DataLoader the user built and adds a dependency.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

from torchturbo.data.bucketing import BucketBatchSampler


@dataclass
class LoaderPosition:
    """Where a resumed loader starts: ``epoch`` (0-based), after ``batches`` trained batches.

    ``generator_state``/``torch_state`` are the loader's random state when that epoch began.
    """

    epoch: int
    batches: int
    generator_state: torch.Tensor | None
    torch_state: torch.Tensor


class EpochLoader:
    """Iterate ``loader`` epoch after epoch, one batch ahead, keeping a resumable position."""

    def __init__(self, loader: DataLoader) -> None:
        self.loader = loader
        #: The epoch the next ``iter()`` starts (the one in progress is ``epoch - 1``).
        self.epoch = 0
        #: Batches of the epoch in progress handed to the training loop so far.
        self.batches = 0
        self._in_epoch = False
        self._at_last_batch = False
        self._start_state = self._random_state()
        self._resume: LoaderPosition | None = None
        self._after_resume: Any = None

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def at_last_batch(self) -> bool:
        """True while the batch last handed out is the epoch's last: the signal that the
        accumulation window closes with it (read by ``Turbo.step``)."""
        return self._at_last_batch

    def position(self) -> LoaderPosition:
        """The position to save: mid-epoch, or the start of the next epoch once one is done."""
        if self._resume is not None:  # resumed but not iterated yet: still where it was
            return self._resume
        if self._in_epoch and not self._epoch_done():
            generator_state, torch_state = self._start_state
            return LoaderPosition(self.epoch - 1, self.batches, generator_state, torch_state)
        # Nothing of the next epoch has been drawn yet: its random state is today's.
        generator_state, torch_state = self._random_state()
        return LoaderPosition(self.epoch, 0, generator_state, torch_state)

    def resume(self, position: LoaderPosition, after: Any = None) -> None:
        """Make the next ``iter()`` continue from ``position``; then call ``after()``.

        ``after`` restores the random state of the moment the checkpoint was saved: the skipped
        batches may have drawn random numbers that the uninterrupted run drew before that moment.
        """
        self.epoch, self.batches, self._in_epoch = position.epoch, 0, False
        self._resume, self._after_resume = position, after

    def __iter__(self) -> Iterator[Any]:
        resume, self._resume = self._resume, None
        if resume is not None:
            if resume.generator_state is not None and self.loader.generator is not None:
                self.loader.generator.set_state(resume.generator_state)
            torch.set_rng_state(resume.torch_state)
        self._start_state = self._random_state()
        sampler = self._sampler()
        if sampler is not None:
            sampler.set_epoch(self.epoch)  # a new shuffle each epoch, the same on every rank
        skip = resume.batches if resume is not None else 0
        if skip and isinstance(sampler, BucketBatchSampler):
            sampler.load_state_dict({**sampler.state_dict(), "batches_yielded": skip})
            skip_by_drawing = 0
        else:
            skip_by_drawing = skip
        self.epoch += 1
        self.batches, self._in_epoch = skip, True
        iterator = iter(self.loader)
        for _ in range(skip_by_drawing):
            next(iterator, None)
        current = next(iterator, _END)
        if resume is not None and self._after_resume is not None:
            self._after_resume()
        if current is _END:
            self._in_epoch = False
            return
        yield from self._yield_ahead(iterator, current)

    def _yield_ahead(self, iterator: Iterator[Any], current: Any) -> Iterator[Any]:
        for upcoming in iterator:
            self.batches += 1
            yield current
            current = upcoming
        self._at_last_batch = True
        self.batches += 1
        try:
            yield current
        finally:
            self._at_last_batch = False
        self._in_epoch = False

    def _epoch_done(self) -> bool:
        try:
            return self.batches >= len(self)
        except TypeError:  # an IterableDataset without __len__: done only once exhausted
            return False

    def _sampler(self) -> Any:
        # A BatchSampler around a DistributedSampler (what Turbo.setup builds under torchrun)
        # has no set_epoch of its own: its inner sampler does.
        batch_sampler = self.loader.batch_sampler
        inner = getattr(batch_sampler, "sampler", None)
        for sampler in (batch_sampler, inner, self.loader.sampler):
            if hasattr(sampler, "set_epoch"):
                return sampler
        return None

    def _random_state(self) -> tuple[torch.Tensor | None, torch.Tensor]:
        generator = self.loader.generator
        return (generator.get_state() if generator is not None else None), torch.get_rng_state()


_END = object()
