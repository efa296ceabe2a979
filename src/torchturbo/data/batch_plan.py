"""The batch plan: which samples form each batch and how they are collated, decided in one place.

A technique that changes the batches (length buckets, packing) declares a ``batches`` hook
(``techniques/framework/spec.py``) that turns the config and a :class:`BatchSource` (what the host
knows of its data) into a :class:`BatchPlan`: a batch sampler and a collate. ``registry.batch_plan``
picks the one the config asks for, and every host builds its batches from that plan: the engine's
loader (``train``, ``Turbo.setup``), ``TurboTrainer``, the Lightning callback and the tuner's
trials. So the batches a trial measures are the batches the job trains on, for the same config
and seed. Without such a technique the plan is the host's own batches (``BatchPlan.rows``).

**The user's tokens per step.** A dynamic plan draws as many batches per epoch as the user's
batches of ``batch_size`` rows would be (:func:`matched_budget`), so its batches hold, on
average, the real tokens of the user's batch: a job of ``max_steps`` trains on the same data, and
an epoch takes the same number of steps. A budget counted in padded tokens (batch size x mean
length) would hold fewer real tokens per step than the user's batches (16% fewer was measured on a
Trainer job of long-tailed text) and train a smaller job in the same steps. ``[data] max_tokens``
sets the budget by hand instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

#: Lengths above this many samples are matched on a seeded sample of them: the plan's count is a
#: ratio of sums, and planning every length of a huge dataset a dozen times would take minutes.
MATCH_SAMPLES = 20_000


@runtime_checkable
class PlannedSampler(Protocol):
    """What resuming and remapping read of a batch plan's sampler, whatever its technique: a
    plan of whole batches that is a function of (seed, epoch) (``global_batches``), shared out
    to ``num_replicas`` ranks, and its position in the epoch. ``BucketBatchSampler`` and
    ``PackingBatchSampler`` are such samplers; a new plan's sampler needs only these."""

    num_replicas: int
    rank: int
    seed: int
    epoch: int
    drop_last: bool

    def __iter__(self) -> Iterator[list[int]]: ...

    def set_epoch(self, epoch: int) -> None: ...

    def global_batches(self) -> list[list[int]]: ...

    def state_dict(self) -> dict[str, int]: ...

    def load_state_dict(self, state: dict[str, int]) -> None: ...


@dataclass(frozen=True)
class BatchSource:
    """What a host knows of the data it trains on.

    ``batch_size`` is the user's rows per batch on one rank; ``num_replicas`` and ``rank`` say how
    whole batches are shared out (1 and 0 where the host shards batches itself, as accelerate
    does). ``collate`` is the host's collate (None: ``pad_collate``). ``model`` returns the
    model the batches feed (built on first call where the host has none yet): packing reads its
    forward's arguments and checks that it keeps documents apart. ``lengths_from`` says how this
    host is given lengths, for the error when it has none.
    """

    dataset: Any
    lengths: Sequence[int] | None
    batch_size: int | None
    seed: int = 0
    num_replicas: int = 1
    rank: int = 0
    collate: Callable[[list[Any]], Any] | None = None
    pad_values: Mapping[str, int] | None = None
    model: Callable[[], nn.Module] | None = None
    lengths_from: str = "give the recipe lengths=[...] (one per sample)"

    def require_lengths(self, plan: str) -> Sequence[int]:
        """The per-sample lengths, or a clear error naming the ``[data] batches`` plan that
        needs them."""
        if isinstance(self.dataset, IterableDataset):
            raise ValueError(
                f"[data] batches = {plan!r} plans batches by per-sample length, and the dataset "
                f"is a stream ({type(self.dataset).__name__}, an IterableDataset) with no index "
                "to plan by: use [data] batches = 'rows', or a map-style dataset (__len__ and "
                "__getitem__) with its lengths"
            )
        if self.lengths is None:
            raise ValueError(
                f"[data] batches = {plan!r} needs per-sample lengths: {self.lengths_from}"
            )
        return self.lengths


@dataclass(frozen=True)
class BatchPlan:
    """Batches as a host builds them: ``sampler`` yields each batch's indices and ``collate`` turns
    the samples into the batch. Both None: the host's own batches (its sampler and collate).

    ``kind`` names the plan ("rows", "buckets", "packed"); ``max_tokens`` is its token budget per
    batch and ``budget_note`` how that budget was chosen, in words.
    """

    kind: str
    sampler: Any = None
    collate: Callable[[list[Any]], Any] | None = None
    max_tokens: int | None = None
    budget_note: str = ""

    @classmethod
    def rows(cls) -> BatchPlan:
        """The host's own batches: no technique changes them."""
        return cls("rows")

    @property
    def dynamic(self) -> bool:
        """Whether the plan chooses the batches itself (a batch sampler of its own)."""
        return self.sampler is not None

    def loader(
        self,
        dataset: Any,
        *,
        num_workers: int = 0,
        pin_memory: bool = False,
        persistent_workers: bool = False,
        prefetch_factor: int | None = None,
        worker_init_fn: Callable[[int], None] | None = None,
    ) -> DataLoader:
        """A DataLoader over ``dataset`` with this plan's sampler and collate and a trainer's
        worker settings (those that need workers only with workers, as torch requires)."""
        return DataLoader(
            dataset,
            batch_sampler=self.sampler,
            collate_fn=self.collate,
            num_workers=num_workers,
            pin_memory=pin_memory,
            persistent_workers=persistent_workers and num_workers > 0,
            prefetch_factor=prefetch_factor if num_workers > 0 else None,
            worker_init_fn=worker_init_fn,
        )

    def first_batches(self, dataset: Any, count: int) -> list[Any]:
        """The first ``count`` collated batches of the plan's first epoch, as a loader over
        ``dataset`` with this sampler and collate yields them (the tuner's trials train on
        these)."""
        if self.sampler is None or self.collate is None:
            raise ValueError(f"the {self.kind!r} plan has no batches of its own to draw")
        batches = []
        for indices in self.sampler:
            batches.append(self.collate([dataset[i] for i in indices]))
            if len(batches) == count:
                break
        return batches


