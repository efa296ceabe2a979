"""One walker over nested batches: the tensors inside dicts, lists, tuples, namedtuples and
dataclass instances, with the containers rebuilt as the types they were.

Every module that maps over a batch goes through here (device moves and channels_last inputs in
``data/loader.py``, out-of-memory splitting in ``oom.py``, FSDP's output-gradient scaling, the
memory and export probes), so that they all see into the same containers: before, three walkers
each knew a different set, and a batch that one handled another silently passed through whole.

Why hand-written: ``torch.utils._pytree`` is private and only sees dataclasses that are
registered one by one; Lightning's ``apply_to_collection`` and accelerate's ``recursively_apply``
would each bring a framework for these few lines.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar, cast

import torch

T = TypeVar("T")


def map_tensors(fn: Callable[[torch.Tensor], Any], batch: T) -> T:
    """``batch`` with every tensor ``t`` replaced by ``fn(t)``; anything else is kept as is.

    Dicts keep their type and extras (``OrderedDict``, a ``defaultdict``'s factory), other
    mappings, namedtuples, tuples, lists and dataclass instances are rebuilt as their own type.
    """
    return cast(T, _map(fn, batch))


def _map(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        out = copy.copy(obj)
        for key, value in obj.items():  # item by item: ModelOutput refuses update()
            out[key] = _map(fn, value)
        return out
    if isinstance(obj, Mapping):
        return type(obj)({key: _map(fn, value) for key, value in obj.items()})  # type: ignore[call-arg]
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple: positional fields
        return type(obj)(*(_map(fn, value) for value in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(fn, value) for value in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(
            obj, **{f.name: _map(fn, getattr(obj, f.name)) for f in _init_fields(obj)}
        )
    return obj


def named_tensors(batch: Any, name: str = "batch") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of ``batch`` in order, with its access path, e.g. ``batch['tokens']``,
    ``batch[0]`` or ``batch.image``."""
    if isinstance(batch, torch.Tensor):
        yield name, batch
        return
    for path, key, value in _children(batch):
        yield from named_tensors(value, name + path.format(key))


def iter_tensors(batch: Any) -> Iterator[torch.Tensor]:
    """Every tensor of ``batch``, in the order :func:`map_tensors` visits them."""
    if isinstance(batch, torch.Tensor):
        yield batch
        return
    # The engine reads a batch's size every step: no access paths are formatted here.
    for _, _, value in _children(batch):
        yield from iter_tensors(value)


_ITEM, _ATTRIBUTE = "[{!r}]", ".{}"


def _children(obj: Any) -> list[tuple[str, Any, Any]]:
    """(access path format, key, value) of each item of a container; [] for anything else."""
    if isinstance(obj, Mapping):
        return [(_ITEM, key, value) for key, value in obj.items()]
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return [(_ATTRIBUTE, f, value) for f, value in zip(obj._fields, obj, strict=True)]
    if isinstance(obj, (list, tuple)):
        return [(_ITEM, index, value) for index, value in enumerate(obj)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [(_ATTRIBUTE, f.name, getattr(obj, f.name)) for f in _init_fields(obj)]
    return []


def _init_fields(obj: Any) -> list[dataclasses.Field[Any]]:
    # Fields with init=False are derived in __post_init__: replace() recomputes them.
    return [f for f in dataclasses.fields(obj) if f.init]
