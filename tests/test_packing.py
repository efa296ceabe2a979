"""Packing: the sampler fills budgets with whole documents, the collate restarts positions and
masks boundary labels, the loss is the token-weighted mean over documents, the document masks
keep attention apart, the isolation check passes models that isolate and refuses those that do
not (with the reason), and packed training reaches the unpacked run's losses.

Tiny Hugging Face models from configs (no downloads): each check takes a fraction of a second.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import types
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    BertConfig,
    BertModel,
    DataCollatorWithFlattening,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    RobertaConfig,
    RobertaModel,
)

from torchturbo import Turbo, TurboConfig  # noqa: E402
from torchturbo.config import ConfigError  # noqa: E402
from torchturbo.data import (  # noqa: E402
    PackingBatchSampler,
    document_mask,
    flex_document_mask,
    pack_documents,
    packed_collate,
)
from torchturbo.data.collate import IGNORE_INDEX, pad_collate  # noqa: E402
from torchturbo.data.packing import fill_fraction  # noqa: E402
from torchturbo.integrations.translate import hf_arguments, lightning_arguments  # noqa: E402
from torchturbo.recipe import Recipe  # noqa: E402
from torchturbo.techniques.packing import packing_stage  # noqa: E402
from torchturbo.techniques.tools.packing_isolation import check_isolation  # noqa: E402
from torchturbo.trials.trial import planned_batches  # noqa: E402

VOCAB = 64
CPU = TurboConfig(device="cpu")


def long_tailed(n: int, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return (6 * torch.empty(n).normal_(0, 0.9, generator=generator).exp()).long().clamp(2, 60)


def documents(lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (n,), generator=generator) for n in lengths]


def tiny_llama(**kw) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        use_cache=kw.pop("use_cache", False),
        **kw,
    )
    return LlamaForCausalLM(config)


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=256, use_cache=False
    )
    config.bos_token_id = config.eos_token_id = 0
    return GPT2LMHeadModel(config)


class CountedPositions(nn.Module):
    """Absolute position embeddings counted along the row: takes position_ids, ignores them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.positions = nn.Embedding(VOCAB, 16), nn.Embedding(256, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        counted = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.head(self.embed(input_ids) + self.positions(counted))


class DocumentAttention(nn.Module):
    """A plain causal self-attention LM that keeps documents apart with document_mask."""

    def __init__(self, isolate: bool = True) -> None:
        super().__init__()
        self.isolate = isolate
        self.embed, self.positions = nn.Embedding(VOCAB, 16), nn.Embedding(256, 16)
        self.qkv, self.head = nn.Linear(16, 48), nn.Linear(16, VOCAB)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1]).unsqueeze(0)
        if document_ids is None:
            document_ids = torch.zeros_like(input_ids)
        x = self.embed(input_ids) + self.positions(position_ids)
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)
        if self.isolate:
            mask = document_mask(document_ids, causal=True)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(x + y.squeeze(1))


# --- the sampler ---------------------------------------------------------------------------


def test_first_fit_decreasing_packs_every_document_once_within_the_budget_nearly_full():
    lengths = long_tailed(400).tolist()
    bins = pack_documents(range(400), lengths, max_tokens=128)
    assert sorted(i for b in bins for i in b) == list(range(400))
    assert all(sum(lengths[i] for i in b) <= 128 for b in bins)
    # First fit: two bins half empty or worse would have been one.
    assert sum(sum(lengths[i] for i in b) <= 64 for b in bins) <= 1
    assert fill_fraction(bins, lengths, 128) > 0.95
    # Negative control: the same documents one after another, a new row when one is full.
    naive, row = [], 0
    for n in lengths:
        if row + n > 128:
            naive.append(row)
            row = 0
        row += n
    assert len(bins) <= len(naive)


def test_the_sampler_is_seeded_reshuffles_per_epoch_and_splits_ranks_evenly():
    lengths = long_tailed(300).tolist()
    a = PackingBatchSampler(lengths, max_tokens=96, seed=3, num_replicas=1, rank=0)
    b = PackingBatchSampler(lengths, max_tokens=96, seed=3, num_replicas=1, rank=0)
    first = list(a)
    assert first == list(b)
    a.set_epoch(1)
    assert list(a) != first
    assert sorted(i for bin_ in first for i in bin_) == list(range(300))
    ranks = [
        list(PackingBatchSampler(lengths, max_tokens=96, seed=3, num_replicas=2, rank=r))
        for r in (0, 1)
    ]
    assert len(ranks[0]) == len(ranks[1])
    assert {i for r in ranks for b in r for i in b} == set(range(300))
    with pytest.raises(ValueError, match="sample 0 has length 100"):
        PackingBatchSampler([100, 3], max_tokens=96)


