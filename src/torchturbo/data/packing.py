"""Sequence packing: whole documents packed into rows of a token budget, with no padding.

Length buckets still pad every row to its batch's longest sample; packing concatenates whole
documents into one row of at most ``max_tokens`` tokens, so a batch computes no padding at all.
The model must then keep documents apart: positions restart at 0 for every document
(``position_ids``), attention is confined to each document (Hugging Face models build that mask
from restarting ``position_ids``; plain models use ``document_mask``/``flex_document_mask`` from
``document_ids``), and a causal LM never predicts the first token of a document from the last one
of the previous document (its label is ``IGNORE_INDEX``). The loss, a mean over the row's label
tokens, is then exactly the token-weighted mean over its documents.

:class:`PackingBatchSampler` plans bins per epoch, deterministically in ``(seed, epoch)``, like
``BucketBatchSampler`` (whose sharding, ``set_epoch`` and resumption it inherits): shuffle, split
into mega-batches of about ``mega_batch_size`` budgets, pack each mega-batch first-fit
decreasing, shuffle the bins, shard whole bins across ranks with equal counts. First-fit leaves
at most one bin per mega-batch half empty or worse (two such bins would have been merged), so the
waste is bounded; on long-tailed lengths the bins are nearly full.

Why hand-written: torch has no packing sampler; Hugging Face's ``DataCollatorWithFlattening``
flattens whatever rows the sampler gave it (a fixed row count, not a token budget) and has no
sampler; torchtune's ``PackedDataset`` packs greedily in dataset order offline, and splits
documents across rows.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import default_collate

from torchturbo.data.bucketing import BucketBatchSampler
from torchturbo.data.collate import IGNORE_INDEX

__all__ = ["PackingBatchSampler", "pack_documents", "packed_collate", "takes_boundaries"]

#: The fields of a packed batch that describe its documents, for models that take them.
BOUNDARY_FIELDS = ("document_ids", "cu_seqlens")


def pack_documents(
    indices: Iterable[int], lengths: Sequence[int], max_tokens: int
) -> list[list[int]]:
    """``indices`` packed into bins of at most ``max_tokens`` tokens, first-fit decreasing.

    Longest first, each document goes into the first bin with room for it; equal lengths keep
    the order given (a stable sort), so the result is deterministic in the input order.
    """
    ordered = sorted((int(i) for i in indices), key=lambda i: -int(lengths[i]))
    bins: list[list[int]] = []
    room: list[int] = []
    for index in ordered:
        length = int(lengths[index])
        if length > max_tokens:
            raise ValueError(
                f"sample {index} has length {length}, more than max_tokens={max_tokens} on its own"
            )
        slot = next((b for b, free in enumerate(room) if free >= length), None)
        if slot is None:
            bins.append([index])
            room.append(max_tokens - length)
        else:
            bins[slot].append(index)
            room[slot] -= length
    return bins


class PackingBatchSampler(BucketBatchSampler):
    """Yields bins of sample indices whose lengths sum to at most ``max_tokens``, for
    ``DataLoader(batch_sampler=..., collate_fn=packed_collate)``.

    The other arguments, the sharding across ranks (equal bin counts on every rank), ``set_epoch``
    and ``state_dict``/``load_state_dict`` are :class:`BucketBatchSampler`'s.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        *,
        max_tokens: int,
        mega_batch_size: int = 64,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        super().__init__(
            lengths,
            max_tokens=max_tokens,
            mega_batch_size=mega_batch_size,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            num_replicas=num_replicas,
            rank=rank,
        )

    def global_batches(self) -> list[list[int]]:
        """All bins of the current epoch, before sharding, in the order ranks take them."""
        assert self.max_tokens is not None  # a required argument of __init__
        generator = np.random.default_rng([self.seed, self.epoch])
        n = len(self._length_list)
        order = generator.permutation(n) if self.shuffle else np.arange(n)
        bins: list[list[int]] = []
        for mega in self._mega_batches(order):
            bins += pack_documents(mega.tolist(), self._length_list, self.max_tokens)
        if self.shuffle:
            bins = [bins[i] for i in generator.permutation(len(bins))]
        return bins


def fill_fraction(bins: Iterable[Sequence[int]], lengths: Sequence[int], max_tokens: int) -> float:
    """Real tokens over the budget of all bins: how full packing keeps its rows."""
    counts = [sum(int(lengths[i]) for i in b) for b in bins]
    if not counts:
        raise ValueError("fill_fraction got no bins")
    return sum(counts) / (len(counts) * max_tokens)


