"""The loader that ``Turbo.setup`` returns: epochs, the last-batch signal, and a resumable position.

It iterates the DataLoader one batch ahead so that it knows when the epoch's last batch comes and
says so (:attr:`EpochLoader.at_last_batch`, which the engine reads to close its accumulation
window: without that a trailing partial window is silently lost, and under DDP its gradients
would never be all-reduced), calls ``set_epoch`` on the sampler, and counts the batches handed
to the training loop, so that a checkpoint can say where in the epoch training stood.

Resuming mid-epoch replays the epoch's shuffle rather than storing it: the loader's random state
(its ``generator``, or the global torch RNG when it has none) is captured when each epoch starts,
and on resume it is restored, the iterator is rebuilt and the batches already trained are
skipped, without loading them wherever the data allows (:meth:`EpochLoader.resume_note` says
which way was taken):

1. a loader that saves its own position (``state_dict()``/``load_state_dict()``, as torchdata's
   ``StatefulDataLoader``) gets its state back;
2. a :class:`BucketBatchSampler` is fast-forwarded by its own ``load_state_dict``;
3. a map-style dataset: the batch sampler's indices of the trained batches are drawn (so the
   shuffle is the one of the interrupted run) and thrown away; no sample is loaded;
4. a stream (``IterableDataset``) that saves its position, read in the main process, gets its
   state back;
5. only a stream without state is drained: its trained batches are fetched again and discarded.

Per-sample random augmentation that runs in loader *worker* processes draws from the workers'
own generators, which skipping no longer advances: after a skipping resume those draws differ
from the uninterrupted run's (in the main process, or on the device, they do not). The position
counts batches *trained*, not batches the DataLoader (or its workers) fetched ahead. Why
hand-written: torchdata's ``StatefulDataLoader`` does 1 but replaces the DataLoader the user
built and adds a dependency.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler

from torchturbo.data.batch_plan import PlannedSampler
from torchturbo.data.collate import SampleDtypeError, check_dtypes
from torchturbo.data.length import length_or_none
from torchturbo.reliability import remap


@dataclass
class LoaderPosition:
    """Where a resumed loader starts: ``epoch`` (0-based), after ``batches`` trained batches.

    ``generator_state``/``torch_state`` are the loader's random state when that epoch began.
    """

    epoch: int
    batches: int
    generator_state: torch.Tensor | None
    torch_state: torch.Tensor
    #: The ``state_dict()`` of a loader or stream that saves its own position, after the last
    #: trained batch (None for any other loader, and at the start of an epoch).
    source_state: Any = None
    #: The epoch's global order (``reliability.remap.spec``) with ``consumed``, the units of it
    #: all ranks trained, and ``remapped``, whether the epoch was carried over from another world
    #: size; None where the order cannot be rebuilt. What a resume on another number of ranks
    #: continues from.
    order: dict[str, Any] | None = None


def data_identity(loader: DataLoader, lengths: Sequence[int] | None = None) -> dict[str, Any]:
    """What a checkpoint records to recognise the data its epoch's position counts in: the
    dataset's size (None for a stream without one), a digest of the per-sample lengths in their
    order when they are given (a reordered or edited text dataset of the same size differs in
    it), and the batch plan (its sampler's class). Samples of equal size reordered, without
    lengths, are not seen: reading samples to fingerprint them would draw their augmentation."""
    digest = None
    if lengths is not None:
        digest = hashlib.sha256(",".join(map(str, lengths)).encode()).hexdigest()[:16]
    return {
        "samples": length_or_none(loader.dataset),
        "lengths": digest,
        "plan": type(loader.batch_sampler).__name__ if loader.batch_sampler is not None else None,
    }


class EpochLoader:
    """Iterate ``loader`` epoch after epoch, one batch ahead, keeping a resumable position.
    ``identity`` (:func:`data_identity`) goes into checkpoints: a resume onto other data is
    refused mid-epoch rather than continued on it."""

    def __init__(self, loader: DataLoader, identity: dict[str, Any] | None = None) -> None:
        self.loader = loader
        self.identity = identity if identity is not None else data_identity(loader)
        #: The epoch the next ``iter()`` starts (the one in progress is ``epoch - 1``).
        self.epoch = 0
        #: Batches of the epoch in progress handed to the training loop so far.
        self.batches = 0
        self._in_epoch = False
        self._at_last_batch = False
        self._start_state = self._random_state()
        self._resume: LoaderPosition | None = None
        self._after_resume: Any = None
        #: The state of a self-positioning source after the batch last handed out.
        self._source_state: Any = None
        self._stateful = _stateful_source(loader)
        #: The epoch in progress: its global order, the units consumed before this process's
        #: first batch of it (a carried-over epoch), and its batch count when carried over.
        self._order: dict[str, Any] | None = None
        self._base = 0
        self._carried_batches: int | None = None

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
            return LoaderPosition(
                self.epoch - 1,
                self.batches,
                generator_state,
                torch_state,
                self._source_state,
                self._consumed(),
            )
        # Nothing of the next epoch has been drawn yet: its random state is today's.
        generator_state, torch_state = self._random_state()
        order = remap.spec(self.loader, self.epoch)
        start = None if order is None else {**order, "consumed": 0, "remapped": False}
        return LoaderPosition(self.epoch, 0, generator_state, torch_state, order=start)

    def _consumed(self) -> dict[str, Any] | None:
        """The epoch's order and how far into it all ranks got: this process's batches times
        the units a batch of every rank takes, after those of a world it was carried over from."""
        here = remap.spec(self.loader, self.epoch - 1)
        if self._order is None or here is None:
            return None
        stride = here["unit"] * here["world_size"]
        return {
            **self._order,
            "consumed": self._base + self.batches * stride,
            "remapped": self._carried_batches is not None,
        }

    def resume(self, position: LoaderPosition, after: Any = None) -> None:
        """Make the next ``iter()`` continue from ``position``; then call ``after()``.

        ``after`` restores the random state of the moment the checkpoint was saved: the skipped
        batches may have drawn random numbers that the uninterrupted run drew before that moment.
        """
        self.epoch, self.batches, self._in_epoch = position.epoch, 0, False
        self._resume, self._after_resume = position, after

    @property
    def resume_note(self) -> str:
        """How the next ``iter()`` reaches the resumed position, in words (for the resume line)."""
        position = self._resume
        if position is None or not position.batches:
            epoch = "" if position is None else f"epoch {position.epoch}, "
            return f"{epoch}at the start of an epoch: nothing to skip"
        where = f"epoch {position.epoch}, {position.batches} batches in"
        method = self._skip_method(position)
        if method == "remap":
            assert position.order is not None
            unit = "batches" if position.order["kind"] == "plan" else "samples"
            return (
                f"{where} on {position.order['world_size']} rank(s): the "
                f"{position.order['consumed']} {unit} all ranks trained of it carried over to "
                f"{remap.world(self.loader)[0]} rank(s), the rest of the epoch dealt out to "
                "them, no sample loaded"
            )
        how = {
            "loader_state": "the loader's own load_state_dict(), no batch loaded",
            "stream_state": "the stream's own load_state_dict(), no batch loaded",
            "planned_sampler": "the batch plan's sampler fast-forwarded, no sample loaded",
            "indices": "the batch sampler's indices skipped, no sample loaded",
            "drain": f"drained: {position.batches} batches fetched again and discarded "
            f"({self._why_drained()})",
        }[method]
        return f"{where}: {how}"

    def _why_drained(self) -> str:
        if not isinstance(self.loader.dataset, IterableDataset):
            return f"a {type(self.loader).__name__}, whose sampler cannot be swapped"
        if _has_state(self.loader.dataset):
            return "a stream whose state lives in its loader worker processes"
        return "a stream without state_dict()/load_state_dict()"

    def _skip_method(self, position: LoaderPosition) -> str:
        if remap.carried_over(position.order, self.loader):
            return "remap"
        if position.source_state is not None and self._stateful is not None:
            return self._stateful
        if isinstance(self.loader.batch_sampler, PlannedSampler):
            return "planned_sampler"
        if type(self.loader) is DataLoader and not isinstance(self.loader.dataset, IterableDataset):
            return "indices"
        return "drain"

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
        method = self._skip_method(resume) if resume is not None and skip else None
        loader: Any = self.loader
        self._order = remap.spec(self.loader, self.epoch)
        self._base, self._carried_batches = 0, None
        if method == "remap":
            assert resume is not None and resume.order is not None
            self._order = {k: v for k, v in resume.order.items() if k not in _PROGRESS}
            self._base = resume.order["consumed"]
            rest = remap.remainder_batches(
                self.loader, resume.order, self._base, *self._start_state
            )
            self._carried_batches = len(rest)
            loader, skip = _rebuilt(self.loader, {"batch_sampler": rest}), 0
        elif method in ("loader_state", "stream_state"):
            assert resume is not None
            self._source().load_state_dict(resume.source_state)
        elif method == "planned_sampler":
            batches: Any = self.loader.batch_sampler
            batches.load_state_dict({**batches.state_dict(), "batches_yielded": skip})
        elif method == "indices":
            loader = _fast_forwarded(self.loader, skip)
        self.epoch += 1
        self.batches, self._in_epoch = skip, True
        iterator = iter(loader)
        for _ in range(skip if method == "drain" else 0):
            next(iterator, None)
        current = self._fetch(iterator)
        if resume is not None and self._after_resume is not None:
            self._after_resume()
        if current is _END:
            self._in_epoch = False
            return
        yield from self._yield_ahead(iterator, current)

    def _yield_ahead(self, iterator: Iterator[Any], current: Any) -> Iterator[Any]:
        while True:
            # Taken before the next batch is fetched: the state with ``current`` the last one.
            state = self._capture()
            try:
                upcoming = self._fetch(iterator, ahead=1)
            except SampleDtypeError:
                # The batch in hand is good: trained first, so that the failure loses nothing.
                self.batches += 1
                self._source_state = state
                yield current
                raise
            if upcoming is _END:
                break
            self.batches += 1
            self._source_state = state
            yield current
            current = upcoming
        self._at_last_batch = True
        self.batches += 1
        self._source_state = state
        try:
            yield current
        finally:
            self._at_last_batch = False
        self._in_epoch = False

    def _fetch(self, iterator: Iterator[Any], ahead: int = 0) -> Any:
        """The next batch (``_END`` after the last); a sample of another dtype than its batch's
        others is named by its dataset index and its place in the epoch."""
        try:
            return next(iterator, _END)
        except SampleDtypeError as err:
            batch = self.batches + ahead  # 0-based in the epoch
            where = f"epoch {self.epoch - 1}, {batch} batches in"
            raise self._named(err, batch, where) from err

    def _named(self, err: SampleDtypeError, batch: int, where: str) -> SampleDtypeError:
        """``err`` with the dataset index of its sample, found by drawing the batch's indices
        again from the epoch's random state and checking those samples here (a worker's error
        keeps only its message)."""
        indices = self._indices_of(batch)
        if indices is not None:
            try:
                check_dtypes([self.loader.dataset[i] for i in indices])
            except SampleDtypeError as found:
                assert found.position is not None
                return SampleDtypeError(
                    f"dataset sample {indices[found.position]} ({where}): {found}",
                    found.position,
                )
        return SampleDtypeError(f"{where}: {str(err).splitlines()[-1]}", err.position)

    def _indices_of(self, batch: int) -> list[int] | None:
        """The dataset indices of this rank's ``batch``-th batch of the epoch, drawn again from
        the epoch's order (``remap``: the order a resume rebuilds); None where it cannot be."""
        order = remap.spec(self.loader, self.epoch - 1)
        if order is None:
            return None
        batches = remap.remainder_batches(self.loader, order, 0, *self._start_state)
        if batch >= len(batches):
            return None
        return [int(i) for i in batches[batch]]

    def _source(self) -> Any:
        return self.loader if self._stateful == "loader_state" else self.loader.dataset

    def _capture(self) -> Any:
        return self._source().state_dict() if self._stateful is not None else None

    def _epoch_done(self) -> bool:
        if self._carried_batches is not None:
            return self.batches >= self._carried_batches
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