# --- the collate and the loss --------------------------------------------------------------


def test_the_collate_restarts_positions_marks_boundaries_and_masks_first_labels():
    samples = [
        {"input_ids": torch.tensor([5, 6, 7]), "attention_mask": torch.ones(3), "label": 1},
        {"input_ids": torch.tensor([8, 9]), "attention_mask": torch.ones(2), "label": 0},
    ]
    batch = packed_collate(samples, flash_attn_kwargs=True)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert batch["labels"].tolist() == [[IGNORE_INDEX, 6, 7, IGNORE_INDEX, 9]]
    assert batch["document_ids"].tolist() == [[0, 0, 0, 1, 1]]
    assert batch["cu_seqlens"].tolist() == [0, 3, 5] and batch["max_length_q"] == 3
    assert batch["label"].tolist() == [1, 0] and "attention_mask" not in batch
    # The same as transformers' own flattening collator, where both have the field.
    theirs = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(
        [{"input_ids": s["input_ids"].tolist()} for s in samples], return_tensors="pt"
    )
    for key in ("input_ids", "labels", "position_ids", "cu_seq_lens_q"):
        assert batch[key].tolist() == theirs[key].tolist(), key
    with pytest.raises(ValueError, match="sample 0 is not a dict with 'input_ids'"):
        packed_collate([torch.tensor([1, 2])])


def test_a_packed_rows_loss_is_the_token_weighted_mean_over_its_documents():
    model = tiny_llama().eval()
    docs = documents([7, 3, 12, 5])
    with torch.no_grad():
        packed = model(**packed_collate([{"input_ids": d} for d in docs], boundaries=False))
        alone = [model(input_ids=d[None], labels=d[None]).loss for d in docs]
        targets = [len(d) - 1 for d in docs]  # a causal LM predicts all but the first token
        weighted = sum(loss * n for loss, n in zip(alone, targets, strict=True)) / sum(targets)
        assert torch.allclose(packed.loss, weighted, rtol=1e-5)
        # Negative control: labels that keep the first token let a document predict its
        # successor's first token from its own last one.
        leaky = packed_collate([{"input_ids": d} for d in docs], boundaries=False)
        leaky["labels"] = leaky["input_ids"].clone()
        assert not torch.allclose(model(**leaky).loss, weighted, rtol=1e-3)


# --- the document masks --------------------------------------------------------------------


@pytest.mark.parametrize("causal", [True, False])
def test_document_masks_confine_attention_to_each_document(causal):
    sizes = [3, 5, 2]
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor(sizes)).unsqueeze(0)
    q, k, v = torch.randn(3, 1, 2, 10, 8).unbind(0)
    packed = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(ids, causal=causal))
    pieces = [t.split(sizes, dim=2) for t in (q, k, v)]
    alone = torch.cat(
        [
            F.scaled_dot_product_attention(a, b, c, is_causal=causal)
            for a, b, c in zip(*pieces, strict=True)
        ],
        dim=2,
    )
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-6)
    unmasked = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert not torch.allclose(unmasked, alone, atol=1e-3)  # negative control
    from torch.nn.attention.flex_attention import flex_attention

    with warnings.catch_warnings():  # flex_attention warns when run uncompiled, as here
        warnings.simplefilter("ignore", UserWarning)
        flexed = flex_attention(q, k, v, block_mask=flex_document_mask(ids, causal=causal))
    torch.testing.assert_close(flexed, alone, rtol=1e-4, atol=1e-5)


# --- the isolation check -------------------------------------------------------------------


@pytest.mark.parametrize(
    "build", [tiny_llama, tiny_gpt2, DocumentAttention], ids=lambda b: b.__name__
)
def test_the_isolation_check_passes_models_that_keep_documents_apart(build):
    verdict = check_isolation(build(), documents([6, 3, 9]))
    assert verdict.ok, verdict.reason
    assert verdict.output_difference is not None and verdict.output_difference < 1e-5


