"""A Hugging Face transformers encoder as a user would hand it to torchturbo: a token-tagging
BERT built from a config (no download), on long-tailed synthetic sequences of dict samples
(``input_ids``, ``attention_mask``, ``labels``) with no collate of the recipe's own.

The labelling rule is learnable: a token's label is its id modulo the number of labels, so the
loss falls within a few steps. The loss is the model's own (``outputs.loss``, a mean over the
label tokens), and the count is the number of label tokens, so accumulation is token-weighted.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

import torchturbo

NUM_LABELS = 8
VOCAB = 512


class TaggedSequences(Dataset):
    def __init__(self, lengths: list[int], seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.samples = []
        for length in lengths:
            ids = torch.randint(1, VOCAB, (length,), generator=generator)
            self.samples.append(
                {
                    "input_ids": ids,
                    "attention_mask": torch.ones(length, dtype=torch.long),
                    "labels": ids % NUM_LABELS,
                }
            )

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.samples[index]


def long_tailed_lengths(count: int, median: int = 24, cap: int = 256, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.exp(torch.randn(count, generator=generator) * 0.9) * median
    return [int(n) for n in lengths.clamp(4, cap)]


def model():
    from transformers import BertConfig, BertForTokenClassification

    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=256,
        num_labels=NUM_LABELS,
    )
    return BertForTokenClassification(config)


def loss_fn(model, batch):
    outputs = model(**batch)
    return outputs.loss, (batch["labels"] != -100).sum()


def recipe(num_samples: int = 512) -> torchturbo.Recipe:
    lengths = long_tailed_lengths(num_samples)
    return torchturbo.Recipe(
        name="hf-bert-tagger",
        model=model,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        loss_fn=loss_fn,
        dataset=TaggedSequences(lengths),
        batch_size=16,
        lengths=lengths,
        count_unit="tokens",
    )
