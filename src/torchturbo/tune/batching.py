"""The batches a tuner trial trains on: the recipe's fixed batches, or length buckets or packed
rows of the same token budget; and small readers of batches and losses. (Micro-batches are the
engine's own: ``[accumulation] micro_batches`` cuts every batch inside the step.)

A candidate names its batching ("buckets", "packed", "packed:ids" with the document
boundaries); the current best's batches are the
starting point, so that a later candidate keeps the batching an earlier one adopted and is timed
on the same batches as the best.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from torchturbo.measure.trial import bucketed_batches, packed_batches
from torchturbo.recipe import Recipe
from torchturbo.reliability.oom import leading_size

if TYPE_CHECKING:
    from torchturbo.techniques.proposal import Candidate


def candidate_batches(
    recipe: Recipe, candidate: Candidate, best_batches: list[Any], count: int
) -> list[Any]:
    """What ``candidate`` trains on: its own batches, else the best's with its batching."""
    if candidate.batches is not None:
        return candidate.batches
    return batches_for(recipe, [candidate.batching], best_batches, count)


def batches_for(
    recipe: Recipe, batchings: Sequence[str | None], base: list[Any], count: int
) -> list[Any]:
    """``base`` with each batching applied in order (None leaves the batches as they are)."""
    batches = base
    for kind in batchings:
        if kind == "buckets":
            batches = bucketed_batches(recipe, count)
        elif kind in ("packed", "packed:ids"):
            batches = packed_batches(recipe, count, boundaries=kind == "packed:ids")
        elif kind is not None:
            raise ValueError(
                f"unknown batching {kind!r}: expected 'buckets', 'packed' or 'packed:ids'"
            )
    return batches


def batch_size(batches: list[Any]) -> int | None:
    """Samples in the first batch, or None when that cannot be told."""
    try:
        return leading_size(batches[0]) if batches else None
    except ValueError:
        return None


def window_losses(losses: Sequence[float], steps: int) -> list[float]:
    """Per optimizer step losses: micro-batch losses averaged over each accumulation window."""
    return [sum(losses[i : i + steps]) / steps for i in range(0, len(losses) - steps + 1, steps)]
