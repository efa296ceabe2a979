"""TensorPool: reuse happens, and no buffer is ever held by two callers at once."""

from __future__ import annotations

import threading

import pytest
import torch

from torchturbo.techniques.tools.tensor_pool import TensorPool


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_released_buffer_is_reused_for_the_same_key_only() -> None:
    pool = TensorPool()
    a = pool.acquire((4, 8))
    ptr = _ptr(a)
    pool.release(a)
    b = pool.acquire((4, 8))
    assert _ptr(b) == ptr and (pool.hits, pool.misses) == (1, 1)
    # Different shape, dtype: a fresh buffer, never the free one reinterpreted.
    pool.release(b)
    assert _ptr(pool.acquire((8, 4))) != ptr
    assert _ptr(pool.acquire((4, 8), torch.float64)) != ptr


def test_two_holders_never_share_a_buffer() -> None:
    pool = TensorPool()
    a = pool.acquire((16,))
    b = pool.acquire((16,))  # a is still held: b must be another buffer
    assert _ptr(a) != _ptr(b)
    pool.release(a)
    c = pool.acquire((16,))  # reuses a's memory, not b's, which is still held
    assert _ptr(c) == _ptr(a) != _ptr(b)


def test_nested_borrows_are_distinct_and_released_on_error() -> None:
    pool = TensorPool()
    with pytest.raises(RuntimeError, match="boom"), pool.borrow((3,)) as outer:
        with pool.borrow((3,)) as inner:
            assert _ptr(inner) != _ptr(outer)
        raise RuntimeError("boom")
    assert pool.held == 0 and pool.free == 2


def test_release_rejects_double_release_views_and_foreign_tensors() -> None:
    pool = TensorPool()
    a = pool.acquire((2, 2))
    with pytest.raises(ValueError, match="not held"):
        pool.release(a[0])  # a view
    with pytest.raises(ValueError, match="not held"):
        pool.release(torch.empty(2, 2))  # never acquired
    pool.release(a)
    with pytest.raises(ValueError, match="not held"):
        pool.release(a)  # twice
    assert pool.free == 1


def test_no_zeroing_unless_asked() -> None:
    pool = TensorPool()
    a = pool.acquire((5,))
    a.fill_(7.0)
    pool.release(a)
    reused = pool.acquire((5,))
    assert torch.equal(reused, torch.full((5,), 7.0))  # contents kept: no hidden zero_()
    pool.release(reused)
    assert torch.equal(pool.acquire((5,), zero=True), torch.zeros(5))


def test_poison_exposes_use_after_release() -> None:
    pool = TensorPool(poison=True)
    kept = pool.acquire((4,))
    kept.fill_(1.0)
    pool.release(kept)  # a buggy caller keeps `kept` and reads it later
    assert torch.isnan(kept).all()
    # Negative control: without poison the stale read silently returns plausible data.
    plain = TensorPool()
    stale = plain.acquire((4,))
    stale.fill_(1.0)
    plain.release(stale)
    assert not torch.isnan(stale).any()


def test_free_list_is_bounded() -> None:
    pool = TensorPool(max_free_per_key=1)
    a, b = pool.acquire((3,)), pool.acquire((3,))
    pool.release(a)
    pool.release(b)
    assert pool.free == 1 and pool.held == 0


def test_threads_hammering_the_pool_never_share_a_buffer() -> None:
    pool = TensorPool(max_free_per_key=2)
    in_use: set[int] = set()
    guard = threading.Lock()
    errors: list[str] = []

    def worker() -> None:
        for _ in range(300):
            with pool.borrow((8,)) as buf:
                ptr = _ptr(buf)
                with guard:
                    if ptr in in_use:
                        errors.append(f"buffer {ptr:#x} handed to two holders")
                    in_use.add(ptr)
                buf.fill_(1.0)
                with guard:
                    in_use.discard(ptr)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors
    assert pool.held == 0 and pool.hits > 0


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_bad_max_free_per_key_raises_value_error(value) -> None:
    with pytest.raises(ValueError, match="max_free_per_key"):
        TensorPool(max_free_per_key=value)


def test_bad_shape_raises_value_error() -> None:
    with pytest.raises(ValueError, match="shape"):
        TensorPool().acquire((2, -1))
