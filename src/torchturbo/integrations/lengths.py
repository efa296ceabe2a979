"""Per-sample lengths of a trainer's dataset, so that the tuner can measure dynamic batching.

Hugging Face datasets carry token ids under ``input_ids`` and sometimes a precomputed length
column (``TrainingArguments.length_column_name``, "length" by default); a ``datasets.Dataset``
returns a whole column at once, any other dataset is read item by item (as transformers'
``LengthGroupedSampler`` does).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch.utils.data import IterableDataset

from torchturbo.data.length import length_or_none


def sample_lengths(
    dataset: Any, *, length_column: str = "length", input_name: str = "input_ids"
) -> list[int] | None:
    """One length per sample: the length column if there is one, else ``len(input_ids)``;
    None when the dataset has neither (or no ``__len__``)."""
    if isinstance(dataset, IterableDataset):  # a stream, even one that knows its columns
        return None
    columns = getattr(dataset, "column_names", None)
    if isinstance(columns, Sequence):
        if length_column in columns:
            return [int(length) for length in dataset[length_column]]
        if input_name in columns:
            return [len(ids) for ids in dataset[input_name]]
        return None
    size = length_or_none(dataset)  # None for a stream: no lengths to bucket by
    if not size or not isinstance(dataset[0], Mapping):
        return None
    if length_column in dataset[0]:
        return [int(dataset[i][length_column]) for i in range(size)]
    if input_name in dataset[0]:
        return [len(dataset[i][input_name]) for i in range(size)]
    return None
