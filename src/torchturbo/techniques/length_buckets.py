"""Length buckets: batches of similar lengths under a token budget, so padding stops costing.

The mechanics are the data layer's (``data/bucketing.py``: ``BucketBatchSampler``, used by the
engine's loader and by ``TurboTrainer``); this module is the technique as the tuner proposes it,
the doctor ranks it and the trainers' arguments carry it.
"""

from __future__ import annotations

from torchturbo.config import DataConfig, TurboConfig
from torchturbo.techniques import levers
from torchturbo.techniques.proposal import Candidate, StageContext, candidate
from torchturbo.techniques.spec import Lever, Stage, Technique, TrainerArguments


def dynamic_batching_stage(ctx: StageContext) -> list[Candidate] | str:
    if ctx.best.data.bucketing:
        return "the current best already trains on length buckets"
    return [
        candidate(
            "length buckets",
            # Packing excludes buckets: from a packed best, buckets are tried instead of it.
            ctx.best.replace(data__bucketing=True, data__packing=False),
            levers.length_buckets(ctx.facts),
            batching="buckets",
        )
    ]


def token_budget_words(data: DataConfig) -> str:
    """The budget of a bucketed batch, in words for notes."""
    if data.max_tokens is None:
        return "batch size x mean length padded tokens"
    return f"{data.max_tokens} padded tokens"


def _hf_arguments(config: TurboConfig, arguments: TrainerArguments) -> None:
    if arguments.takes("train_sampling_strategy"):
        arguments.kwargs["train_sampling_strategy"] = "group_by_length"
    else:
        arguments.kwargs["group_by_length"] = True
    arguments.note(
        "data",
        "bucketing",
        f"length buckets under a token budget ({token_budget_words(config.data)}) need "
        f"{arguments.trainer_class}, which replaces the sampler; a plain Trainer gets length "
        "grouping (fixed rows per batch), the nearest it has",
    )


def _lightning_arguments(config: TurboConfig, arguments: TrainerArguments) -> None:
    arguments.note(
        "data",
        "bucketing",
        "build your DataLoader with batch_sampler=torchturbo.data.BucketBatchSampler("
        f"lengths, max_tokens=...) for a budget of {token_budget_words(config.data)}, and a "
        "padding collate (docs/integrations.md)",
    )


TECHNIQUE = Technique(
    name="length_buckets",
    section="data",
    fields=("bucketing", "max_tokens"),
    doc="docs/techniques/dynamic_batching.md",
    requested=lambda config: config.data.bucketing,
    stage=Stage("dynamic_batching", 70, dynamic_batching_stage),
    levers=(Lever("length buckets", levers.length_buckets),),
    translations={"transformers": _hf_arguments, "lightning": _lightning_arguments},
)