def test_the_isolation_check_refuses_each_kind_of_leak_with_its_reason():
    docs = documents([6, 3, 9])
    ignoring = check_isolation(CountedPositions(), docs)
    assert not ignoring.ok and "ignores position_ids" in ignoring.reason
    leaking = check_isolation(DocumentAttention(isolate=False), docs)
    assert not leaking.ok and "attention leaks across documents" in leaking.reason
    cached = check_isolation(tiny_llama(use_cache=True), docs)
    assert not cached.ok and "use_cache = False" in cached.reason
    torch.manual_seed(0)
    roberta = RobertaModel(
        RobertaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            max_position_embeddings=64,
            pad_token_id=1,
        )
    )
    shifted = check_isolation(roberta, docs)
    assert not shifted.ok and "position_ids_start=2" in shifted.reason
    no_positions = check_isolation(nn.Sequential(nn.Embedding(VOCAB, 4)), docs)
    assert not no_positions.ok and "takes no position_ids" in no_positions.reason


def test_a_bert_encoder_is_refused_its_bidirectional_mask_ignores_the_documents():
    """transformers builds the packed-sequence mask for causal masks only: BERT's
    bidirectional attention reads across documents (the truth in 5.x, tested as such)."""
    torch.manual_seed(0)
    bert = BertModel(
        BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            max_position_embeddings=64,
        )
    )
    verdict = check_isolation(bert, documents([6, 3, 9]))
    assert not verdict.ok and "attention leaks across documents" in verdict.reason
    assert bert.training  # the check restores the mode it found


# --- configuration, training, the tuner and the translations -------------------------------


def test_one_field_names_the_batch_plan_and_a_budget_needs_one():
    """Packing and buckets are two values of one field: they cannot be asked for together."""
    assert CPU.replace(data__batches="packed", data__max_tokens=256).data.max_tokens == 256
    with pytest.raises(ConfigError, match="only used with batches = 'buckets' or 'packed'"):
        CPU.replace(data__max_tokens=256)


def _lm_dataset(n: int = 24) -> tuple[list[dict[str, torch.Tensor]], list[int]]:
    lengths = long_tailed(n, seed=1).tolist()
    return [{"input_ids": d} for d in documents(lengths, seed=1)], lengths


