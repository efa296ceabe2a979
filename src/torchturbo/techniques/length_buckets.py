"""Length buckets: batches of similar lengths under a token budget, so padding stops costing.

The mechanics are the data layer's (``data/bucketing.py``: ``BucketBatchSampler``); this module
is the technique: the batch plan every host and the tuner's trials build (``_batches``), the
tuner's candidate, the doctor's lever and the trainers' arguments.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from torchturbo.config import DataConfig, TurboConfig
from torchturbo.data.batch_plan import BatchPlan, BatchSource, token_budget
from torchturbo.data.bucketing import BucketBatchSampler
from torchturbo.data.collate import pad_collate
from torchturbo.data.shapes import ShapedCollate, length_ladder
from torchturbo.techniques.framework.facts import Facts
from torchturbo.techniques.framework.levers import Expectation
from torchturbo.techniques.framework.proposal import Candidate, StageContext, candidate
from torchturbo.techniques.framework.spec import Lever, Stage, Technique, TrainerArguments

#: Its name in ``[data] batches``.
PLAN = "buckets"


def dynamic_batching_stage(ctx: StageContext) -> list[Candidate] | str:
    if ctx.best.data.batches == PLAN:
        return "the current best already trains on length buckets"
    return [
        candidate(
            "length buckets",
            # One plan at a time: from a packed best, buckets are tried instead of it.
            ctx.best.replace(data__batches=PLAN),
            length_buckets_gain(ctx.facts),
        )
    ]


def _batches(config: TurboConfig, source: BatchSource) -> BatchPlan:
    """Length buckets of ``[data] max_tokens`` padded tokens, else of the budget that keeps the
    user's batches per epoch (so their real tokens per step), padded by ``pad_collate`` unless
    the host has a collate of its own."""
    data = config.data
    lengths = source.require_lengths(PLAN)
    multiple = data.pad_to_multiple
    # [data] max_shapes: lengths up a ladder of a few, so that batches take a few shapes.
    ladder = length_ladder(lengths, data.max_shapes, multiple) if data.max_shapes else ()

    def sampler(lengths: Sequence[int], budget: int, replicas: int = 1, rank: int = 0) -> Any:
        return BucketBatchSampler(
            lengths,
            max_tokens=budget,
            pad_to_multiple=multiple,
            ladder=ladder,
            seed=source.seed,
            num_replicas=replicas,
            rank=rank,
        )

    budget, note = token_budget(
        data.max_tokens,
        source,
        sampler,
        plan=PLAN,
        smallest=ladder[-1] if ladder else -(-max(lengths) // multiple) * multiple,
        unit="padded tokens",
    )
    collate = source.collate or functools.partial(
        pad_collate, pad_to_multiple=multiple, pad_values=source.pad_values
    )
    if ladder:
        collate = ShapedCollate(collate, ladder, budget, source.pad_values)
    return BatchPlan(
        "buckets",
        sampler(lengths, budget, source.num_replicas, source.rank),
        collate,
        max_tokens=budget,
        budget_note=note,
    )


def token_budget_words(data: DataConfig) -> str:
    """The budget of a bucketed batch, in words for notes."""
    if data.max_tokens is None:
        return "padded tokens that hold, on average, the real tokens of your batch size"
    return f"{data.max_tokens} padded tokens"


def _hf_arguments(config: TurboConfig, arguments: TrainerArguments) -> None:
    if arguments.takes("train_sampling_strategy"):
        arguments.kwargs["train_sampling_strategy"] = "group_by_length"
    else:
        arguments.kwargs["group_by_length"] = True
    arguments.note(
        "data",
        "batches",
        f"length buckets under a token budget ({token_budget_words(config.data)}) need "
        f"{arguments.trainer_class}, which replaces the sampler; a plain Trainer gets length "
        "grouping (fixed rows per batch), the nearest it has",
    )


def _lightning_arguments(config: TurboConfig, arguments: TrainerArguments) -> None:
    arguments.planned_by_callback("batches", f"length buckets of {token_budget_words(config.data)}")


def length_buckets_gain(facts: Facts) -> Expectation:
    if facts.padding is None:
        return Expectation(None, "the recipe gives no per-sample lengths")
    random, bucketed = facts.padding
    gain = (1 - bucketed) / (1 - random)
    return Expectation(
        gain,
        f"padding {random:.0%} in random batches, {bucketed:.0%} in length buckets: "
        f"{gain:.2f}x more real tokens per padded token",
    )


TECHNIQUE = Technique(
    name="length_buckets",
    order=80,
    order_reason="plans the batches when [data] batches names it; one plan at a time",
    section="data",
    fields=("batches", "max_tokens", "max_shapes"),
    doc="docs/techniques/dynamic_batching.md",
    requested=lambda config: config.data.batches == PLAN,
    batches=_batches,
    plans=PLAN,
    needs=frozenset({"lengths"}),
    stage=Stage("dynamic_batching", 70, dynamic_batching_stage, lever="batching", from_facts=True),
    levers=(Lever("length buckets", length_buckets_gain),),
    translations={"transformers": _hf_arguments, "lightning": _lightning_arguments},
)
