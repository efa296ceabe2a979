"""Packing: whole documents in rows of a token budget, no padding, documents kept apart.

The mechanics are the data layer's (``data/packing.py``: ``PackingBatchSampler`` and
``packed_collate``; ``data/document_mask.py`` for plain models); this module is the technique:
the batch plan every host and the tuner's trials build (``_batches``), which refuses a model that
fails the isolation check (``tools/packing_isolation.py``) wherever it is built, the tuner's
candidate and the trainers' arguments. The tuner measures it against the current best, length
buckets included, in real tokens per second with loss parity, so it is adopted only where it is
faster.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from torch import nn

from torchturbo.config import TurboConfig
from torchturbo.data.batch_plan import (
    BatchPlan,
    BatchSource,
    collated_fields,
    keep_fields,
    token_budget,
)
from torchturbo.data.length import length_or_none
from torchturbo.data.packing import PackingBatchSampler, packed_collate, takes_boundaries
from torchturbo.data.shapes import FilledRows
from torchturbo.recipe import Recipe
from torchturbo.techniques.framework.proposal import Candidate, StageContext
from torchturbo.techniques.framework.spec import Stage, Technique, TrainerArguments
from torchturbo.techniques.tools.packing_isolation import (
    Isolation,
    check_isolation,
    isolation_documents,
)

#: Its name in ``[data] batches``.
PLAN = "packed"
#: Verdicts of recipes already checked (the stage is asked again after every adoption), by id:
#: a recipe is checked once per tuning run. The recipe is kept so that its id stays its own.
_CHECKED: dict[int, tuple[Recipe, Isolation]] = {}


def recipe_isolation(recipe: Recipe) -> Isolation:
    """Whether the recipe's model keeps packed documents apart (on a fresh copy, checked on
    its first documents)."""
    if id(recipe) not in _CHECKED:
        verdict = isolation(recipe.build()[0], recipe.dataset)
        _CHECKED.clear()  # one recipe per tuning run: keep only the latest
        _CHECKED[id(recipe)] = (recipe, verdict)
    return _CHECKED[id(recipe)][1]


def isolation(model: nn.Module, dataset: Any) -> Isolation:
    """The isolation check of ``model`` on the first documents of ``dataset``."""
    samples = [dataset[i] for i in range(min(16, length_or_none(dataset) or 0))]
    documents = isolation_documents(samples)
    if len(documents) < 2:
        return Isolation(False, "the samples have no input_ids to pack")
    return check_isolation(model, documents)


def _batches(config: TurboConfig, source: BatchSource) -> BatchPlan:
    """Packed rows of ``[data] max_tokens`` tokens, else of the budget that keeps the user's
    batches per epoch (so their real tokens per step), once the model passed the isolation
    check: every host that packs refuses a model that would let documents attend to each
    other, with the reason."""
    lengths = source.require_lengths(PLAN)
    if source.model is None:
        raise ValueError(
            f"[data] batches = {PLAN!r} needs the model, to check it keeps documents apart"
        )
    model = source.model()
    verdict = isolation(model, source.dataset)
    if not verdict.ok:
        raise ValueError(
            f"[data] batches = {PLAN!r} refused on {type(model).__name__}: {verdict.reason}"
        )

    def sampler(lengths: Sequence[int], budget: int, replicas: int = 1, rank: int = 0) -> Any:
        return PackingBatchSampler(
            lengths, max_tokens=budget, seed=source.seed, num_replicas=replicas, rank=rank
        )

    tokens, note = token_budget(
        config.data.max_tokens,
        source,
        sampler,
        plan=PLAN,
        smallest=max(lengths),
        unit="tokens per row",
    )
    # HF's varlen flash-attention path reads these fields; other models get only what they read.
    flash = str(getattr(getattr(model, "config", None), "_attn_implementation", "")).startswith(
        "flash"
    )
    pack = functools.partial(
        packed_collate, boundaries=takes_boundaries(model), flash_attn_kwargs=flash
    )
    collate = keep_fields(pack, collated_fields(source.collate, source.dataset))
    if config.data.max_shapes:  # one shape: every row filled to the budget
        collate = FilledRows(collate, tokens)
    return BatchPlan(
        "packed",
        sampler(lengths, tokens, source.num_replicas, source.rank),
        collate,
        max_tokens=tokens,
        budget_note=note,
    )


def packing_stage(ctx: StageContext) -> list[Candidate] | str:
    if ctx.best.data.batches == PLAN:
        return "the current best already trains on packed rows"
    if ctx.recipe.lengths is None:
        return "the recipe gives no per-sample lengths to pack by"
    verdict = recipe_isolation(ctx.recipe)
    if not verdict.ok:
        return f"the model does not keep packed documents apart: {verdict.reason}"
    padding = ctx.facts.padding
    evidence = verdict.reason
    if padding is not None:
        evidence = f"padding {padding[0]:.0%} in random batches, none packed; {evidence}"
    return [
        Candidate(
            "packing",
            ctx.best.replace(data__batches=PLAN),
            expected_gain=None if padding is None else 1 / (1 - padding[0]),
            evidence=evidence,
        )
    ]


def _budget_words(config: TurboConfig) -> str:
    tokens = config.data.max_tokens
    if tokens is None:
        return "the real tokens of your batch size on average"
    return f"{tokens} tokens"


def _hf_arguments(config: TurboConfig, arguments: TrainerArguments) -> None:
    arguments.note(
        "data",
        "batches",
        "TrainingArguments cannot set a collator: pass data_collator="
        "transformers.DataCollatorWithFlattening(position_ids_start=0) to the Trainer (add "
        "return_flash_attn_kwargs=True with attn_implementation='flash_attention_2'; keep "
        "use_cache=False), which flattens each batch of rows into one; "
        f"{arguments.trainer_class} instead packs whole documents to "
        f"{_budget_words(config)} per row",
    )


def _lightning_arguments(config: TurboConfig, arguments: TrainerArguments) -> None:
    arguments.planned_by_callback("batches", f"packed rows of {_budget_words(config)}")


TECHNIQUE = Technique(
    name="packing",
    order=81,
    order_reason="plans the batches when [data] batches names it; one plan at a time",
    section="data",
    fields=("batches", "max_tokens", "max_shapes"),
    doc="docs/techniques/packing.md",
    requested=lambda config: config.data.batches == PLAN,
    batches=_batches,
    plans=PLAN,
    needs=frozenset({"lengths", "model"}),
    stage=Stage("packing", 71, packing_stage, lever="batching"),
    translations={"transformers": _hf_arguments, "lightning": _lightning_arguments},
)