def _hf_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    return model(**batch).loss, int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def _train(model: nn.Module, config: TurboConfig, **setup_kw) -> tuple[list[float], Turbo]:
    dataset, lengths = _lm_dataset()
    turbo = Turbo(config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer, loader = turbo.setup(
        model, optimizer, dataset, lengths=lengths, seed=0, **setup_kw
    )
    losses = [float(turbo.step(_hf_loss, batch).loss) for batch in loader]
    return losses, turbo


def test_packed_training_reaches_the_unpacked_losses_on_the_same_documents():
    config = CPU.replace(data__batches="packed", data__max_tokens=64)
    packed, _ = _train(tiny_llama(), config)
    # The same bins, padded into rows of one document each (labels -100 on the padding).
    _, lengths = _lm_dataset()
    bins = PackingBatchSampler(lengths, max_tokens=64, seed=0)

    def padded(samples):
        batch = pad_collate(
            [{"input_ids": s["input_ids"], "labels": s["input_ids"]} for s in samples]
        )
        batch["labels"][batch["attention_mask"] == 0] = IGNORE_INDEX
        return batch

    unpacked, _ = _train(tiny_llama(), CPU, batch_sampler=bins, collate_fn=padded)
    assert len(packed) == len(unpacked) >= 3
    # float32, other row shapes: sums in another order, about 1e-6 relative per step.
    assert packed == pytest.approx(unpacked, rel=1e-4)
    # Negative control: a model that lets documents attend to each other is refused before any
    # step (it would train silently wrong), as every host that packs refuses it.
    with pytest.raises(ValueError, match="refused on LlamaForCausalLM: attention leaks"):
        _train(tiny_llama(use_cache=True), config)


def _recipe(build) -> Recipe:
    dataset, lengths = _lm_dataset()
    return Recipe(
        name="tiny-lm",
        model=build,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        loss_fn=_hf_loss,
        dataset=dataset,
        batch_size=4,
        lengths=lengths,
        count_unit="tokens",
    )


def test_the_tuner_proposes_packing_only_on_a_model_that_passes_the_check():
    facts = types.SimpleNamespace(padding=(0.6, 0.1))
    context = types.SimpleNamespace(recipe=_recipe(tiny_llama), best=CPU, facts=facts)
    (candidate,) = packing_stage(context)
    assert candidate.config.data.batches == "packed"
    batches = planned_batches(context.recipe, candidate.config, 4)
    assert all(b["input_ids"].shape[0] == 1 and "attention_mask" not in b for b in batches)
    buckets = CPU.replace(data__batches="buckets")
    from_buckets = packing_stage(
        types.SimpleNamespace(recipe=context.recipe, best=buckets, facts=facts)
    )
    # Measured against buckets, instead of them.
    assert from_buckets[0].config.data.batches == "packed"
    refused = packing_stage(
        types.SimpleNamespace(recipe=_recipe(CountedPositions), best=CPU, facts=facts)
    )
    assert isinstance(refused, str) and "ignores position_ids" in refused


def test_the_translations_tell_each_trainer_how_to_pack():
    config = CPU.replace(data__batches="packed")
    note = hf_arguments(config).notes["[data] batches"]
    assert "DataCollatorWithFlattening(position_ids_start=0)" in note
    parameters = inspect.signature(DataCollatorWithFlattening).parameters
    assert {"position_ids_start", "return_flash_attn_kwargs"} <= set(parameters)
    lightning = lightning_arguments(config)
    assert (
        "TurboLightningCallback: it rebuilds the train DataLoader"
        in lightning.notes["[data] batches"]
    )
    assert lightning.kwargs["use_distributed_sampler"] is False  # each rank its whole rows


def test_turbo_trainer_trains_on_packed_rows_and_refuses_a_model_that_leaks(tmp_path):
    from transformers import TrainingArguments

    from torchturbo.integrations.transformers import TurboTrainer

    dataset, _ = _lm_dataset()
    seen: list[dict[str, torch.Tensor]] = []
    model = tiny_llama(use_cache=True)  # the Trainer sets use_cache=False, its default
    model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw), with_kwargs=True)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=2,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        save_strategy="no",
    )
    config = CPU.replace(data__batches="packed")
    TurboTrainer(model=model, args=args, train_dataset=dataset, turbo_config=config).train()
    trained = [kw for kw in seen if kw["input_ids"].requires_grad is False and "labels" in kw]
    assert trained and all(kw["input_ids"].shape[0] == 1 for kw in trained)
    assert all("attention_mask" not in kw and "position_ids" in kw for kw in trained)
    leaky = TurboTrainer(
        model=DocumentAttention(isolate=False),
        args=args,
        train_dataset=dataset,
        turbo_config=config,
    )
    with pytest.raises(ValueError, match="batches = 'packed' refused on DocumentAttention"):
        leaky.get_train_dataloader()


def test_a_trainers_recipe_builds_its_models_with_the_trainers_use_cache(tmp_path):
    """A Llama config defaults to use_cache=True, which leaks across packed documents; the
    Trainer trains with its own use_cache (False), so the tuner's check must see that model,
    or it would refuse packing on every Llama a Trainer fine-tunes."""
    from transformers import Trainer, TrainingArguments

    from torchturbo.integrations.transformers import recipe_from_trainer
    from torchturbo.techniques.packing import recipe_isolation

    dataset, _ = _lm_dataset()
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, report_to="none", use_cpu=True
    )
    trainer = Trainer(
        model_init=lambda: tiny_llama(use_cache=True),
        args=args,
        train_dataset=[{**d, "labels": d["input_ids"]} for d in dataset],
        data_collator=pad_collate,
    )
    recipe = recipe_from_trainer(trainer)
    assert recipe.model().config.use_cache is False
    verdict = recipe_isolation(recipe)
    assert verdict.ok, verdict.reason


def test_the_tuners_packed_rows_hold_only_what_the_recipes_collate_keeps():
    """A Trainer's dataset carries columns its model does not take (raw text); the recipe's
    collate drops them, and so must the packed rows the tuner trains on."""
    dataset, lengths = _lm_dataset(8)
    with_text = [{**d, "text": "raw"} for d in dataset]

    def collate(samples):
        return pad_collate([{"input_ids": s["input_ids"]} for s in samples])

    recipe = Recipe(
        name="with-text",
        model=tiny_llama,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        loss_fn=_hf_loss,
        dataset=with_text,
        batch_size=4,
        collate=collate,
        lengths=lengths,
    )
    packing = CPU.replace(data__batches="packed")
    rows = planned_batches(recipe, packing, 2)
    assert rows and all("text" not in row and "position_ids" in row for row in rows)
    unfiltered = planned_batches(dataclasses.replace(recipe, collate=None), packing, 1)
    assert "text" in unfiltered[0]  # the control: packed_collate alone keeps every column