def packed_collate(
    samples: Sequence[Mapping[str, Any]],
    *,
    boundaries: bool = True,
    flash_attn_kwargs: bool = False,
    position_ids_start: int = 0,
) -> dict[str, Any]:
    """One packed row ``[1, T]`` from dict samples with ``input_ids`` (and optional ``labels``).

    Returns ``input_ids``, ``labels`` (a sample's own, else its ``input_ids``, with the first
    token of every document set to ``IGNORE_INDEX``) and ``position_ids`` restarting at
    ``position_ids_start``. ``boundaries`` adds ``document_ids`` [1, T] (0, 1, ... per document)
    and ``cu_seqlens`` [D + 1] (int32 offsets); ``flash_attn_kwargs`` adds Hugging Face's
    ``cu_seq_lens_q/k`` and ``max_length_q/k`` for its varlen flash-attention path. Other fields
    as long as the document are concatenated too; per-document fields (a class label) are
    collated as torch collates them, one entry per document. An ``attention_mask`` is dropped:
    with one, Hugging Face models stop reading the documents from ``position_ids``.
    """
    if not samples:
        raise ValueError("packed_collate got an empty batch")
    documents = [_document(sample, index) for index, sample in enumerate(samples)]
    sizes = [int(d["input_ids"].shape[0]) for d in documents]
    batch: dict[str, Any] = {}
    for key in documents[0]:
        values = [d[key] for d in documents]
        if key in ("input_ids", "labels") or _per_token(values, sizes):
            batch[key] = torch.cat(values).unsqueeze(0)
        else:
            batch[key] = default_collate(values)
    starts = torch.tensor([0, *np.cumsum(sizes)[:-1].tolist()], dtype=torch.int64)
    batch["labels"][0, starts] = IGNORE_INDEX
    document_ids = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    positions = torch.arange(sum(sizes)) - starts[document_ids] + position_ids_start
    batch["position_ids"] = positions.unsqueeze(0)
    cu_seqlens = torch.tensor([0, *np.cumsum(sizes).tolist()], dtype=torch.int32)
    if boundaries:
        batch["document_ids"] = document_ids.unsqueeze(0)
        batch["cu_seqlens"] = cu_seqlens
    if flash_attn_kwargs:
        batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = cu_seqlens
        batch["max_length_q"] = batch["max_length_k"] = max(sizes)
    return batch


def _document(sample: Mapping[str, Any], index: int) -> dict[str, Any]:
    if not isinstance(sample, Mapping) or "input_ids" not in sample:
        raise ValueError(
            f"packed_collate: sample {index} is not a dict with 'input_ids' "
            f"(got {type(sample).__name__}); packing needs token ids per document"
        )
    document = {k: v for k, v in sample.items() if k != "attention_mask"}
    ids = torch.as_tensor(document["input_ids"])
    if ids.dim() != 1 or ids.numel() == 0 or ids.is_floating_point():
        raise ValueError(
            f"packed_collate: sample {index}'s input_ids must be a non-empty 1-D tensor of token "
            f"ids, got shape {tuple(ids.shape)} and dtype {ids.dtype}"
        )
    document["input_ids"] = ids.long()
    labels = document.get("labels")
    document["labels"] = ids.long().clone() if labels is None else torch.as_tensor(labels).clone()
    if document["labels"].shape != ids.shape:
        raise ValueError(
            f"packed_collate: sample {index}'s labels have shape {tuple(document['labels'].shape)}"
            f", its input_ids {tuple(ids.shape)}: packing needs one label per token"
        )
    return document


def _per_token(values: list[Any], sizes: list[int]) -> bool:
    return all(
        isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == n
        for v, n in zip(values, sizes, strict=True)
    ) and any(n > 1 for n in sizes)


def takes_boundaries(model: nn.Module) -> bool:
    """Whether ``model``'s forward names a boundary field (``document_ids``, ``cu_seqlens``):
    packed batches then carry them; otherwise (Hugging Face models, which read ``position_ids``
    and would get the extras in ``**kwargs``) they carry only what the model reads."""
    parameters = inspect.signature(model.forward).parameters
    return any(name in parameters for name in BOUNDARY_FIELDS)
