"""The loader ``Turbo.setup`` builds from a dataset: bucketed by length when the config asks,
split across ranks under torchrun, and otherwise what ``build_loader`` makes of ``[data]``."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from torchturbo.config import DataConfig
from torchturbo.data.bucketing import BucketBatchSampler
from torchturbo.data.collate import pad_collate
from torchturbo.data.loader import build_loader
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
) -> DataLoader:
    """A DataLoader over ``data`` for this rank (see ``Turbo.setup`` for the arguments).

    Without ``collate_fn``, :func:`pad_collate` pads variable-length fields of dict samples
    (``pad_values`` per field) and collates the rest as torch's default collate does.
    ``[data] bucketing = true`` batches by ``lengths`` (the bucketing sampler shards whole
    batches across ranks itself); otherwise a dataset with ``batch_size`` is split across ranks
    by the strategy, and a ``batch_sampler`` of the caller's is used as given.
    """
    collate_fn = collate_fn or functools.partial(
        pad_collate, pad_to_multiple=config.pad_to_multiple, pad_values=pad_values
    )
    if config.bucketing:
        batch_sampler = _bucket_sampler(config, lengths, batch_size, seed)
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


def _bucket_sampler(
    config: DataConfig, lengths: Sequence[int] | None, batch_size: int | None, seed: int | None
) -> BucketBatchSampler:
    """The length-bucketing batch sampler that ``[data] bucketing = true`` asks for."""
    if lengths is None:
        raise ValueError(
            "[data] bucketing = true needs per-sample lengths: pass setup(..., lengths=[...])"
        )
    max_tokens = config.max_tokens
    if max_tokens is None:
        if batch_size is None:
            raise ValueError(
                "[data] bucketing = true without max_tokens needs batch_size= to derive the "
                "token budget (batch_size x mean length)"
            )
        max_tokens = max(round(batch_size * sum(lengths) / len(lengths)), max(lengths))
    return BucketBatchSampler(
        lengths, max_tokens=max_tokens, pad_to_multiple=config.pad_to_multiple, seed=seed or 0
    )