def collated_fields(
    collate: Callable[[list[Any]], Any] | None, dataset: Any
) -> frozenset[str] | None:
    """The fields of a dict sample that the host's ``collate`` keeps (a Trainer's collate drops
    the columns its model does not take, such as raw text), plus ``input_ids`` and ``labels``;
    None when that cannot be told (no collate, or samples that are not dicts)."""
    first = dataset[0]
    if collate is None or not isinstance(first, Mapping):
        return None
    collated = collate([first])
    if not isinstance(collated, Mapping):
        return None
    return frozenset({*collated, "input_ids", "labels"})


def keep_fields(
    collate: Callable[[list[Any]], Any], fields: frozenset[str] | None
) -> Callable[[list[Any]], Any]:
    """``collate`` over dict samples stripped to ``fields`` (None: as they are)."""
    if fields is None:
        return collate
    return _FieldCollate(collate, fields)


@dataclass(frozen=True)
class _FieldCollate:
    """A picklable collate (loader workers pickle it) that keeps only some sample fields."""

    collate: Callable[[list[Any]], Any]
    fields: frozenset[str]

    def __call__(self, samples: list[Any]) -> Any:
        kept = [
            {k: v for k, v in s.items() if k in self.fields} if isinstance(s, Mapping) else s
            for s in samples
        ]
        return self.collate(kept)


def user_batches(samples: int, batch_size: int) -> int:
    """The user's batches in an epoch of ``samples``: the last one may be short."""
    return math.ceil(samples / batch_size)


def matched_budget(
    lengths: Sequence[int],
    batch_size: int,
    count: Callable[[Sequence[int], int], int],
    *,
    smallest: int,
    seed: int = 0,
) -> int:
    """The smallest token budget at which a plan draws no more batches per epoch than the user's
    batches of ``batch_size`` rows: its batches then hold, on average, the real tokens of the
    user's batch (every epoch's tokens over the same number of steps).

    ``count(lengths, budget)`` is the plan's batches in an epoch at that budget (near enough
    non-increasing in it); ``smallest`` the least budget the plan takes (its longest sample,
    padded). Found by bisection; above :data:`MATCH_SAMPLES` samples, on a seeded sample of the
    lengths, which keeps the ratio of real tokens to batches.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    sample = _sampled(lengths, seed)
    target = user_batches(len(sample), batch_size)
    low, high = smallest, max(smallest, 2 * batch_size * max(int(n) for n in sample))
    if count(sample, low) <= target:
        return low
    while count(sample, high) > target:  # partial batches at mega-batch edges: widen
        high *= 2
    while high - low > 1:  # count(low) > target >= count(high)
        middle = (low + high) // 2
        if count(sample, middle) <= target:
            high = middle
        else:
            low = middle
    return high


def token_budget(
    max_tokens: int | None,
    source: BatchSource,
    sampler: Callable[[Sequence[int], int], Any],
    *,
    plan: str,
    smallest: int,
    unit: str,
) -> tuple[int, str]:
    """A plan's token budget and how it was chosen, in words: ``[data] max_tokens`` when set,
    else :func:`matched_budget` over the batches ``sampler(lengths, budget)`` draws in an
    epoch (a batch sampler with ``global_batches()``)."""
    if max_tokens is not None:
        return max_tokens, f"[data] max_tokens = {max_tokens}"
    lengths = source.require_lengths(plan)
    if source.batch_size is None:
        raise ValueError(
            f"[data] batches = {plan!r} without max_tokens needs the batch size, to keep the "
            "real tokens of its batches per step"
        )
    budget = matched_budget(
        lengths,
        source.batch_size,
        lambda sample, budget: len(sampler(sample, budget).global_batches()),
        smallest=smallest,
        seed=source.seed,
    )
    return budget, f"{budget} {unit}: the real tokens of batches of {source.batch_size} rows"


def _sampled(lengths: Sequence[int], seed: int) -> list[int]:
    if len(lengths) <= MATCH_SAMPLES:
        return [int(n) for n in lengths]
    chosen = np.random.default_rng(seed).choice(len(lengths), MATCH_SAMPLES, replace=False)
    return [int(lengths[i]) for i in chosen]


def real_tokens(batches: Iterable[Sequence[int]], lengths: Sequence[int]) -> list[int]:
    """The real (unpadded) tokens of each batch of sample indices."""
    return [sum(int(lengths[i]) for i in batch) for batch in batches]
