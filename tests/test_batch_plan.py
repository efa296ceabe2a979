"""One batch plan: the batches a tuner trial measures are the batches training runs.

For every batching config, the sample indices and the collated tensors of the first batches are
the same in the tuner's trial (``planned_batches``), in ``torchturbo.train``'s engine loader, in
``TurboTrainer`` and in the Lightning callback's loader, for the same config and seed; a path
with another collate fails the comparison (the negative control). And the plan's token rule: a
dynamic plan draws the user's number of batches per epoch, so its batches hold the user's real
tokens per step on average.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random
import sys
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pl = pytest.importorskip("lightning.pytorch")

from torch.utils.data import DataLoader  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402

from torchturbo import Turbo, TurboConfig  # noqa: E402
from torchturbo.data.batch_plan import BatchSource, matched_budget, real_tokens  # noqa: E402
from torchturbo.data.bucketing import BucketBatchSampler  # noqa: E402
from torchturbo.data.collate import pad_collate  # noqa: E402
from torchturbo.engine.loader import recipe_data  # noqa: E402
from torchturbo.integrations.lightning import (  # noqa: E402
    TurboLightningCallback,
    recipe_from_lightning,
)
from torchturbo.integrations.transformers import TurboTrainer, recipe_from_trainer  # noqa: E402
from torchturbo.recipe import Recipe  # noqa: E402
from torchturbo.techniques import registry  # noqa: E402
from torchturbo.trials.trial import TrialBatches, planned_batches, recipe_source  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning"),
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)`:FutureWarning"),
]

CPU = TurboConfig(device="cpu")
BATCH_SIZE, BATCHES, SEED = 4, 6, 7
CONFIGS = {
    "buckets": CPU.replace(data__batches="buckets"),
    "buckets, max_tokens": CPU.replace(data__batches="buckets", data__max_tokens=96),
    "buckets, pad to 8": CPU.replace(data__batches="buckets", data__pad_to_multiple=8),
    "packing": CPU.replace(data__batches="packed"),
    "packing, max_tokens": CPU.replace(data__batches="packed", data__max_tokens=64),
    "buckets, 4 shapes": CPU.replace(data__batches="buckets", data__max_shapes=4),
    "packing, one shape": CPU.replace(data__batches="packed", data__max_shapes=1),
}


def documents(count: int = 48) -> list[dict[str, torch.Tensor]]:
    """Token ids of long-tailed lengths (2 to 40), labels the inputs, and a raw-text column a
    Trainer's collate drops."""
    rng = random.Random(0)
    out = []
    for index in range(count):
        length = min(40, 2 + int(rng.expovariate(1 / 8)))
        ids = torch.tensor([rng.randrange(1, 64) for _ in range(length)])
        out.append({"input_ids": ids, "labels": ids.clone(), "text": f"document {index}"})
    return out


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        use_cache=False,
    )
    return LlamaForCausalLM(config)


def collate(samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The user's padding collate: token ids and labels only."""
    fields = [{"input_ids": s["input_ids"], "labels": s["labels"]} for s in samples]
    return pad_collate(fields)


def trainer_args(tmp_path: Any) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=BATCH_SIZE,
        report_to="none",
        use_cpu=True,
        seed=SEED,
        save_strategy="no",
    )


class LanguageModule(pl.LightningModule):
    """A user's Lightning module around a causal LM, with its own train DataLoader."""

    def __init__(self, loader_collate: Any = collate) -> None:
        super().__init__()
        self.model = llama()
        self.loader_collate = loader_collate

    def forward(self, input_ids: torch.Tensor, position_ids: Any = None, **kw: Any) -> Any:
        return self.model(input_ids=input_ids, position_ids=position_ids, **kw)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(documents(), batch_size=BATCH_SIZE, collate_fn=self.loader_collate)


def plain_recipe() -> Recipe:
    return Recipe(
        name="documents",
        model=llama,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        loss_fn=lambda model, batch: model(**batch).loss,
        dataset=documents(),
        batch_size=BATCH_SIZE,
        collate=collate,
        lengths=[len(d["input_ids"]) for d in documents()],
        seed=SEED,
    )


def first(loader: DataLoader) -> tuple[list[list[int]], list[Any]]:
    """The first batches of a loader: their sample indices and their collated tensors."""
    indices = [list(batch) for _, batch in zip(range(BATCHES), loader.batch_sampler, strict=False)]
    batches = [batch for _, batch in zip(range(BATCHES), loader, strict=False)]
    return indices, batches


def trial_batches(recipe: Recipe, config: TurboConfig) -> tuple[list[list[int]], list[Any]]:
    plan = registry.batch_plan(config, recipe_source(recipe))
    indices = [list(batch) for _, batch in zip(range(BATCHES), plan.sampler, strict=False)]
    return indices, planned_batches(recipe, config, BATCHES)


