"""Padding collate for variable-length token samples.

Pads to the longest sample of the batch (optionally rounded up to a multiple, e.g. 8 for
TensorCore-friendly shapes), keeps token ids as int64, and returns the mask and lengths that the
model and the token-weighted loss need.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

IGNORE_INDEX = -100  # the default ignore_index of torch.nn.functional.cross_entropy


def pad_collate(
    samples: Sequence[dict[str, torch.Tensor]],
    *,
    pad_id: int = 0,
    pad_to_multiple: int = 1,
) -> dict[str, torch.Tensor]:
    """Collate ``{"tokens": LongTensor[L], "labels": LongTensor[L]}`` samples into a batch.

    Returns ``tokens`` [B, T] int64 padded with ``pad_id``, ``labels`` [B, T] padded with
    ``IGNORE_INDEX``, ``mask`` [B, T] bool (True on real tokens) and ``lengths`` [B] int64.
    """
    if not samples:
        raise ValueError("pad_collate got an empty batch")
    if pad_to_multiple < 1:
        raise ValueError(f"pad_to_multiple must be >= 1, got {pad_to_multiple}")
    lengths = torch.tensor([len(s["tokens"]) for s in samples], dtype=torch.int64)
    longest = int(lengths.max())
    padded_len = -(-longest // pad_to_multiple) * pad_to_multiple
    batch_size = len(samples)
    tokens = torch.full((batch_size, padded_len), pad_id, dtype=torch.int64)
    labels = torch.full((batch_size, padded_len), IGNORE_INDEX, dtype=torch.int64)
    for row, sample in enumerate(samples):
        n = len(sample["tokens"])
        tokens[row, :n] = sample["tokens"]
        labels[row, :n] = sample["labels"]
    mask = torch.arange(padded_len).unsqueeze(0) < lengths.unsqueeze(1)
    return {"tokens": tokens, "labels": labels, "mask": mask, "lengths": lengths}
