"""A Hugging Face causal LM handed over as its ``Trainer``: a tiny Llama built from a config (no
download) on long-tailed synthetic documents whose next token is learnable (each document counts
up from a random start, modulo the vocabulary), collated by transformers' own padding collator.

``trainer()`` is the Trainer a user's script builds; ``recipe()`` is what they hand to
``torchturbo tune``/``doctor`` (``recipe_from_trainer``), so the tuner measures packing, buckets
and the chunked loss on a real ``LlamaForCausalLM``.
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch

VOCAB = 128


def documents(count: int = 48, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = (torch.randn(count, generator=generator) * 0.8).exp() * 12
    samples = []
    for length in lengths.clamp(3, 64).long().tolist():
        start = int(torch.randint(VOCAB, (1,), generator=generator))
        ids = (torch.arange(length) + start) % VOCAB
        samples.append({"input_ids": ids.tolist()})
    return samples


def tokenizer() -> Any:
    """A word-level tokenizer over the synthetic ids, built in code: the collator pads with it."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, **{f"t{i}": i for i in range(1, VOCAB)}}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t1")), pad_token="[PAD]"
    )


def collator() -> Any:
    """transformers' padding collator for causal LMs (labels are the inputs, -100 on padding)."""
    from transformers import DataCollatorForLanguageModeling

    return DataCollatorForLanguageModeling(tokenizer(), mlm=False)


def model() -> Any:
    return _llama(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )


def logits_heavy_model() -> Any:
    """A Llama whose 4,096-word head's logits hold most of a forward's activations: the
    chunked loss is expected to gain on it."""
    return _llama(
        vocab_size=4096,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )


def _llama(**sizes: Any) -> Any:
    """A LlamaForCausalLM of ``sizes`` (``LlamaConfig`` fields), seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**sizes))


def trainer(**arguments: Any) -> Any:
    """The Trainer, not yet trained; ``arguments`` go to its ``TrainingArguments``."""
    from transformers import Trainer, TrainingArguments

    defaults = {
        "output_dir": tempfile.mkdtemp(prefix="hf-causal-lm-"),
        "per_device_train_batch_size": 4,
        "max_steps": 4,
        "learning_rate": 1e-3,
        "report_to": "none",
        "use_cpu": True,
        "disable_tqdm": True,
        "save_strategy": "no",
    }
    args = TrainingArguments(**{**defaults, **arguments})
    return Trainer(model=model(), args=args, train_dataset=documents(), data_collator=collator())


def recipe() -> Any:
    from torchturbo.integrations.transformers import recipe_from_trainer

    return recipe_from_trainer(trainer())