def same(a: tuple[list[list[int]], list[Any]], b: tuple[list[list[int]], list[Any]]) -> bool:
    """Equal indices, and every batch with the same fields holding equal tensors."""
    if a[0] != b[0] or len(a[1]) != len(b[1]):
        return False
    for x, y in zip(a[1], b[1], strict=True):
        if set(x) != set(y):
            return False
        for key in x:
            left, right = x[key], y[key]
            if isinstance(left, torch.Tensor):
                if not (isinstance(right, torch.Tensor) and torch.equal(left, right)):
                    return False
            elif left != right:
                return False
    return True


def engine_batches(
    recipe: Recipe, config: TurboConfig, **overrides: Any
) -> tuple[list[list[int]], list[Any]]:
    """The loader ``torchturbo.train`` trains ``recipe`` on (``recipe_data``)."""
    model, optimizer = recipe.build()
    _, _, loader = Turbo(config).setup(
        model, optimizer, recipe.dataset, **(recipe_data(recipe) | overrides)
    )
    assert loader is not None
    return first(loader.loader)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_trial_trains_on_the_batches_train_runs(name: str) -> None:
    config, recipe = CONFIGS[name], plain_recipe()
    trial = trial_batches(recipe, config)
    assert len(trial[1]) == BATCHES
    assert same(trial, engine_batches(recipe, config))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_trial_trains_on_the_batches_turbo_trainer_runs(name: str, tmp_path: Any) -> None:
    config = CONFIGS[name]
    kwargs = {
        "args": trainer_args(tmp_path),
        "train_dataset": documents(),
        "data_collator": collate,
    }
    recipe = recipe_from_trainer(Trainer(model=llama(), **kwargs))
    trainer = TurboTrainer(model=llama(), turbo_config=config, **kwargs)
    assert same(trial_batches(recipe, config), first(trainer.get_train_dataloader()))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_trial_trains_on_the_batches_the_lightning_callback_runs(name: str) -> None:
    config = CONFIGS[name]
    module = LanguageModule()
    recipe = recipe_from_lightning(module)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    callback = TurboLightningCallback(config)
    callback.setup(trainer, module, "fit")
    try:
        planned = first(module.train_dataloader())
    finally:
        callback.teardown(trainer, module, "fit")
    assert same(trial_batches(recipe, config), planned)
    assert "train_dataloader" not in vars(module)  # teardown gave the module its method back


@pytest.mark.parametrize("name", ["buckets", "packing"])
def test_a_path_with_another_collate_fails_the_comparison(name: str) -> None:
    """The negative control: the engine padding to a multiple of 8 where the trial does not (or
    a packing collate that keeps the raw text), so the comparison above can fail."""
    config, recipe = CONFIGS[name], plain_recipe()
    other = functools.partial(pad_collate, pad_to_multiple=8)
    if name == "packing":  # the plan packs whatever the host's collate keeps: here every field
        other = None
    assert not same(trial_batches(recipe, config), engine_batches(recipe, config, collate_fn=other))


@pytest.mark.parametrize("name", ["buckets", "buckets, pad to 8", "packing"])
def test_a_dynamic_plan_keeps_the_users_batches_per_epoch_and_tokens_per_step(name: str) -> None:
    config, recipe = CONFIGS[name], plain_recipe()
    plan = registry.batch_plan(config, recipe_source(recipe))
    lengths = list(recipe.lengths or ())
    epoch = plan.sampler.global_batches()
    users = math.ceil(len(lengths) / BATCH_SIZE)
    assert len(epoch) <= users  # so every epoch's real tokens take no more steps than the user's
    assert sum(real_tokens(epoch, lengths)) / len(epoch) >= sum(lengths) / users
    # The smallest such budget: one token less draws more batches than the user's.
    smaller = type(plan.sampler)(
        lengths,
        max_tokens=plan.max_tokens - 1,
        **({"pad_to_multiple": 8} if name == "buckets, pad to 8" else {}),
        seed=SEED,
    )
    assert len(smaller.global_batches()) > users
    assert "real tokens" in plan.budget_note


