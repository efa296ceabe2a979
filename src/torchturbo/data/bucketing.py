"""Length-bucketed dynamic batching: a batch sampler that fills a token budget and shards whole
batches across ranks with the same batch count on every rank.

Padding is wasted compute. Sorting inside a random batch removes none of it (the longest sample
still sets the padded length), and ``DistributedSampler`` with ``batch_size=None`` hands single
samples to the collate function. What removes padding is putting samples of similar length in the
same batch; what keeps memory flat is a budget of *padded* tokens per batch instead of a fixed
number of rows.

Per epoch, deterministically in ``(seed, epoch)`` so that every rank computes the same plan without
communicating:

1. shuffle all sample indices;
2. split them into mega-batches of about ``mega_batch_size`` batches' worth of tokens;
3. sort each mega-batch by length and cut it into batches that fill the budget;
4. shuffle the order of the batches;
5. shard whole batches across ranks (rank r takes batches r, r+R, ...), padding by repetition
   (``drop_last=False``) or dropping the remainder (``drop_last=True``) so that every rank gets the
   same number of batches. Unequal counts make DDP hang in its next all-reduce (Lightning #18023,
   DeepSpeed #1051).

Mega-batches trade padding against randomness: sorting the whole dataset pads least, but then each
sample keeps the same neighbours every epoch; a mega-batch of ~64 batches already removes nearly all
padding on long-tailed text lengths while neighbours still change from epoch to epoch.

Why hand-written: torch has no length-aware batch sampler; torchdata's ``bucketbatch`` went away
with DataPipes; Hugging Face's ``LengthGroupedSampler`` yields single indices for a fixed row
count, with no token budget; fairseq's ``batch_by_size`` would bring in all of fairseq.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch.distributed as dist
from torch.utils.data import Sampler

from torchturbo.data.shapes import rung

__all__ = ["BucketBatchSampler", "pack_batches", "padding_fraction"]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _padder(pad_to_multiple: int, ladder: Sequence[int]) -> Callable[[int], int]:
    """A batch's padded length from its longest sample's: up the ladder when there is one
    (``data/shapes.py``), else up to the multiple."""
    if ladder:
        return functools.partial(rung, tuple(ladder))
    return functools.partial(_round_up, multiple=pad_to_multiple)


def _check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _check_lengths(lengths: Sequence[int]) -> np.ndarray:
    array = np.asarray(lengths)
    if array.ndim != 1 or array.size == 0 or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(
            "lengths must be a non-empty 1-D sequence of ints (one token count per sample), got "
            f"shape {array.shape} and dtype {array.dtype}"
        )
    bad = np.flatnonzero(array < 1)
    if bad.size:
        raise ValueError(
            f"lengths must be >= 1; sample {int(bad[0])} has length {int(array[bad[0]])} "
            f"({bad.size} samples in all)"
        )
    return array.astype(np.int64)


def _check_budget(max_tokens: int | None, batch_size: int | None) -> None:
    if (max_tokens is None) == (batch_size is None):
        raise ValueError(
            "give exactly one of max_tokens (a budget of padded tokens per batch) or batch_size "
            f"(rows per batch); got max_tokens={max_tokens!r}, batch_size={batch_size!r}"
        )
    if max_tokens is not None:
        _check_positive_int("max_tokens", max_tokens)
    if batch_size is not None:
        _check_positive_int("batch_size", batch_size)


def _check_fits(lengths: np.ndarray, max_tokens: int, pad: Callable[[int], int]) -> None:
    """Every sample must fit the budget on its own: dropping it silently would lose data."""
    distinct, where = np.unique(lengths, return_inverse=True)
    padded = np.array([pad(int(n)) for n in distinct])[where]
    too_long = np.flatnonzero(padded > max_tokens)
    if too_long.size:
        first = int(too_long[0])
        raise ValueError(
            f"sample {first} has length {int(lengths[first])} (padded to {int(padded[first])}), "
            f"more than max_tokens={max_tokens}; {too_long.size} samples in all do not fit. "
            "Raise max_tokens, or truncate or filter long samples before batching"
        )


def pack_batches(
    indices: Iterable[int],
    lengths: Sequence[int],
    *,
    max_tokens: int | None = None,
    batch_size: int | None = None,
    pad_to_multiple: int = 1,
    ladder: Sequence[int] = (),
) -> list[list[int]]:
    """Cut ``indices`` into consecutive batches, in the order given, under a budget.

    With ``max_tokens`` a batch grows while ``rows x padded length`` stays within the budget
    (padded length = the batch's longest sample rounded up to ``pad_to_multiple``, or up the
    ``ladder`` of lengths when one is given); with ``batch_size`` every batch but the last has
    that many rows. The order decides the padding: sorted indices give tight batches, a random
    order gives the naive baseline.
    """
    _check_budget(max_tokens, batch_size)
    pad = _padder(_check_positive_int("pad_to_multiple", pad_to_multiple), ladder)
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for index in indices:
        length = int(lengths[index])
        grown = max(longest, length)
        if max_tokens is not None:
            full = (len(current) + 1) * pad(grown) > max_tokens
        else:
            full = len(current) == batch_size
        if current and full:
            batches.append(current)
            current, grown = [], length
        if max_tokens is not None and pad(length) > max_tokens:
            raise ValueError(
                f"sample {index} has length {length}, more than max_tokens={max_tokens} on its own"
            )
        current.append(int(index))
        longest = grown
    if current:
        batches.append(current)
    return batches


def padding_fraction(
    batches: Iterable[Sequence[int]], lengths: Sequence[int], pad_to_multiple: int = 1
) -> float:
    """Share of the padded tokens that are padding: ``(padded - real) / padded``."""
    pad_to_multiple = _check_positive_int("pad_to_multiple", pad_to_multiple)
    padded = real = 0
    for batch in batches:
        batch_lengths = [int(lengths[i]) for i in batch]
        if not batch_lengths:
            continue
        padded += len(batch_lengths) * _round_up(max(batch_lengths), pad_to_multiple)
        real += sum(batch_lengths)
    if padded == 0:
        raise ValueError("padding_fraction got no tokens: batches is empty")
    return (padded - real) / padded


def padding_fractions(lengths: Sequence[int], batch_size: int, seed: int) -> tuple[float, float]:
    """Padding share of random batches of ``batch_size``, and of length-sorted batches (the
    lower bound that bucketing approaches)."""
    order = np.random.default_rng(seed).permutation(len(lengths))
    random = pack_batches(order, lengths, batch_size=batch_size)
    by_length = pack_batches(np.argsort(lengths, kind="stable"), lengths, batch_size=batch_size)
    return padding_fraction(random, lengths), padding_fraction(by_length, lengths)


def _world(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    initialized = dist.is_available() and dist.is_initialized()
    if num_replicas is None:
        num_replicas = dist.get_world_size() if initialized else 1
    if rank is None:
        rank = dist.get_rank() if initialized else 0
    num_replicas = _check_positive_int("num_replicas", num_replicas)
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)):
        raise ValueError(f"rank must be an int, got {rank!r}")
    if not 0 <= rank < num_replicas:
        raise ValueError(f"rank must be in [0, {num_replicas - 1}] for {num_replicas=}, got {rank}")
    return num_replicas, int(rank)


class BucketBatchSampler(Sampler[list[int]]):
    """Yields lists of sample indices, bucketed by length, for ``DataLoader(batch_sampler=...)``.

    Use with ``collate_fn=pad_collate`` (``torchturbo.data.collate``), passing it the same
    ``pad_to_multiple``. Give exactly one of ``max_tokens`` (budget of *padded* tokens per batch:
    rows x longest length rounded up to ``pad_to_multiple``, or up ``ladder``, a few fixed
    lengths: ``data/shapes.py``) or ``batch_size`` (rows per batch).
    ``mega_batch_size`` is the number of batches' worth of samples sorted together.

    Distributed: ``num_replicas``/``rank`` default to the initialized process group, else 1/0.
    Every rank gets the same number of batches. With ``drop_last=False`` the global batch list is
    padded by repeating its first batches, so every sample appears at least once and the samples
    of at most ``num_replicas - 1`` batches appear twice (more often only when there are fewer
    batches than ranks); with ``drop_last=True`` the last
    ``len(global batches) % num_replicas`` batches (random ones, after the shuffle) are dropped.

    Call :meth:`set_epoch` with the same epoch on every rank before each epoch. With
    ``max_tokens`` the number of batches can change by a few from one epoch to the next.
    :meth:`state_dict` / :meth:`load_state_dict` resume mid-epoch: the position counts the
    batches this sampler has handed out; a DataLoader with workers draws
    ``num_workers * prefetch_factor`` batches ahead of training, so when resuming from such a
    loader set ``state["batches_yielded"]`` to the number of steps actually trained.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        *,
        max_tokens: int | None = None,
        batch_size: int | None = None,
        pad_to_multiple: int = 1,
        ladder: Sequence[int] = (),
        mega_batch_size: int = 64,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        self.lengths = _check_lengths(lengths)
        _check_budget(max_tokens, batch_size)
        self.max_tokens = max_tokens
        self.batch_size = batch_size
        self.pad_to_multiple = _check_positive_int("pad_to_multiple", pad_to_multiple)
        self.ladder = tuple(int(n) for n in ladder)
        self.mega_batch_size = _check_positive_int("mega_batch_size", mega_batch_size)
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.num_replicas, self.rank = _world(num_replicas, rank)
        if max_tokens is not None:
            _check_fits(self.lengths, max_tokens, _padder(self.pad_to_multiple, self.ladder))
        self._length_list = self.lengths.tolist()  # Python ints: the packing loop is per sample
        self.epoch = 0
        self._plan_key: tuple[int, int] | None = None
        self._plan: list[list[int]] = []
        self._resume_at = 0  # where the next __iter__ starts; set only by load_state_dict
        self._yielded = 0  # batches of the current epoch handed out so far

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose plan the next iteration yields (same value on every rank)."""
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative int, got {epoch!r}")
        if epoch != self.epoch:
            # Keep a position just restored by load_state_dict when the training loop then calls
            # set_epoch with the restored epoch, as loops do at the top of every epoch.
            self.epoch = int(epoch)
            self._resume_at = self._yielded = 0

    def global_batches(self) -> list[list[int]]:
        """All batches of the current epoch, before sharding, in the order ranks take them."""
        generator = np.random.default_rng([self.seed, self.epoch])
        n = len(self._length_list)
        order = generator.permutation(n) if self.shuffle else np.arange(n)
        batches: list[list[int]] = []
        for mega in self._mega_batches(order):
            # Stable sort: equal lengths keep their shuffled order, so the plan is deterministic.
            ranked = mega[np.argsort(self.lengths[mega], kind="stable")]
            batches += pack_batches(
                ranked.tolist(),
                self._length_list,
                max_tokens=self.max_tokens,
                batch_size=self.batch_size,
                pad_to_multiple=self.pad_to_multiple,
                ladder=self.ladder,
            )
        if self.shuffle:
            batches = [batches[i] for i in generator.permutation(len(batches))]
        return batches

    def _mega_batches(self, order: np.ndarray) -> list[np.ndarray]:
        if self.batch_size is not None:
            size = self.mega_batch_size * self.batch_size
            return [order[i : i + size] for i in range(0, len(order), size)]
        # About mega_batch_size budgets of real tokens per mega-batch; the cut is approximate
        # because padding is not known until the mega-batch has been packed.
        assert self.max_tokens is not None  # _check_budget: one of the two is set
        tokens_per_mega = self.mega_batch_size * self.max_tokens
        cumulative = np.cumsum(self.lengths[order])
        thresholds = np.arange(tokens_per_mega, cumulative[-1], tokens_per_mega)
        # Cut after the first sample whose running total reaches each threshold.
        cuts = np.unique(np.searchsorted(cumulative, thresholds) + 1)
        return [mega for mega in np.split(order, cuts) if mega.size]

    def _rank_plan(self) -> list[list[int]]:
        key = (self.seed, self.epoch)
        if self._plan_key != key:
            batches = self.global_batches()
            total = len(batches)
            per_rank = (
                total // self.num_replicas if self.drop_last else -(-total // self.num_replicas)
            )
            # Padding repeats batches from the start of the (shuffled) list, cyclically, so it also
            # works when there are fewer batches than ranks.
            kept = [batches[i % total] for i in range(per_rank * self.num_replicas)]
            self._plan = kept[self.rank :: self.num_replicas]
            self._plan_key = key
        return self._plan

    def __len__(self) -> int:
        """This rank's number of batches in the current epoch (the same on every rank)."""
        return len(self._rank_plan())

    def __iter__(self) -> Iterator[list[int]]:
        plan = self._rank_plan()
        start, self._resume_at = self._resume_at, 0
        self._yielded = start
        return self._iterate(plan, start)

    def _iterate(self, plan: list[list[int]], start: int) -> Iterator[list[int]]:
        for position in range(start, len(plan)):
            self._yielded = position + 1
            yield list(plan[position])  # a copy: callers may mutate what they receive

    def state_dict(self) -> dict[str, int]:
        """Epoch, seed and this rank's position in the epoch, to resume mid-epoch."""
        return {
            "epoch": self.epoch,
            "seed": self.seed,
            "batches_yielded": self._yielded,
            "num_replicas": self.num_replicas,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore a :meth:`state_dict`; the next iteration yields the rest of that epoch."""
        missing = {"epoch", "seed", "batches_yielded", "num_replicas"} - set(state)
        if missing:
            raise ValueError(f"state is missing {sorted(missing)}; pass a dict from state_dict()")
        if state["num_replicas"] != self.num_replicas:
            raise ValueError(
                f"state was saved with num_replicas={state['num_replicas']} but this sampler has "
                f"num_replicas={self.num_replicas}; the batch sharding would differ, so a "
                "mid-epoch resume cannot be exact"
            )
        previous = self.seed, self.epoch
        self.seed, self.epoch = int(state["seed"]), int(state["epoch"])
        position, batches = int(state["batches_yielded"]), len(self._rank_plan())
        if not 0 <= position <= batches:
            self.seed, self.epoch = previous
            raise ValueError(
                f"state batches_yielded={position} is outside [0, {batches}], this rank's batch "
                f"count for epoch {state['epoch']}"
            )
        self._resume_at = self._yielded = position
