"""Batches of a few fixed shapes: what CUDA graphs and shape-specialised compiled code need.

A CUDA graph (``torch.compile(mode="reduce-overhead")``) replays the kernels it recorded for one
input shape; a batch of a new shape records a new graph, and a compile with ``dynamic=False``
compiles again. Length buckets make a new (rows, length) shape almost every batch and packed rows
a new length every row, so no graph is ever replayed (pytorch#188150 measured no gain where every
batch had a new shape). With ``[data] max_shapes = N`` the batch plans pad to a few shapes:

- **buckets**: a batch's padded length goes up a ladder of at most N lengths (those that pad the
  data's samples least, found exactly) and its rows up to the token budget's rows at that length,
  with empty rows: one attended pad token each (a row with no attended token is a softmax over
  nothing, NaN in some attention implementations, and NaN times a zero gradient is still NaN),
  labels ignored;
- **packed rows**: every row is filled to the token budget with one padding document whose labels
  are ignored; the isolation check already proved that documents do not see each other.

What it costs is computed positions: on the text workload's long-tailed lengths a bucket plan of
16 shapes computes 1.14x its real tokens' positions, of 8 shapes 1.28x, of 4 shapes 1.66x, against
1.03x for buckets as the data gives them (a ladder at the lengths' quantiles computed 2.2x at 8
shapes); packed rows of one shape 1.02x (``benchmarks/shapes.py``).

The real tokens' outputs and a loss over labelled tokens (``IGNORE_INDEX`` skipped, token-weighted
as torchturbo's accumulation counts them) are those of the unpadded batch, up to float rounding
in kernels of another shape; a loss averaged per row, or a model that mixes rows (BatchNorm over
tokens), sees the empty rows: the tuner's loss-parity check refuses such a model. Hand-written:
no library pads a batch to a shape ladder (Hugging Face's collators pad to a multiple).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from torchturbo.data.collate import IGNORE_INDEX

#: Fields a dict batch marks attended positions in (torchturbo's ``mask``, Hugging Face's
#: ``attention_mask``) and the per-row length field of torchturbo's text batches.
_MASKS = ("mask", "attention_mask")
_LENGTHS = "lengths"
#: The fields that give a dict batch its sequence length, in order of preference.
_SEQUENCE_KEYS = ("tokens", "input_ids")


_NONE, _FEWER = -1, -2


def length_ladder(lengths: Sequence[int], count: int, pad_to_multiple: int = 1) -> tuple[int, ...]:
    """The at most ``count`` padded lengths (multiples of ``pad_to_multiple``, the longest sample's
    among them) that pad ``lengths`` least: each sample padded up to the next of them, the total
    of padded positions is the smallest any ``count`` lengths give.

    Dynamic programming over the distinct padded lengths: the best ladder of ``k`` rungs ending at
    the ``j``-th length is the best of ``k - 1`` rungs ending at some ``i < j`` plus the samples
    between them padded to the ``j``-th. O(count x distinct^2) with numpy over ``i``; a few ms for
    thousands of distinct lengths.
    """
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    array = np.asarray(lengths, dtype=np.int64)
    if array.ndim != 1 or array.size == 0:
        raise ValueError("length_ladder needs a non-empty 1-D sequence of lengths")
    padded = -(-array // pad_to_multiple) * pad_to_multiple
    values, counts = np.unique(padded, return_counts=True)
    if len(values) <= count:
        return tuple(int(v) for v in values)
    covered = np.concatenate([[0], np.cumsum(counts)])  # samples up to each length
    best = values * covered[1:]  # one rung at values[j] covering every shorter length
    # came_from[k, j]: the rung below values[j] in the best ladder of k + 1 rungs ending there;
    # _NONE: values[j] is its lowest rung; _FEWER: that ladder has fewer rungs (same ending).
    came_from = np.full((count, len(values)), _NONE, dtype=np.int64)
    for rungs in range(1, count):
        grown = best.copy()
        came_from[rungs, :] = _FEWER
        for j in range(1, len(values)):
            candidates = best[:j] + values[j] * (covered[j + 1] - covered[1 : j + 1])
            i = int(np.argmin(candidates))
            if candidates[i] < grown[j]:
                grown[j], came_from[rungs, j] = candidates[i], i
        best = grown
    ladder, j, rungs = [], len(values) - 1, count - 1
    while j != _NONE:
        if came_from[rungs, j] == _FEWER:
            rungs -= 1
            continue
        ladder.append(int(values[j]))
        j, rungs = int(came_from[rungs, j]), rungs - 1
    return tuple(sorted(ladder))


def rung(ladder: Sequence[int], length: int) -> int:
    """The shortest length of ``ladder`` that holds ``length``."""
    index = bisect.bisect_left(ladder, length)
    if index == len(ladder):
        raise ValueError(f"length {length} is longer than the ladder's longest, {ladder[-1]}")
    return ladder[index]


def sequence_width(batch: Mapping[str, Any]) -> int:
    """The padded length of a dict batch of token sequences ([B, T] ``tokens`` or ``input_ids``)."""
    key = next((k for k in _SEQUENCE_KEYS if isinstance(batch.get(k), torch.Tensor)), None)
    if key is None or batch[key].dim() != 2:
        raise ValueError(
            "fixed batch shapes need dict batches of [rows, length] token ids ('tokens' or "
            f"'input_ids'); got fields {sorted(batch)}"
        )
    return int(batch[key].shape[1])


def pad_batch(
    batch: Mapping[str, Any], rows: int, length: int, pad_values: Mapping[str, int] | None = None
) -> dict[str, Any]:
    """``batch`` padded to ``rows`` x ``length``: each [B, T, ...] field along both, each [B, ...]
    field along its rows. Padding is ``IGNORE_INDEX`` in label fields, 0 (or ``pad_values``)
    elsewhere; an empty row attends to its first position only (mask 1, length 1)."""
    width = sequence_width(batch)
    first = next(v for v in batch.values() if isinstance(v, torch.Tensor))
    present = int(first.shape[0])
    if rows < present or length < width:
        raise ValueError(
            f"a batch of {present} x {width} cannot be padded to {rows} x {length}: it is larger"
        )
    padded: dict[str, Any] = {}
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != present:
            padded[key] = value
            continue
        sizes = [rows, *value.shape[1:]]
        if value.dim() >= 2 and value.shape[1] == width:
            sizes[1] = length
        fill = IGNORE_INDEX if "label" in key else (pad_values or {}).get(key, 0)
        out = value.new_full(sizes, fill)
        out[tuple(slice(0, n) for n in value.shape)] = value
        if key in _MASKS and out.dim() == 2:
            out[present:, 0] = 1
        elif key == _LENGTHS and out.dim() == 1:
            out[present:] = 1
        padded[key] = out
    return padded


@dataclass(frozen=True)
class ShapedCollate:
    """A bucket plan's collate padded to the ladder: a batch of longest length ``L`` becomes
    ``max_tokens // rung(L)`` rows of ``rung(L)``. Picklable (loader workers pickle it)."""

    collate: Callable[[list[Any]], Any]
    ladder: tuple[int, ...]
    max_tokens: int
    pad_values: Mapping[str, int] | None = None

    def __call__(self, samples: list[Any]) -> Any:
        batch = self.collate(samples)
        if not isinstance(batch, Mapping):
            raise ValueError(
                "[data] max_shapes needs dict batches of token sequences; the collate returned "
                f"{type(batch).__name__}"
            )
        length = rung(self.ladder, sequence_width(batch))
        return pad_batch(batch, self.max_tokens // length, length, self.pad_values)


def padding_document(sample: Mapping[str, Any], tokens: int) -> dict[str, Any]:
    """A document of ``tokens`` pad tokens shaped like ``sample`` (a dict with ``input_ids``):
    its per-token fields filled (labels ``IGNORE_INDEX``, the rest 0), its other fields copied."""
    size = len(sample["input_ids"])
    document: dict[str, Any] = {}
    for key, value in sample.items():
        tensor = value if isinstance(value, torch.Tensor) else _numbers(value)
        if tensor is not None and tensor.dim() >= 1 and tensor.shape[0] == size:
            fill = IGNORE_INDEX if "label" in key else 0
            document[key] = tensor.new_full((tokens, *tensor.shape[1:]), fill)
        else:
            document[key] = value
    document.setdefault("labels", torch.full((tokens,), IGNORE_INDEX, dtype=torch.long))
    return document


def _numbers(value: Any) -> torch.Tensor | None:
    """``value`` as a tensor where it is numbers (a list of token ids), else None (text)."""
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        return None


@dataclass(frozen=True)
class FilledRows:
    """A packing collate whose every row is filled to ``max_tokens`` by a padding document: one
    shape for the whole plan. Picklable."""

    collate: Callable[[list[Any]], Any]
    max_tokens: int

    def __call__(self, samples: list[Any]) -> Any:
        used = sum(len(sample["input_ids"]) for sample in samples)
        if used < self.max_tokens:
            samples = [*samples, padding_document(samples[0], self.max_tokens - used)]
        return self.collate(samples)