@pytest.mark.parametrize("name", ["buckets", "packing"])
def test_a_jobs_tokens_per_step_are_the_epochs_whatever_its_plan(name: str) -> None:
    """What the tune headline says a job trains: the epoch's tokens over the plan's batches per
    epoch, not the mean of a trial's few batches. The user's rows give the dataset's tokens over
    its batches of 4, a matched plan as much (it draws at most the user's batches per epoch,
    whole samples each), a budget of four times as many tokens more; a recipe counting samples has
    none."""
    recipe = dataclasses.replace(plain_recipe(), count_unit="tokens")
    lengths = list(recipe.lengths or ())
    batches = TrialBatches(recipe, 2)
    rows = batches.tokens_per_step(CPU)
    assert rows == sum(lengths) / math.ceil(len(lengths) / BATCH_SIZE)
    drawn = batches(CPU)
    planned = batches.tokens_per_step(CONFIGS[name])
    assert rows <= planned <= rows * 12 / 10
    assert batches.tokens_per_step(CONFIGS[name].replace(data__max_tokens=160)) > 1.5 * rows
    assert batches(CPU) is drawn  # the plans were drawn once
    samples = TrialBatches(plain_recipe(), 2)
    assert samples.tokens_per_step(CPU) is None


def test_the_padded_token_rule_would_have_trained_fewer_tokens_per_step() -> None:
    """The control for the rule: a budget of batch size x mean length padded tokens (the rule
    before) draws more batches per epoch than the user's, each with fewer real tokens."""
    lengths = [len(d["input_ids"]) for d in documents()]
    padded_budget = max(round(BATCH_SIZE * sum(lengths) / len(lengths)), max(lengths))
    old = BucketBatchSampler(lengths, max_tokens=padded_budget, seed=SEED).global_batches()
    assert len(old) > math.ceil(len(lengths) / BATCH_SIZE)


def test_matched_budget_on_a_sample_of_a_large_dataset() -> None:
    """Above the sampling threshold the budget is matched on a seeded sample of the lengths:
    applied to all of them it still keeps the user's batches per epoch within 2%."""
    rng = random.Random(1)
    lengths = [1 + int(rng.lognormvariate(3.5, 0.9)) % 2048 for _ in range(60_000)]

    def count(sample: list[int], budget: int) -> int:
        return len(BucketBatchSampler(sample, max_tokens=budget, seed=0).global_batches())

    budget = matched_budget(lengths, 16, count, smallest=max(lengths), seed=0)
    assert count(lengths, budget) <= math.ceil(len(lengths) / 16) * 1.02


class IgnoresPositions(LlamaForCausalLM):
    """A causal LM that drops ``position_ids``: packed documents then attend to each other."""

    def forward(self, input_ids: Any = None, position_ids: Any = None, **kw: Any) -> Any:
        return super().forward(input_ids=input_ids, **kw)


def leaky() -> IgnoresPositions:
    torch.manual_seed(0)
    return IgnoresPositions(llama().config)


def test_packing_refuses_a_model_that_leaks_on_every_host(tmp_path: Any) -> None:
    """The isolation check is the plan's: the tuner's trials, train and TurboTrainer all refuse
    a model that lets packed documents attend to each other, with the reason."""
    config = CONFIGS["packing"]
    recipe = dataclasses.replace(plain_recipe(), model=leaky)
    refused = "refused on IgnoresPositions: "
    with pytest.raises(ValueError, match=refused):
        planned_batches(recipe, config, 1)
    with pytest.raises(ValueError, match=refused):
        engine_batches(recipe, config)
    kwargs = {
        "args": trainer_args(tmp_path),
        "train_dataset": documents(),
        "data_collator": collate,
    }
    trainer = TurboTrainer(model=leaky(), turbo_config=config, **kwargs)
    with pytest.raises(ValueError, match=refused):
        trainer.get_train_dataloader()


def cached_llama() -> LlamaForCausalLM:
    """The Llama as its config comes: use_cache = True, which the Trainer turns off to train."""
    model = llama()
    model.config.use_cache = True
    return model


@pytest.mark.parametrize(
    ("model_init", "passes"), [(cached_llama, True), (leaky, False)], ids=["isolates", "leaks"]
)
def test_the_tuner_and_turbo_trainer_agree_on_packing_a_model_init_trainers_model(
    tmp_path: Any, model_init: Any, passes: bool
) -> None:
    """Trainer.train() builds a fresh model from model_init, use_cache on as its config has
    it, and sets the Trainer's use_cache only later: the check must see it as it trains, as the
    tuner's recipe does, or TurboTrainer refuses the packing the tuner chose."""
    from torchturbo.techniques.tools.packing_isolation import (
        check_isolation,
        isolation_documents,
    )

    kwargs = {
        "args": trainer_args(tmp_path),
        "train_dataset": documents(),
        "data_collator": collate,
    }
    recipe = recipe_from_trainer(Trainer(model_init=model_init, **kwargs))
    assert check_isolation(recipe.model(), isolation_documents(documents())).ok == passes
    kwargs["args"].max_steps = 2
    trainer = TurboTrainer(model_init=model_init, turbo_config=CONFIGS["packing"], **kwargs)
    if passes:
        assert trainer.train().global_step == 2
    else:
        with pytest.raises(ValueError, match="refused on IgnoresPositions: "):
            trainer.train()


