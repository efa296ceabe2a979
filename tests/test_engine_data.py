"""Turbo.setup builds the loader from [data]: bucketing, epochs, and exact token accumulation."""

from __future__ import annotations

import copy

import pytest
import torch
from test_accumulation import TinyTagger, _relative_error, _token_loss

from torchturbo import Turbo, TurboConfig
from torchturbo.data.bucketing import padding_fraction
from torchturbo.data.collate import pad_collate


def _token_dataset(n: int = 48, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    # long-tailed lengths: most short, a few long
    lengths = [int(x) for x in (torch.rand(n, generator=generator) ** 4 * 60 + 2)]
    samples = [
        {
            "tokens": torch.randint(0, 64, (length,), generator=generator),
            "labels": torch.randint(0, 7, (length,), generator=generator),
        }
        for length in lengths
    ]
    return samples, lengths


BUCKETED = TurboConfig(device="cpu").replace(data__batches="buckets", data__max_tokens=256)


def test_setup_with_bucketing_yields_padded_bucketed_batches_with_masks():
    samples, lengths = _token_dataset()
    turbo = Turbo(BUCKETED)
    model = TinyTagger()
    _, _, loader = turbo.setup(
        model, torch.optim.SGD(model.parameters(), lr=0.1), samples, lengths=lengths
    )
    seen = []
    for batch in loader:
        assert batch["tokens"].dtype == torch.int64
        assert batch["tokens"].numel() <= 256  # the padded token budget
        assert torch.equal(batch["mask"].sum(1), batch["lengths"])
        seen.extend(batch["lengths"].tolist())
    assert sorted(seen) == sorted(lengths)  # every sample once


def test_epochs_reshuffle_the_buckets():
    samples, lengths = _token_dataset()
    turbo = Turbo(BUCKETED)
    model = TinyTagger()
    _, _, loader = turbo.setup(
        model, torch.optim.SGD(model.parameters(), lr=0.1), samples, lengths=lengths
    )
    first = [b["lengths"].tolist() for b in loader]
    second = [b["lengths"].tolist() for b in loader]
    assert first != second


def test_bucketing_without_lengths_is_a_clear_error():
    samples, _ = _token_dataset()
    model = TinyTagger()
    with pytest.raises(ValueError, match="needs per-sample lengths"):
        Turbo(BUCKETED).setup(model, torch.optim.SGD(model.parameters(), lr=0.1), samples)


def test_token_weighted_accumulation_is_exact_over_bucketed_batches():
    """One optimizer step over a whole epoch of bucketed, unequal batches = the full batch."""
    samples, lengths = _token_dataset(24)
    model = TinyTagger()
    config = BUCKETED.replace(accumulation__steps=1000)  # one window: the epoch's end closes it
    turbo = Turbo(config)
    trained = copy.deepcopy(model)
    before = [p.detach().clone() for p in trained.parameters()]
    _, _, loader = turbo.setup(
        trained, torch.optim.SGD(trained.parameters(), lr=1.0), samples, lengths=lengths
    )
    sizes = [turbo.step(_token_loss, batch).count for batch in loader]
    assert len(set(float(s) for s in sizes)) > 1 and turbo.optimizer_steps == 1
    delta = [b - p.detach() for b, p in zip(before, trained.parameters(), strict=True)]

    reference = copy.deepcopy(model)
    _token_loss(reference, pad_collate(samples))[0].backward()
    assert _relative_error(delta, [p.grad for p in reference.parameters()]) <= 1e-5


def test_bucketed_batches_pad_far_less_than_random_ones():
    samples, lengths = _token_dataset(400)
    turbo = Turbo(BUCKETED)
    model = TinyTagger()
    _, _, loader = turbo.setup(
        model, torch.optim.SGD(model.parameters(), lr=0.1), samples, lengths=lengths
    )
    sampler = loader.loader.batch_sampler
    bucketed = padding_fraction(list(sampler), lengths)
    random_batches = torch.randperm(400).split(8)
    naive = padding_fraction([b.tolist() for b in random_batches], lengths)
    assert bucketed < 0.1 < 0.4 < naive


def test_a_stream_is_dealt_out_to_ranks_an_equal_share_each():
    from torchturbo.data.streams import RankShare

    class Count(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(11))

    shares = [list(RankShare(Count(), 3, rank)) for rank in range(3)]
    assert shares == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]  # 9 and 10: an incomplete round
    with pytest.raises(TypeError):
        len(RankShare(Count(), 3, 0))  # the stream has no len(), nor has its share


def test_lengths_given_for_a_stream_say_what_to_do():
    from torchturbo import Recipe
    from torchturbo.recipe import RecipeError

    class Rows(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter([])

    with pytest.raises(RecipeError, match=r"the dataset is a stream .* drop lengths="):
        Recipe(
            name="stream",
            model=lambda: torch.nn.Linear(2, 2),
            optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
            loss_fn=lambda model, batch: model(batch).sum(),
            dataset=Rows(),
            batch_size=2,
            lengths=[3, 4],
        )


def test_a_length_plan_on_a_stream_says_what_to_do():
    from torchturbo.data.batch_plan import BatchSource

    class Rows(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter([])

    with pytest.raises(ValueError, match=r"a stream \(Rows, an IterableDataset\) with no index"):
        BatchSource(Rows(), None, 4).require_lengths("buckets")
