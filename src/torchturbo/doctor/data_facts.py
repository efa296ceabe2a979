"""What the doctor reads from the data: loader settings, the dataset's type and size, per-sample
transforms, whether batch shapes vary, and how much padding random batching would compute."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset, TensorDataset

from torchturbo.base.nested import named_tensors
from torchturbo.data.batch_plan import PlannedSampler
from torchturbo.data.length import length_or_none
from torchturbo.data.memmap import MemmapDataset

#: Dataset attributes that hold per-sample transforms (torchvision and most custom datasets).
_TRANSFORM_ATTRS = ("transform", "transforms", "target_transform")


@dataclass(frozen=True)
class LoaderFacts:
    num_workers: int
    pin_memory: bool
    persistent_workers: bool
    #: None when there are no workers (the main process does not prefetch).
    prefetch_factor: int | None
    batch_sampler: str
    bucketed: bool


def loader_facts(loader: DataLoader) -> LoaderFacts:
    sampler = loader.batch_sampler
    return LoaderFacts(
        num_workers=loader.num_workers,
        pin_memory=loader.pin_memory,
        persistent_workers=loader.persistent_workers,
        prefetch_factor=loader.prefetch_factor if loader.num_workers else None,
        batch_sampler=type(sampler).__name__ if sampler is not None else "none",
        bucketed=isinstance(sampler, PlannedSampler),
    )


@dataclass(frozen=True)
class DatasetFacts:
    kind: str
    num_samples: int | None
    #: Bytes of all samples' tensors; None when unknown (no length, or samples hold no tensors).
    nbytes: int | None
    #: True when ``nbytes`` counts tensors the dataset holds (TensorDataset); False when it is
    #: the first sample's size times the count (the samples may live on disk until read).
    in_ram: bool
    memmapped: bool
    #: Per-sample transform attributes that are set, e.g. ["transform"].
    transforms: list[str]


def dataset_facts(dataset: Dataset) -> DatasetFacts:
    while isinstance(dataset, Subset):
        dataset = dataset.dataset
    transforms = [a for a in _TRANSFORM_ATTRS if getattr(dataset, a, None) is not None]
    kind = type(dataset).__name__
    memmapped = isinstance(dataset, MemmapDataset)
    count = None if isinstance(dataset, IterableDataset) else length_or_none(dataset)
    if count is None:
        return DatasetFacts(kind, None, None, False, memmapped, transforms)
    if isinstance(dataset, TensorDataset):
        nbytes = sum(t.nbytes for t in dataset.tensors)
        return DatasetFacts(kind, count, nbytes, True, memmapped, transforms)
    sample_bytes = sum(t.nbytes for _, t in named_tensors(dataset[0])) if count else 0
    estimate = sample_bytes * count if sample_bytes else None
    return DatasetFacts(kind, count, estimate, False, memmapped, transforms)


#: A batch's shapes: (access path, shape) of each tensor.
BatchShapes = tuple[tuple[str, tuple[int, ...]], ...]


def batch_shapes(batch: Any) -> BatchShapes:
    return tuple((name, tuple(t.shape)) for name, t in named_tensors(batch))


def varying_shapes(shapes: Sequence[BatchShapes]) -> list[str]:
    """Tensors whose shape past the batch dim changes between batches, e.g.
    ``"batch['tokens'] [*, 57] to [*, 211]"``. A smaller last batch (the batch dim alone) does
    not count."""
    trailing: dict[str, set[tuple[int, ...]]] = {}
    for batch in shapes:
        for name, shape in batch:
            trailing.setdefault(name, set()).add(shape[1:])
    return [
        f"{name} {_shape(min(seen))} to {_shape(max(seen))}"
        for name, seen in trailing.items()
        if len(seen) > 1
    ]


def _shape(trailing: tuple[int, ...]) -> str:
    return "[" + ", ".join(["*", *map(str, trailing)]) + "]"