def test_a_plan_without_lengths_names_the_field_that_needs_them() -> None:
    source = BatchSource(documents(), None, BATCH_SIZE)
    with pytest.raises(ValueError, match=r"\[data\] batches = 'buckets' needs per-sample lengths"):
        registry.batch_plan(CONFIGS["buckets"], source)


def test_a_new_batch_technique_reaches_train_both_trainers_and_the_tuner(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """A technique that only declares a ``batches`` hook, the plan it names and a stage of the
    batching lever (CONTRIBUTING.md's promise: no host edited) plans the batches of the engine,
    TurboTrainer, the Lightning callback and the tuner's trials alike, and the tuner races it
    against length buckets. The probe: batches of the user's rows, longest
    samples first, asked for by ``[data] batches = "longest"`` (the value added to the field's
    choices, as its module's config edit would)."""
    from typing import Literal

    from torch.utils.data import BatchSampler

    from torchturbo.data.batch_plan import BatchPlan
    from torchturbo.techniques.framework.proposal import Candidate, StageContext
    from torchturbo.techniques.framework.spec import Stage, Technique
    from torchturbo.tune import TuneOptions, tune
    from torchturbo.tune.search import fastest_fit
    from torchturbo.tune.search import run as run_module
    from torchturbo.tune.search.stages import levers, tuner_stages

    choices = Literal["rows", "buckets", "packed", "longest"]
    # config/__init__ names a function sections(): the module is reached through sys.modules.
    monkeypatch.setattr(sys.modules["torchturbo.config.sections"], "BatchPlanName", choices)

    def longest_first(config: TurboConfig, source: BatchSource) -> BatchPlan:
        lengths = source.require_lengths("longest")
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        assert source.batch_size is not None
        sampler = BatchSampler(order, source.batch_size, drop_last=False)
        padded = functools.partial(pad_collate, pad_to_multiple=3, pad_values=source.pad_values)
        return BatchPlan("longest first", sampler, source.collate or padded)

    def longest_stage(ctx: StageContext) -> list[Candidate] | str:
        if ctx.best.data.batches == "longest":
            return "the current best already trains longest first"
        return [Candidate("longest first", ctx.best.replace(data__batches="longest"), 1.2)]

    probe = Technique(
        name="longest_first",
        section="data",
        doc="CONTRIBUTING.md",
        requested=lambda config: config.data.batches == "longest",
        batches=longest_first,
        plans="longest",
        needs=frozenset({"lengths"}),
        stage=Stage("longest_first", 72, longest_stage, lever="batching"),
        order=82,
        order_reason="plans the batches; a probe of the registry, after the real planners",
    )
    techniques = registry.techniques()
    monkeypatch.setattr(registry, "techniques", lambda: (*techniques, probe))
    config = CPU.replace(data__batches="longest")
    assert registry.plan_needs(config) == {"lengths"}
    recipe = plain_recipe()
    lengths = list(recipe.lengths or ())
    trial = trial_batches(recipe, config)
    assert [lengths[i] for i in trial[0][0]] == sorted(lengths, reverse=True)[:BATCH_SIZE]
    assert same(trial, engine_batches(recipe, config))
    kwargs = {
        "args": trainer_args(tmp_path),
        "train_dataset": documents(),
        "data_collator": collate,
    }
    hf_recipe = recipe_from_trainer(Trainer(model=llama(), **kwargs))
    trainer = TurboTrainer(model=llama(), turbo_config=config, **kwargs)
    assert same(trial_batches(hf_recipe, config), first(trainer.get_train_dataloader()))
    module = LanguageModule()
    lightning_recipe = recipe_from_lightning(module)
    pl_trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    callback = TurboLightningCallback(config)
    callback.setup(pl_trainer, module, "fit")
    try:
        assert same(trial_batches(lightning_recipe, config), first(module.train_dataloader()))
    finally:
        callback.teardown(pl_trainer, module, "fit")
    # The tuner proposes it as an alternative of the batching lever: raced against buckets.
    assert levers()["longest_first"] == levers()["dynamic_batching"] == "batching"
    raced = []
    real = fastest_fit.fastest_alternative

    def recording(run: Any, proposals: Any, *args: Any) -> Any:
        raced.append(sorted(c.name for _, c in proposals))
        return real(run, proposals, *args)

    monkeypatch.setattr(run_module, "fastest_alternative", recording)
    options = TuneOptions(time_budget_s=120, device="cpu", max_rounds=3)
    stages = {name: tuner_stages()[name] for name in ("dynamic_batching", "longest_first")}
    _, result = tune(recipe, options, stages=stages)
    assert raced == [["length buckets", "longest first"]]
    assert {o.name for o in result.candidates} >= {"length buckets", "longest first"}
