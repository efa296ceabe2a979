"""``[data] max_shapes``: the planned batches take a few shapes, every sample still once an epoch,
the loss and gradients of the padded batch are the unpadded batch's, and a shape-specialised
compile builds one graph per shape (what CUDA graphs need to be replayed, not recorded anew)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import pytest
import torch

from torchturbo import TurboConfig
from torchturbo.base.compiler import compiled_graphs
from torchturbo.data.collate import IGNORE_INDEX, pad_collate
from torchturbo.data.shapes import length_ladder, pad_batch, rung
from torchturbo.techniques import registry
from torchturbo.trials.trial import recipe_source
from torchturbo.workloads import get_workload
from torchturbo.workloads.text import loss_fn as text_loss

CPU = TurboConfig(device="cpu")
SHAPES = 4


def text_recipe() -> Any:
    return get_workload("text", num_samples=256, batch_size=8)


def epoch(config: TurboConfig, recipe: Any) -> tuple[list[list[int]], list[Any]]:
    """One epoch of ``config``'s plan: each batch's sample indices and the collated batch."""
    plan = registry.batch_plan(config, recipe_source(recipe))
    indices = [list(batch) for batch in plan.sampler]
    return indices, [plan.collate([recipe.dataset[i] for i in batch]) for batch in indices]


def shapes(batches: list[Any], key: str) -> Counter:
    return Counter(tuple(batch[key].shape) for batch in batches)


def test_the_ladder_has_at_most_the_count_of_rungs_and_holds_every_length():
    lengths = [3, 5, 8, 13, 21, 34, 55, 89, 144, 233]
    ladder = length_ladder(lengths, 4, pad_to_multiple=8)
    assert len(ladder) <= 4 and ladder[-1] >= max(lengths)
    assert all(n % 8 == 0 for n in ladder)
    assert all(rung(ladder, n) >= n for n in lengths)
    assert length_ladder(lengths, 1) == (233,)
    with pytest.raises(ValueError, match="longer than the ladder's longest"):
        rung(ladder, 1000)


def test_the_ladder_pads_least_of_any_choice_of_its_rungs():
    import itertools
    import random

    def positions(ladder, lengths):
        return sum(rung(ladder, n) for n in lengths)

    rng = random.Random(0)
    for _ in range(300):
        lengths = [rng.choice([1, 2, 2, 3, 5, 8, 8, 13, 21]) for _ in range(rng.randint(1, 10))]
        count = rng.randint(1, 4)
        distinct = sorted(set(lengths))
        fewest = min(
            positions(sorted({*chosen, max(lengths)}), lengths)
            for size in range(count)
            for chosen in itertools.combinations(distinct, size)
        )
        ladder = length_ladder(lengths, count)
        assert len(ladder) <= count and positions(ladder, lengths) == fewest, (lengths, count)


def test_buckets_take_at_most_max_shapes_shapes_and_every_sample_once():
    recipe = text_recipe()
    _, plain = epoch(CPU.replace(data__batches="buckets"), recipe)
    indices, shaped = epoch(CPU.replace(data__batches="buckets", data__max_shapes=SHAPES), recipe)
    assert len(shapes(shaped, "tokens")) <= SHAPES
    # Negative control: plain buckets take a shape per length, far more than the ladder's.
    assert len(shapes(plain, "tokens")) > 2 * SHAPES
    assert sorted(i for batch in indices for i in batch) == list(range(len(recipe.dataset)))
    # The budget keeps the user's batches per epoch: the tokens per step stay the user's.
    assert len(indices) <= -(-len(recipe.dataset) // recipe.batch_size)


def test_packed_rows_all_take_one_shape_and_every_document_once():
    from test_batch_plan import plain_recipe

    recipe = plain_recipe()
    config = CPU.replace(data__batches="packed", data__max_shapes=1)
    indices, rows = epoch(config, recipe)
    budget = registry.batch_plan(config, recipe_source(recipe)).max_tokens
    assert set(shapes(rows, "input_ids")) == {(1, budget)}
    assert sorted(i for batch in indices for i in batch) == list(range(len(recipe.dataset)))
    real = sum(len(recipe.dataset[i]["input_ids"]) for batch in indices for i in batch)
    labelled = sum(int((row["labels"] != IGNORE_INDEX).sum()) for row in rows)
    # Each document's first token is unlabelled (nothing before it to predict it from).
    assert labelled == real - sum(len(batch) for batch in indices)


def _loss_and_grads(model: torch.nn.Module, batch: dict[str, Any]) -> tuple[float, list, int]:
    model.zero_grad()
    loss, count = text_loss(model, batch)
    loss.backward()
    return float(loss.detach()), [p.grad.clone() for p in model.parameters()], int(count)


def test_a_padded_batch_trains_as_the_unpadded_one():
    recipe = text_recipe()
    model = recipe.model().eval()  # no dropout: both batches must see the same network
    samples = [recipe.dataset[i] for i in range(5)]
    batch = pad_collate(samples)
    width = batch["tokens"].shape[1]
    padded = pad_batch(batch, rows=8, length=width + 11)
    assert padded["tokens"].shape == (8, width + 11)
    loss, grads, count = _loss_and_grads(model, batch)
    padded_loss, padded_grads, padded_count = _loss_and_grads(model, padded)
    assert padded_count == count
    # float32 kernels of another shape sum in another order: ~1e-7 relative.
    assert padded_loss == pytest.approx(loss, rel=1e-5)
    for got, want in zip(padded_grads, grads, strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    # Negative control: padding whose labels count (0, not IGNORE_INDEX) trains another loss.
    broken = dict(padded, labels=padded["labels"].clamp(min=0))
    broken_loss, _, broken_count = _loss_and_grads(model, broken)
    assert broken_count > count and broken_loss != pytest.approx(loss, rel=1e-3)


def test_a_packed_row_filled_with_a_padding_document_gives_the_same_loss():
    from test_batch_plan import llama, plain_recipe

    recipe = plain_recipe()
    plan = registry.batch_plan(CPU.replace(data__batches="packed"), recipe_source(recipe))
    filled = registry.batch_plan(
        CPU.replace(data__batches="packed", data__max_shapes=1), recipe_source(recipe)
    )
    lengths = recipe.lengths
    batch = next(b for b in plan.sampler if sum(lengths[i] for i in b) < plan.max_tokens)
    samples = [recipe.dataset[i] for i in batch]
    model = llama()
    loose, full = plan.collate(samples), filled.collate(samples)
    assert full["input_ids"].shape[1] == filled.max_tokens > loose["input_ids"].shape[1]
    width = loose["input_ids"].shape[1]
    with torch.no_grad():
        got, want = model(**full), model(**loose)
    torch.testing.assert_close(got.logits[:, :width], want.logits, rtol=1e-4, atol=1e-5)
    assert float(got.loss) == pytest.approx(float(want.loss), rel=1e-5)


@pytest.mark.slow
def test_a_shape_specialised_compile_builds_one_graph_per_shape():
    """Dynamo's own counter of graphs (``compiled_graphs``), compiling without dynamic shapes as
    CUDA graphs need: one per shape of the plan's batches."""
    recipe = text_recipe()

    def graphs(config: TurboConfig) -> tuple[int, int]:
        torch._dynamo.reset()
        _, batches = epoch(config, recipe)
        model = recipe.model()
        compiled = torch.compile(model, backend="eager", dynamic=False)
        before = compiled_graphs() or 0
        with torch._dynamo.config.patch(cache_size_limit=64):
            for batch in batches[:24]:
                compiled(batch)
        return (compiled_graphs() or 0) - before, len(shapes(batches[:24], "tokens"))

    built, distinct = graphs(CPU.replace(data__batches="buckets", data__max_shapes=SHAPES))
    assert built == distinct <= SHAPES
    plain_built, plain_distinct = graphs(CPU.replace(data__batches="buckets"))
    assert plain_built == plain_distinct > 2 * SHAPES


def test_max_shapes_needs_a_plan_that_torchturbo_pads():
    from torchturbo.config import ConfigError

    with pytest.raises(ConfigError, match="max_shapes = 4 is only used with batches = 'buckets'"):
        CPU.replace(data__max_shapes=4)
    assert dataclasses.replace(CPU.data, batches="buckets", max_shapes=4).max_shapes == 4
