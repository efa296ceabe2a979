"""Memory measures: activation bytes held for backward, and the peak memory of a block of code.

On CUDA the caching allocator keeps a peak (``torch.cuda.max_memory_allocated``). On CPU there is
no allocator peak, so two honest measures stand in, and they answer different questions:

* :func:`activation_bytes`: how many bytes a forward pass leaves held for backward (what
  activation checkpointing reduces), counted exactly from autograd's saved tensors;
* :func:`track_peak_memory` on CPU: the process's resident-set high-water mark (``VmHWM``),
  which includes everything in the process (Python, libraries, weights, allocator slack).

No library counts saved-for-backward bytes with checkpointing taken into account, hence the
hand-written counter; ``torch.cuda.memory`` snapshots are CUDA-only.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch

from torchturbo.base.nested import iter_tensors
from torchturbo.base.saved_tensors import saved_tensor_packer

#: Attribute the checkpointing technique sets to True on every module it wraps.
CHECKPOINT_MARKER = "_torchturbo_checkpointed"

_StorageKey = tuple[str, int]


def memory_capacity(device: torch.device) -> int:
    """Bytes of memory on ``device``: the GPU's, or the machine's RAM for a CPU."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return int(psutil.virtual_memory().total)


def storage_key(tensor: torch.Tensor) -> tuple[_StorageKey, int] | None:
    """(device, address) of the tensor's storage and its size; None for storage-less tensors."""
    try:
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        key = (str(storage.device), storage.data_ptr()) if nbytes else None
    except (RuntimeError, NotImplementedError):  # sparse, nested, DTensor and other wrappers
        return None
    return (key, nbytes) if key else None


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes ``tensor`` holds in this process, counted through tensor subclasses: an FSDP2
    shard (a DTensor) counts its local part, and a wrapper subclass its inner tensors
    (torchao's 8-bit optimizer state looks like float32 but holds uint8 codes and scales)."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if isinstance(tensor, DTensor):
        return tensor_bytes(tensor.to_local())
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        return sum(tensor_bytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()


def activation_bytes(
    forward_fn: Callable[[], Any],
    model: torch.nn.Module | None = None,
    exclude: Iterable[torch.Tensor] = (),
) -> int:
    """Bytes of tensors a forward pass leaves held for backward, parameters excluded, as they are
    stored (after a technique's own packing, such as activation compression's).

    ``forward_fn`` runs the forward and returns the loss; it must not call backward (the graph
    and the returned loss are dropped after counting). Counted: every tensor autograd saves
    (``saved_tensors_hooks``) and, for each module of ``model`` marked with
    :data:`CHECKPOINT_MARKER`, its tensor inputs, args and kwargs, which non-reentrant
    checkpointing keeps alive to recompute from (kwargs live only in a closure that no hook
    sees); marked modules are assumed not to nest, as the checkpointing technique marks only
    outermost blocks. Storages are deduplicated (views count once) and only those still held
    when the forward returns are counted. Excluded: the storages of ``exclude`` and, when
    ``model`` is given, of its parameters and buffers, which are held anyway.
    Not counted: the transient peak of backward itself (gradients, and the recomputed
    activations of one checkpointed block at a time).
    """
    excluded = {entry[0] for t in _excluded_tensors(model, exclude) if (entry := storage_key(t))}
    held: list[weakref.ref[torch.Tensor]] = []

    def pack(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            # What a technique stores instead (activation_compression's half-precision copy):
            # count the tensors it holds, which live exactly as long as it does.
            held.extend(weakref.ref(t) for t in iter_tensors(value))
            return value
        # Keep a detached alias, not `tensor` itself: a saved output would then hold its own
        # grad_fn, a reference cycle through C++ that leaks the graph. Autograd re-attaches
        # the grad_fn when it unpacks, so backward (and double backward) is unchanged.
        alias = value.detach()
        held.append(weakref.ref(alias))
        return alias

    def record_inputs(_module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        # Under no_grad checkpoint keeps nothing; the forward runs plainly.
        if torch.is_grad_enabled():
            held.extend(weakref.ref(t) for t in iter_tensors((args, kwargs)))

    modules = model.modules() if model is not None else ()
    marked = [m for m in modules if getattr(m, CHECKPOINT_MARKER, False)]
    handles = [m.register_forward_pre_hook(record_inputs, with_kwargs=True) for m in marked]
    try:
        with saved_tensor_packer(pack, lambda value: value):
            loss = forward_fn()
        # Weak references: a tensor saved and released within the forward is not held, and its
        # address may be reused by a later tensor, so only the live ones are counted.
        sizes: dict[_StorageKey, int] = {}
        for ref in held:
            tensor = ref()
            if tensor is not None and (entry := storage_key(tensor)) and entry[0] not in excluded:
                sizes[entry[0]] = entry[1]
        del loss
    finally:
        for handle in handles:
            handle.remove()
    return sum(sizes.values())


def _excluded_tensors(
    model: torch.nn.Module | None, exclude: Iterable[torch.Tensor]
) -> Iterator[torch.Tensor]:
    yield from exclude
    if model is not None:
        yield from model.parameters()
        yield from model.buffers()


@dataclass
class PeakMemory:
    """Result of :func:`track_peak_memory`, filled in when the ``with`` block exits.

    ``kind`` says what was measured: "cuda_allocator" (bytes allocated by tensors on the device,
    ``torch.cuda.max_memory_allocated``), "cpu_rss_hwm" (process resident-set high-water mark,
    reset at entry) or "cpu_rss_sampled" (resident set polled every millisecond, where the
    high-water mark cannot be reset: it can miss a peak shorter than the poll interval).
    ``baseline_bytes`` is the same quantity at entry, so ``peak_bytes - baseline_bytes`` is what
    the block added.
    """

    kind: str
    baseline_bytes: int = 0
    peak_bytes: int = 0


@contextlib.contextmanager
def track_peak_memory(device: torch.device | str) -> Iterator[PeakMemory]:
    """Measure the peak memory of the ``with`` block on ``device`` (see :class:`PeakMemory`)."""
    device = torch.device(device)
    if device.type == "cuda":
        with _track_cuda(device) as result:
            yield result
    elif _reset_hwm():
        with _track_hwm() as result:
            yield result
    else:
        with _track_sampled() as result:
            yield result


@contextlib.contextmanager
def _track_cuda(device: torch.device) -> Iterator[PeakMemory]:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    result = PeakMemory("cuda_allocator", baseline_bytes=torch.cuda.memory_allocated(device))
    yield result
    torch.cuda.synchronize(device)
    result.peak_bytes = torch.cuda.max_memory_allocated(device)


def _libc_malloc_trim() -> Callable[[int], int] | None:
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc only
    except OSError:  # no C library to load by that name (Windows)
        return None


_MALLOC_TRIM = _libc_malloc_trim()


def _release_free_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc's ``malloc_trim``) before a CPU
    measurement. Memory an earlier step freed stays resident in the heap; a block that reuses it
    adds nothing to the resident set, so its peak read as zero growth (seen in the test suite
    after some 600 tests had churned the heap: a 64 MiB tensor raised VmHWM by 0 bytes)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _reset_hwm() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where that is not possible."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:  # not Linux, or a sandbox that forbids writing clear_refs
        return False
    return True


def _status_bytes(field: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # the kernel reports kB
    raise RuntimeError(f"{_STATUS} has no {field} line")


@contextlib.contextmanager
def _track_hwm() -> Iterator[PeakMemory]:
    _release_free_heap()
    _reset_hwm()  # again: trimming lowered the resident set the mark starts from
    result = PeakMemory("cpu_rss_hwm", baseline_bytes=_status_bytes("VmRSS"))
    yield result
    result.peak_bytes = _status_bytes("VmHWM")


@contextlib.contextmanager
def _track_sampled(interval_s: float = 0.001) -> Iterator[PeakMemory]:
    _release_free_heap()
    process = psutil.Process()
    result = PeakMemory("cpu_rss_sampled", baseline_bytes=process.memory_info().rss)
    peak = result.baseline_bytes
    done = threading.Event()

    def poll() -> None:
        nonlocal peak
        while not done.wait(interval_s):
            peak = max(peak, process.memory_info().rss)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        yield result
    finally:
        done.set()
        poller.join()
        result.peak_bytes = max(peak, process.memory_info().rss)
