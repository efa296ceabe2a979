"""The length of a dataset or loader that may have none: a stream (an ``IterableDataset``)."""

from __future__ import annotations

from typing import Any


def length_or_none(items: Any) -> int | None:
    """``len(items)``, or None for a stream without a length.

    Not ``isinstance(items, Sized)``: a DataLoader over a stream has ``__len__`` and raises
    TypeError from it.
    """
    try:
        return len(items)
    except TypeError:
        return None
