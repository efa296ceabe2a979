"""A correct buffer pool: reuse tensors keyed by (shape, dtype, device), one holder at a time.

Measure before adopting it. PyTorch already caches memory on CUDA: the caching allocator reuses
freed blocks without calling cudaMalloc, so a Python-level pool only adds a dict lookup per
buffer. On CPU small blocks are recycled by malloc in about a microsecond (less than a ``borrow``
costs), but large ones (MiBs) come from fresh ``mmap``s whose pages fault on first touch every
time, and there reuse is 4-14x faster for elementwise steps (docs/techniques/tensor_pool.md has
the figures). Where lifetimes allow it, prefer ``out=`` into buffers allocated once, in-place
ops, or CUDA graphs; this pool is for scratch buffers of a few recurring shapes whose lifetimes
are not a simple loop.

Unlike the article's TensorRecycler it does not use the deprecated ``Tensor.storage()``, does not
``zero_()`` every buffer (``zero=True`` opts in), and never hands one buffer to two holders:

* a buffer is either free (in the pool) or held by exactly one caller; ``acquire`` only returns
  free buffers, ``release`` only accepts a buffer this pool handed out and that is still held
  (a second release, or releasing a view or a foreign tensor, raises ``ValueError``);
* aliasing rule: after ``release(t)`` the caller must not touch ``t`` or any view of it, since the
  next ``acquire`` of the same key returns that memory. ``borrow()`` (a context manager) makes this
  structural, and ``poison=True`` fills released floating-point buffers with NaN so that a use
  after release shows up in tests instead of silently reading another holder's data. (A pool
  cannot see references kept after release: a refcount check would also refuse the common
  ``buf = pool.acquire(...)`` loop, where the old ``buf`` is still bound during the call);
* CUDA: reuse is ordered on one stream; a buffer used on a side stream must be synchronized
  before release (the same rule as ``Tensor.record_stream`` for the caching allocator).

No library provides this (torch's allocators work below Python, on bytes, not tensors), hence a
small class: it has to hold state, unlike the rest of ``techniques``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

Key = tuple[tuple[int, ...], torch.dtype, torch.device]


def _key(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str) -> Key:
    if any(not isinstance(n, int) or n < 0 for n in shape):
        raise ValueError(f"TensorPool shape={tuple(shape)!r} is invalid: expected ints >= 0")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        # "cuda" and "cuda:0" must share buffers, so the index is made explicit.
        device = torch.device("cuda", torch.cuda.current_device())
    return tuple(shape), dtype, device


class TensorPool:
    """Free lists of uninitialised buffers per (shape, dtype, device), and who holds what.

    ``max_free_per_key`` bounds the memory a pool keeps: beyond it, released buffers are dropped
    and go back to PyTorch's allocator. Thread-safe (one lock around the bookkeeping).
    """

    def __init__(self, max_free_per_key: int = 4, *, poison: bool = False) -> None:
        if (
            not isinstance(max_free_per_key, int)
            or isinstance(max_free_per_key, bool)
            or max_free_per_key < 0
        ):
            raise ValueError(
                f"TensorPool(max_free_per_key={max_free_per_key!r}) is invalid: expected int >= 0"
            )
        self.max_free_per_key = max_free_per_key
        self.poison = poison
        self._free: dict[Key, list[torch.Tensor]] = {}
        self._held: dict[int, tuple[torch.Tensor, Key]] = {}  # id(tensor) -> (tensor, key)
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def acquire(
        self,
        shape: Sequence[int],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        *,
        zero: bool = False,
    ) -> torch.Tensor:
        """A buffer nobody else holds; its contents are undefined unless ``zero=True``."""
        key = _key(shape, dtype, device)
        with self._lock:
            free = self._free.get(key)
            if free:
                tensor = free.pop()
                self.hits += 1
            else:
                tensor = None
                self.misses += 1
        if tensor is None:
            tensor = torch.empty(key[0], dtype=dtype, device=key[2])
        with self._lock:
            self._held[id(tensor)] = (tensor, key)
        return tensor.zero_() if zero else tensor

    def release(self, tensor: torch.Tensor) -> None:
        """Give back a buffer from :meth:`acquire`; the caller must not use it afterwards."""
        with self._lock:
            entry = self._held.pop(id(tensor), None)
        if entry is None:
            raise ValueError(
                "TensorPool.release(tensor): this tensor is not held from this pool "
                "(released twice, a view of a pooled buffer, or never acquired here)"
            )
        # Poison before the buffer becomes visible to acquire(), never after: another thread
        # could otherwise be handed the buffer and have its data overwritten.
        if self.poison and tensor.is_floating_point():
            tensor.fill_(float("nan"))
        with self._lock:
            free = self._free.setdefault(entry[1], [])
            if len(free) < self.max_free_per_key:
                free.append(tensor)

    @contextmanager
    def borrow(
        self,
        shape: Sequence[int],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        *,
        zero: bool = False,
    ) -> Iterator[torch.Tensor]:
        """``with pool.borrow(shape) as buf:`` acquire, and release on exit (even on error)."""
        tensor = self.acquire(shape, dtype, device, zero=zero)
        try:
            yield tensor
        finally:
            self.release(tensor)

    @property
    def held(self) -> int:
        """Buffers currently handed out."""
        return len(self._held)

    @property
    def free(self) -> int:
        """Buffers waiting in the pool."""
        return sum(len(v) for v in self._free.values())

    def clear(self) -> None:
        """Drop all free buffers (held ones stay valid and may still be released)."""
        with self._lock:
            self._free.clear()
