"""The loader ``Turbo.setup`` builds from a dataset: bucketed by length or packed when the config
asks, split across ranks under torchrun, and otherwise what ``build_loader`` makes of ``[data]``."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from torchturbo.config import DataConfig
from torchturbo.data.bucketing import BucketBatchSampler
from torchturbo.data.collate import pad_collate
from torchturbo.data.loader import build_loader
from torchturbo.data.packing import PackingBatchSampler, packed_collate, takes_boundaries
from torchturbo.distributed.strategy import Strategy


def training_loader(
    data: Dataset,
    *,
    config: DataConfig,
    device: torch.device,
    strategy: Strategy,
    batch_size: int | None,
    collate_fn: Callable[[list[Any]], Any] | None,
    batch_sampler: Any,
    shuffle: bool,
    seed: int | None,
    lengths: Sequence[int] | None,
    pad_values: Mapping[str, int] | None,
    model: nn.Module,
) -> DataLoader:
    """A DataLoader over ``data`` for this rank (see ``Turbo.setup`` for the arguments).

    Without ``collate_fn``, :func:`pad_collate` pads variable-length fields of dict samples
    (``pad_values`` per field) and collates the rest as torch's default collate does.
    ``[data] bucketing = true`` batches by ``lengths`` (the bucketing sampler shards whole
    batches across ranks itself); otherwise a dataset with ``batch_size`` is split across ranks
    by the strategy, and a ``batch_sampler`` of the caller's is used as given. ``[data] packing
    = true`` packs whole documents into one row per batch (``data/packing.py``; the sampler
    shards whole rows), collated by :func:`packed_collate` unless ``collate_fn`` is given, with
    the document boundaries when ``model``'s forward takes them.
    """
    if config.packing:
        collate_fn = collate_fn or functools.partial(
            packed_collate, boundaries=takes_boundaries(model)
        )
        lengths, budget = _token_budget("packing", config, lengths, batch_size)
        batch_sampler = PackingBatchSampler(lengths, max_tokens=budget, seed=seed or 0)
        batch_size = None
    collate_fn = collate_fn or functools.partial(
        pad_collate, pad_to_multiple=config.pad_to_multiple, pad_values=pad_values
    )
    if config.bucketing:
        lengths, budget = _token_budget("bucketing", config, lengths, batch_size)
        batch_sampler = BucketBatchSampler(
            lengths,
            max_tokens=budget,
            pad_to_multiple=config.pad_to_multiple,
            seed=seed or 0,
        )
        batch_size = None
    elif batch_sampler is None and batch_size is not None:
        batch_sampler = strategy.batch_sampler(data, batch_size, shuffle=shuffle, seed=seed or 0)
        batch_size = None if batch_sampler is not None else batch_size
    if batch_size is None and batch_sampler is None:
        raise ValueError("setup() got a dataset: pass batch_size= or batch_sampler=")
    return build_loader(
        data,
        batch_size=batch_size,
        config=config,
        device=device,
        shuffle=shuffle,
        collate_fn=collate_fn,
        batch_sampler=batch_sampler,
        seed=seed,
    )


def _token_budget(
    field: str, config: DataConfig, lengths: Sequence[int] | None, batch_size: int | None
) -> tuple[Sequence[int], int]:
    """The lengths, and ``[data] max_tokens`` or else batch size x mean length (at least the
    longest sample, which must fit on its own)."""
    if lengths is None:
        raise ValueError(
            f"[data] {field} = true needs per-sample lengths: pass setup(..., lengths=[...])"
        )
    if config.max_tokens is not None:
        return lengths, config.max_tokens
    if batch_size is None:
        raise ValueError(
            f"[data] {field} = true without max_tokens needs batch_size= to derive the "
            "token budget (batch_size x mean length)"
        )
    return lengths, max(round(batch_size * sum(lengths) / len(lengths)), max(lengths))
