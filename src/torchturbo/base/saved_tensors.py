"""Saved-tensor hooks that compose: several packers active at once, each seeing the last's output.

``torch.autograd.graph.saved_tensors_hooks`` applies only the innermost pair of hooks, so a
technique that stores saved activations differently (``activation_compression``) and a
measurement that counts what is saved (``measure.memory.activation_bytes``) would each hide the
other. Both register through :func:`saved_tensor_packer` instead: one torch hook pair runs
every active packer in the order they were entered, and unpacks in reverse, so that the count
sees what the technique stores. (torch has no public way to read the hooks already active.)
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

Pack = Callable[[Any], Any]
Unpack = Callable[[Any], Any]

_ACTIVE: contextvars.ContextVar[tuple[tuple[Pack, Unpack], ...]] = contextvars.ContextVar(
    "torchturbo_saved_tensor_packers", default=()
)


@contextlib.contextmanager
def saved_tensor_packer(pack: Pack, unpack: Unpack) -> Iterator[None]:
    """Add ``pack``/``unpack`` to the saved-tensor hooks while the block runs. ``pack`` gets what
    the packers entered before it returned (a tensor, or their packed form: pass what you do
    not handle through), and ``unpack`` the matching value on the way back."""
    chain = (*_ACTIVE.get(), (pack, unpack))
    token = _ACTIVE.set(chain)
    try:
        hooks = torch.autograd.graph.saved_tensors_hooks(
            functools.partial(_pack_all, chain), functools.partial(_unpack_all, chain)
        )
        with hooks:
            yield
    finally:
        _ACTIVE.reset(token)


def _pack_all(chain: tuple[tuple[Pack, Unpack], ...], tensor: torch.Tensor) -> Any:
    value: Any = tensor
    for pack, _ in chain:
        value = pack(value)
    return value


def _unpack_all(chain: tuple[tuple[Pack, Unpack], ...], value: Any) -> Any:
    for _, unpack in reversed(chain):
        value = unpack(value)
    return value
