"""Packing: whole documents in rows of a token budget, no padding, documents kept apart.

The mechanics are the data layer's (``data/packing.py``: ``PackingBatchSampler`` and
``packed_collate``, used by the engine's loader and by ``TurboTrainer``; ``data/document_mask.py``
for plain models); this module is the technique as the tuner proposes it and the trainers'
arguments carry it. The tuner proposes it only on a model that passes the isolation check
(``packing_isolation.py``), and measures it against the current best, length buckets included,
in real tokens per second with loss parity, so it is adopted only where it is faster.
"""

from __future__ import annotations

from torchturbo.config import TurboConfig
from torchturbo.data.packing import takes_boundaries
from torchturbo.recipe import Recipe
from torchturbo.techniques.packing_isolation import Isolation, check_isolation, isolation_documents
from torchturbo.techniques.proposal import Candidate, StageContext
from torchturbo.techniques.spec import Stage, Technique, TrainerArguments

#: Verdicts of recipes already checked (the stage is asked again after every adoption), by id:
#: a recipe is checked once per tuning run. The recipe is kept so that its id stays its own.
_CHECKED: dict[int, tuple[Recipe, Isolation, bool]] = {}


def recipe_isolation(recipe: Recipe) -> tuple[Isolation, bool]:
    """Whether the recipe's model keeps packed documents apart (on a fresh copy, checked on
    its first documents), and whether its forward takes the boundary fields."""
    if id(recipe) not in _CHECKED:
        samples = [recipe.dataset[i] for i in range(min(16, len(recipe.lengths or ())))]
        documents = isolation_documents(samples)
        model = recipe.build()[0]
        if len(documents) < 2:
            verdict = Isolation(False, "the recipe's samples have no input_ids to pack")
        else:
            verdict = check_isolation(model, documents)
        _CHECKED.clear()  # one recipe per tuning run: keep only the latest
        _CHECKED[id(recipe)] = (recipe, verdict, takes_boundaries(model))
    _, verdict, boundaries = _CHECKED[id(recipe)]
    return verdict, boundaries


def packing_stage(ctx: StageContext) -> list[Candidate] | str:
    if ctx.best.data.packing:
        return "the current best already trains on packed rows"
    if ctx.recipe.lengths is None:
        return "the recipe gives no per-sample lengths to pack by"
    verdict, boundaries = recipe_isolation(ctx.recipe)
    if not verdict.ok:
        return f"the model does not keep packed documents apart: {verdict.reason}"
    padding = ctx.facts.padding
    evidence = verdict.reason
    if padding is not None:
        evidence = f"padding {padding[0]:.0%} in random batches, none packed; {evidence}"
    return [
        Candidate(
            "packing",
            ctx.best.replace(data__packing=True, data__bucketing=False),
            expected_gain=None if padding is None else 1 / (1 - padding[0]),
            evidence=evidence,
            batching="packed:ids" if boundaries else "packed",
        )
    ]


def _budget_words(config: TurboConfig) -> str:
    tokens = config.data.max_tokens
    return "batch size x mean length tokens" if tokens is None else f"{tokens} tokens"


def _hf_arguments(config: TurboConfig, arguments: TrainerArguments) -> None:
    arguments.note(
        "data",
        "packing",
        "TrainingArguments cannot set a collator: pass data_collator="
        "transformers.DataCollatorWithFlattening(position_ids_start=0) to the Trainer (add "
        "return_flash_attn_kwargs=True with attn_implementation='flash_attention_2'; keep "
        "use_cache=False), which flattens each batch of rows into one; "
        f"{arguments.trainer_class} instead packs whole documents to "
        f"{_budget_words(config)} per row",
    )


def _lightning_arguments(config: TurboConfig, arguments: TrainerArguments) -> None:
    arguments.note(
        "data",
        "packing",
        "build your DataLoader with batch_sampler=torchturbo.data.PackingBatchSampler(lengths, "
        f"max_tokens=...) for rows of {_budget_words(config)}, and "
        "collate_fn=torchturbo.data.packed_collate (docs/techniques/packing.md)",
    )


TECHNIQUE = Technique(
    name="packing",
    section="data",
    fields=("packing",),
    doc="docs/techniques/packing.md",
    requested=lambda config: config.data.packing,
    stage=Stage("packing", 71, packing_stage),
    translations={"transformers": _hf_arguments, "lightning": _lightning_arguments},
)
