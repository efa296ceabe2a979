"""The loader ``Turbo.setup`` builds from a dataset: the config's batch plan when a technique
plans the batches (length buckets, packing: ``registry.batch_plan``, which the trainers and the
tuner's trials build alike), else the caller's batches, split across ranks under torchrun."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset

from torchturbo.config import TurboConfig
from torchturbo.data.batch_plan import BatchSource
from torchturbo.data.chunked_plan import ChunkedPlanSampler, Draw, SidedCollate, SidedDataset
from torchturbo.data.collate import pad_collate
from torchturbo.data.loader import build_loader
from torchturbo.data.streams import RankShare
from torchturbo.distributed.strategy import Strategy
from torchturbo.recipe import Recipe
from torchturbo.techniques import registry


def recipe_data(recipe: Recipe) -> dict[str, Any]:
    """The ``Turbo.setup`` arguments that train on a recipe's dataset, as ``torchturbo.train``
    passes them (the tuner's trials plan the same batches from the same recipe fields)."""
    return {
        "batch_size": recipe.batch_size,
        "collate_fn": recipe.collate,
        "seed": recipe.seed,
        "lengths": recipe.lengths,
        "pad_values": recipe.pad_values,
    }


def training_loader(
    data: Dataset,
    *,
    config: TurboConfig,
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

    A batch plan (``[data] batches`` buckets or packed) shards whole batches across ranks itself
    and replaces the caller's ``batch_sampler``; otherwise a dataset with ``batch_size`` is split
    across ranks by the strategy, a stream (``IterableDataset``) is dealt out to them
    (``data.streams.RankShare``), and a ``batch_sampler`` of the caller's is used as given.
    Without ``collate_fn``, :func:`pad_collate` pads variable-length fields of dict samples
    (``pad_values`` per field) and collates the rest as torch's default collate does.
    """
    env = strategy.env
    source = BatchSource(
        data,
        lengths,
        batch_size,
        seed=seed or 0,
        num_replicas=env.world_size,
        rank=env.rank,
        collate=collate_fn,
        pad_values=pad_values,
        model=lambda: model,
        lengths_from="pass setup(..., lengths=[...]) (one per sample)",
    )
    plan = registry.batch_plan(config, source)
    if plan.dynamic:
        if batch_sampler is not None:
            raise ValueError(
                f"setup() got a batch_sampler, but the config plans the batches itself "
                f"({plan.kind}): pass the dataset alone, or set [data] batches = 'rows'"
            )
        return build_loader(
            data,
            config=config.data,
            device=device,
            collate_fn=plan.collate,
            batch_sampler=plan.sampler,
            seed=seed,
        )
    collate_fn = rows_collate(config, collate_fn, pad_values)
    if isinstance(data, IterableDataset):
        if env.world_size > 1:  # no index to split by: dealt out, an equal share each
            data = RankShare(data, env.world_size, env.rank)
    elif batch_sampler is None and batch_size is not None:
        batch_sampler = strategy.batch_sampler(data, batch_size, shuffle=shuffle, seed=seed or 0)
        batch_size = None if batch_sampler is not None else batch_size
    if batch_size is None and batch_sampler is None:
        raise ValueError("setup() got a dataset: pass batch_size= or batch_sampler=")
    return build_loader(
        data,
        batch_size=batch_size,
        config=config.data,
        device=device,
        shuffle=shuffle,
        collate_fn=collate_fn,
        batch_sampler=batch_sampler,
        seed=seed,
    )


def chunked_loader(
    data: Dataset,
    *,
    config: TurboConfig,
    with_plan: TurboConfig,
    device: torch.device,
    draw: Callable[[int, int], Draw],
    batch_size: int,
    collate_fn: Callable[[list[Any]], Any] | None,
    seed: int | None,
    lengths: Sequence[int],
    pad_values: Mapping[str, int] | None,
) -> DataLoader:
    """A DataLoader over ``data`` batched by chunks (``data/chunked_plan.py``) for the in-run
    tuner to measure ``with_plan``'s batch plan: a chunk on its side is batched by that plan
    over the chunk's samples alone (``registry.batch_plan`` on a ``Subset``), one on the other
    side by ``batch_size`` rows as ``config`` collates them. One process, a map-style dataset."""
    source = BatchSource(
        data,
        lengths,
        batch_size,
        seed=seed or 0,
        collate=collate_fn,
        pad_values=pad_values,
        lengths_from="pass setup(..., lengths=[...]) (one per sample)",
    )
    whole = registry.batch_plan(with_plan, source)
    assert whole.collate is not None  # a plan measured by chunks batches by its own collate

    def plan(indices: np.ndarray, chunk_seed: int) -> list[list[int]]:
        part = dataclasses.replace(
            source,
            dataset=Subset(data, indices.tolist()),
            lengths=[int(lengths[i]) for i in indices],
            seed=chunk_seed,
        )
        batches = registry.batch_plan(with_plan, part).sampler.global_batches()
        return [[int(indices[j]) for j in batch] for batch in batches]

    rows = rows_collate(config, collate_fn, pad_values)
    return build_loader(
        SidedDataset(data),
        config=config.data,
        device=device,
        collate_fn=SidedCollate((whole.collate, rows)),
        batch_sampler=ChunkedPlanSampler(lengths, batch_size, plan, draw, seed=seed or 0),
        seed=seed,
    )


def rows_collate(
    config: TurboConfig,
    collate_fn: Callable[[list[Any]], Any] | None,
    pad_values: Mapping[str, int] | None,
) -> Callable[[list[Any]], Any]:
    """The collate of the user's rows: theirs, else :func:`pad_collate` at the config's
    padding multiple."""
    return collate_fn or functools.partial(
        pad_collate, pad_to_multiple=config.data.pad_to_multiple, pad_values=pad_values
    )


def first_samples_batch(
    data: Any,
    count: int,
    *,
    collate_fn: Callable[[list[Any]], Any] | None,
    pad_values: Mapping[str, int] | None,
) -> Any:
    """The first ``count`` samples of a map-style dataset (a DataLoader's own), collated as the
    loader collates them; None for a stream or an empty dataset."""
    if isinstance(data, DataLoader):
        collate_fn, data = collate_fn or data.collate_fn, data.dataset
    if data is None or isinstance(data, IterableDataset) or not hasattr(data, "__len__"):
        return None
    samples = [data[i] for i in range(min(count, len(data)))]
    if not samples:
        return None
    collate = collate_fn or functools.partial(pad_collate, pad_values=pad_values)
    return collate(samples)
