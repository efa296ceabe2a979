"""BucketBatchSampler: coverage, budget, equal batch counts across ranks, determinism, resume,
and the padding it removes."""

from __future__ import annotations

from collections import Counter
from functools import partial

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from torchturbo.data.bucketing import BucketBatchSampler, pack_batches, padding_fraction
from torchturbo.data.collate import pad_collate


def long_tailed_lengths(n: int, seed: int = 0) -> list[int]:
    """Text-like lengths: most between 16 and 64, a lognormal tail up to 512."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(32), 0.7, n).astype(int), 4, 512).tolist()


def rank_batches(lengths, num_replicas: int, **kwargs) -> list[list[list[int]]]:
    samplers = [
        BucketBatchSampler(lengths, num_replicas=num_replicas, rank=r, **kwargs)
        for r in range(num_replicas)
    ]
    return [list(s) for s in samplers]


def padded_tokens(batch: list[int], lengths, multiple: int = 1) -> int:
    return len(batch) * -(-max(lengths[i] for i in batch) // multiple) * multiple


@pytest.mark.parametrize("num_replicas", [1, 2, 3, 4])
def test_every_sample_exactly_once_when_batches_divide_evenly(num_replicas):
    # 36 samples in rows of 3 make 12 batches, divisible by 1, 2, 3 and 4: no padding needed.
    lengths = long_tailed_lengths(36)
    per_rank = rank_batches(lengths, num_replicas, batch_size=3)
    assert {len(batches) for batches in per_rank} == {12 // num_replicas}
    seen = [i for batches in per_rank for batch in batches for i in batch]
    assert sorted(seen) == list(range(36))


@pytest.mark.parametrize("num_replicas", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [1, 7, 101, 997])
@pytest.mark.parametrize("drop_last", [False, True])
def test_equal_batch_counts_and_documented_coverage(num_replicas, n, drop_last):
    lengths = long_tailed_lengths(n, seed=n)
    kwargs = {"max_tokens": 1024, "pad_to_multiple": 8, "drop_last": drop_last, "seed": 3}
    per_rank = rank_batches(lengths, num_replicas, **kwargs)
    counts = {len(batches) for batches in per_rank}
    assert len(counts) == 1, f"ranks got different batch counts {counts}: DDP would hang"
    assert counts == {len(BucketBatchSampler(lengths, **kwargs, num_replicas=num_replicas))}

    global_batches = BucketBatchSampler(lengths, **kwargs).global_batches()
    total = len(global_batches)
    seen = Counter(i for batches in per_rank for batch in batches for i in batch)
    if drop_last:
        # The last total % R global batches are dropped, every other sample appears once.
        dropped = {i for batch in global_batches[total - total % num_replicas :] for i in batch}
        assert counts == {total // num_replicas}
        assert set(seen) == set(range(n)) - dropped
        assert set(seen.values()) <= {1}
    else:
        # Padding repeats the first global batches (cyclically), fewer than R of them.
        slots = -(-total // num_replicas) * num_replicas
        assert slots - total < num_replicas
        expected = Counter(i for k in range(slots) for i in global_batches[k % total])
        assert seen == expected
        assert set(seen) == set(range(n))
        if total % num_replicas == 0:
            assert set(seen.values()) == {1}


def test_token_budget_never_exceeded_and_mostly_filled():
    lengths = long_tailed_lengths(5000)
    sampler = BucketBatchSampler(lengths, max_tokens=2048, pad_to_multiple=8)
    batches = sampler.global_batches()
    used = [padded_tokens(batch, lengths, 8) for batch in batches]
    assert max(used) <= 2048
    # Bucketing should pack the budget tightly, not just respect it.
    assert np.mean(used) >= 0.9 * 2048


def test_batch_size_mode_caps_rows():
    lengths = long_tailed_lengths(103)
    batches = BucketBatchSampler(lengths, batch_size=8).global_batches()
    assert max(len(b) for b in batches) == 8
    assert sorted(i for b in batches for i in b) == list(range(103))


def test_deterministic_per_seed_and_epoch():
    lengths = long_tailed_lengths(500)
    a = BucketBatchSampler(lengths, max_tokens=1024, seed=5)
    b = BucketBatchSampler(lengths, max_tokens=1024, seed=5)
    assert list(a) == list(b)
    epoch0 = list(a)
    a.set_epoch(1)
    b.set_epoch(1)
    assert list(a) == list(b)
    assert list(a) != epoch0
    other_seed = BucketBatchSampler(lengths, max_tokens=1024, seed=6)
    assert list(other_seed) != epoch0


def test_no_shuffle_is_the_same_every_epoch():
    lengths = long_tailed_lengths(300)
    sampler = BucketBatchSampler(lengths, max_tokens=1024, shuffle=False)
    first = list(sampler)
    sampler.set_epoch(7)
    assert list(sampler) == first


@pytest.mark.parametrize("num_replicas, rank", [(1, 0), (2, 1)])
def test_resume_mid_epoch_yields_exactly_the_remaining_batches(num_replicas, rank):
    lengths = long_tailed_lengths(800)
    kwargs = {"max_tokens": 1024, "seed": 11, "num_replicas": num_replicas, "rank": rank}
    original = BucketBatchSampler(lengths, **kwargs)
    original.set_epoch(2)
    full_epoch = list(original)
    iterator = iter(original)
    consumed = [next(iterator) for _ in range(5)]
    state = original.state_dict()
    assert state["batches_yielded"] == 5 and state["epoch"] == 2

    # Built with another seed: the state carries the seed the epoch was planned with.
    resumed = BucketBatchSampler(lengths, **(kwargs | {"seed": 0}))
    resumed.load_state_dict(state)
    resumed.set_epoch(2)  # what a training loop does at the top of the epoch: must keep position
    rest = list(resumed)
    assert consumed + rest == full_epoch
    # Negative control: without the state a sampler starts the epoch over.
    fresh = BucketBatchSampler(lengths, **kwargs)
    fresh.set_epoch(2)
    assert list(fresh) != rest
    # Once the resumed epoch is done, the next one is complete again.
    resumed.set_epoch(3)
    original.set_epoch(3)
    assert list(resumed) == list(original)


def test_state_counts_batches_drawn_by_a_dataloader():
    lengths = long_tailed_lengths(200)
    dataset = [
        {"tokens": torch.ones(n, dtype=torch.int64), "labels": torch.ones(n, dtype=torch.int64)}
        for n in lengths
    ]
    sampler = BucketBatchSampler(lengths, max_tokens=512)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=pad_collate)
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
    assert sampler.state_dict()["batches_yielded"] == 3


def test_dataloader_batches_are_integral_masked_and_within_budget():
    lengths = long_tailed_lengths(300)
    generator = torch.Generator().manual_seed(0)
    dataset = []
    for n in lengths:
        tokens = torch.randint(1, 1000, (n,), generator=generator)
        dataset.append({"tokens": tokens, "labels": tokens.roll(-1)})
    sampler = BucketBatchSampler(lengths, max_tokens=1024, pad_to_multiple=8)
    collate = partial(pad_collate, pad_to_multiple=8)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate)
    rows = 0
    for batch in loader:
        assert batch["tokens"].dtype == torch.int64
        assert batch["tokens"].shape[1] % 8 == 0
        assert batch["tokens"].numel() <= 1024
        assert torch.equal(batch["mask"].sum(1), batch["lengths"])
        rows += len(batch["lengths"])
    assert rows == len(lengths)


def test_bucketing_removes_most_padding_on_long_tailed_lengths():
    lengths = long_tailed_lengths(20_000)
    bucketed = BucketBatchSampler(lengths, max_tokens=4096).global_batches()
    order = np.random.default_rng(0).permutation(len(lengths)).tolist()
    naive = pack_batches(order, lengths, max_tokens=4096)
    # Measured here: bucketed 3.3%, naive 69% (same budget of padded tokens per batch).
    assert padding_fraction(bucketed, lengths) <= 0.05
    assert padding_fraction(naive, lengths) >= 0.5


def test_padding_fraction_counts_padding_over_padded_tokens():
    lengths = [2, 4, 5]
    assert padding_fraction([[0, 1]], lengths) == pytest.approx(2 / 8)
    assert padding_fraction([[0, 1], [2]], lengths) == pytest.approx(2 / 13)
    assert padding_fraction([[0, 1]], lengths, pad_to_multiple=8) == pytest.approx(10 / 16)


def test_single_process_defaults_to_one_replica():
    sampler = BucketBatchSampler([3, 4, 5], batch_size=2)
    assert (sampler.num_replicas, sampler.rank) == (1, 0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "exactly one of max_tokens"),
        ({"max_tokens": 64, "batch_size": 4}, "exactly one of max_tokens"),
        ({"max_tokens": 0}, "max_tokens must be a positive int"),
        ({"batch_size": 2.5}, "batch_size must be a positive int"),
        ({"batch_size": 4, "pad_to_multiple": 0}, "pad_to_multiple"),
        ({"batch_size": 4, "mega_batch_size": 0}, "mega_batch_size"),
        ({"batch_size": 4, "seed": -1}, "seed must be a non-negative int"),
        ({"batch_size": 4, "num_replicas": 2, "rank": 2}, r"rank must be in \[0, 1\]"),
        ({"batch_size": 4, "num_replicas": 0, "rank": 0}, "num_replicas must be a positive int"),
    ],
)
def test_bad_arguments_raise_naming_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BucketBatchSampler([5, 9, 3], **kwargs)


def test_sample_longer_than_budget_is_named_not_dropped():
    with pytest.raises(ValueError, match=r"sample 2 has length 70 \(padded to 72\)"):
        BucketBatchSampler([5, 9, 70, 80], max_tokens=64, pad_to_multiple=8)
    with pytest.raises(ValueError, match="sample 1 has length 70"):
        pack_batches([0, 1], [5, 70], max_tokens=64)


@pytest.mark.parametrize(
    "lengths, message",
    [([], "non-empty"), ([1.5, 2.0], "dtype float64"), ([[1, 2]], "1-D"), ([3, 0], "sample 1")],
)
def test_bad_lengths_raise(lengths, message):
    with pytest.raises(ValueError, match=message):
        BucketBatchSampler(lengths, batch_size=2)


def test_bad_state_raises():
    sampler = BucketBatchSampler(long_tailed_lengths(50), batch_size=4, num_replicas=2, rank=0)
    state = sampler.state_dict()
    single = BucketBatchSampler(long_tailed_lengths(50), batch_size=4)
    with pytest.raises(ValueError, match="num_replicas=2"):
        single.load_state_dict(state)
    with pytest.raises(ValueError, match="missing"):
        sampler.load_state_dict({"epoch": 0})
    with pytest.raises(ValueError, match="batches_yielded=99"):
        sampler.load_state_dict(state | {"batches_yielded": 99})
    with pytest.raises(ValueError, match="no tokens"):
        padding_fraction([], [1, 2])