def _stateful_source(loader: DataLoader) -> str | None:
    """Which part of ``loader`` saves its own position: the loader itself, a stream read in the
    main process (a stream's state in worker processes is out of reach), or none."""
    if _has_state(loader):
        return "loader_state"
    if isinstance(loader.dataset, IterableDataset) and _has_state(loader.dataset):
        return "stream_state" if loader.num_workers == 0 else None
    return None


def _has_state(thing: Any) -> bool:
    return callable(getattr(thing, "state_dict", None)) and callable(
        getattr(thing, "load_state_dict", None)
    )


class _SkipFirst(Sampler[Any]):
    """``sampler`` without its first ``count`` items, drawn lazily on the first ``next()`` so
    that random numbers are drawn in the order the unskipped sampler draws them."""

    def __init__(self, sampler: Any, count: int) -> None:
        self.sampler, self.count = sampler, count

    def __iter__(self) -> Iterator[Any]:
        items = iter(self.sampler)
        for _ in range(self.count):
            next(items, None)
        yield from items

    def __len__(self) -> int:
        return max(0, len(self.sampler) - self.count)


def _fast_forwarded(loader: DataLoader, skip: int) -> DataLoader:
    """A DataLoader like ``loader`` (same dataset, workers, collate, generator) whose batches
    start after its first ``skip``: their indices are drawn, their samples are not loaded.
    For one epoch: a DataLoader's sampler cannot be replaced once it is built."""
    batched = loader.batch_sampler is not None
    samplers: dict[str, Any] = (
        {"batch_sampler": _SkipFirst(loader.batch_sampler, skip)}
        if batched
        else {"sampler": _SkipFirst(loader.sampler, skip), "batch_size": None}
    )
    return _rebuilt(loader, samplers)


def _rebuilt(loader: DataLoader, samplers: dict[str, Any]) -> DataLoader:
    """A DataLoader like ``loader`` (same dataset, workers, collate, generator) with other
    ``samplers`` (``batch_sampler=``, or ``sampler=`` and ``batch_size=``)."""
    return DataLoader(
        loader.dataset,
        **samplers,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,
        prefetch_factor=loader.prefetch_factor,
        persistent_workers=loader.persistent_workers,
        pin_memory_device=loader.pin_memory_device,
        in_order=loader.in_order,
    )


_END = object()
#: The keys of a position's order that say how far it got, not what the order is.
_PROGRESS = ("consumed", "remapped")
