"""The memory a training step will take, estimated before the real step runs, and what is in it.

One instrumented step of the fp32 eager baseline on a slice of the recipe's first batch: the
weights, their gradients and the optimizer state are counted exactly (they do not depend on the
batch), and the tensors autograd saves for backward (``saved_tensors_hooks``, composed through
``base/saved_tensors.py`` as ``measure.memory.activation_bytes`` counts them) are
attributed to the block whose forward is running when they are saved (module forward hooks).

Two forwards of ``n`` and ``2n`` samples of the same batch (cut after collating, so a padded text
batch keeps its length) give each block's bytes as a line, fixed + per-sample x samples, which is
then read at the real batch and at any micro-batch: what does not grow with the batch (a causal
mask built once, BatchNorm's per-channel statistics, rotary tables) is the fixed part. What is
not linear in the samples stays out of the estimate: allocator slack and, on CUDA, the transient
peak of backward (gradients being reduced, a checkpointed block recomputed), which the measured
footprint includes.

Each block also gets its forward time on the real batch, with grad enabled as in the backward's
recomputation (which records the block's graph again): the cost of recomputing it under
checkpointing, which the memory planner weighs against the bytes it frees. No library does this
split (``accelerate estimate-memory`` counts weights only), hence the hand-written counter.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torchturbo.base.blocks import find_blocks
from torchturbo.base.nested import iter_tensors, map_tensors
from torchturbo.base.saved_tensors import saved_tensor_packer
from torchturbo.config import TurboConfig
from torchturbo.measure.footprint import BlockMemory, Line, MemoryEstimate, TensorRecord
from torchturbo.measure.memory import storage_key, tensor_bytes
from torchturbo.measure.timing import sync
from torchturbo.recipe import Recipe
from torchturbo.reliability.oom import leading_size
from torchturbo.trials.trial import Trial

#: What is saved outside every named module: the loss, and ops in the model's own forward.
TOP_LEVEL = "(top level: loss, ...)"
#: Tensors listed as the largest.
LARGEST = 5


def _fit(small: int, large: int, n_small: int, n_large: int) -> Line:
    per_sample = (large - small) / (n_large - n_small)
    return Line(small - per_sample * n_small, per_sample)


def estimate_memory(
    recipe: Recipe,
    batch: Any,
    blocks: Sequence[str],
    *,
    device: torch.device | str = "cpu",
    samples: int | None = None,
    time_blocks: bool = True,
) -> MemoryEstimate:
    """Estimate the fp32 eager step's footprint on ``batch`` (collated, as trained on).

    ``blocks`` are the qualified names of the model's repeated blocks (what checkpointing
    chooses among: ``techniques.checkpointing.find_blocks``); every other top-level child is
    reported as one block too. ``samples`` is the smaller slice (default: a quarter of the
    batch, at least 1; the larger is twice that, at most the batch). ``time_blocks`` times each
    block's forward on the whole batch (the planner's recompute cost).
    """
    size = leading_size(batch)
    small = samples or max(1, size // 4)
    large = min(size, 2 * small)
    if large <= small:  # a batch of one sample: nothing to fit a line through
        small, large = size, size
    trial = Trial(recipe, TurboConfig(device=str(device)), [_take(batch, large, size)])
    try:
        assert trial.turbo.strategy is not None  # set up by the trial
        # Under torchrun the trial's model is wrapped (DDP's ``module.``): the blocks are named
        # in the user's model.
        model = trial.turbo.strategy.unwrap(trial.model)
        names = _attributed(model, blocks)
        first, _ = _saved(trial, _take(batch, small, size), names, size)
        second, tensors = _saved(trial, _take(batch, large, size), names, size)
        trial.step()  # one real step: the optimizer's state now exists
        weights = sum(_nbytes(p) for p in model.parameters())
        gradients = sum(_nbytes(p) for p in model.parameters() if p.requires_grad)
        optimizer = sum(
            _nbytes(v)
            for state in trial.optimizer.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor)
        )
        times = _block_times(trial, batch, names) if time_blocks else {}
    finally:
        trial.close()
    fit = (
        (lambda a, b: _fit(a, b, small, large))
        if large > small
        else (lambda a, b: Line(0.0, a / small))
    )
    rows = []
    for name, module in names.items():
        a, b = first.get(name, _Totals()), second.get(name, _Totals())
        rows.append(
            BlockMemory(
                name=name,
                type_name=type(module).__name__,
                checkpointable=name in blocks,
                held=fit(a.held, b.held),
                freeable=fit(a.freeable, b.freeable),
                compressible=tuple(b.compressible),
                forward_s=times.get(name),
            )
        )
    scale = size / large
    largest = sorted(
        (TensorRecord(t.block, t.shape, t.dtype, round(t.bytes * scale)) for t in tensors),
        key=lambda t: -t.bytes,
    )[:LARGEST]
    return MemoryEstimate(
        batch_size=size,
        slices=(small, large),
        weights_bytes=weights,
        gradients_bytes=gradients,
        optimizer_bytes=optimizer,
        blocks=tuple(rows),
        largest=tuple(largest),
    )


def estimate_recipe_memory(
    recipe: Recipe, batch: Any, device: torch.device | str = "cpu", *, time_blocks: bool = True
) -> MemoryEstimate:
    """:func:`estimate_memory` with the blocks checkpointing would choose among."""
    blocks = [name for name, _ in find_blocks(recipe.model())]
    return estimate_memory(recipe, batch, blocks, device=device, time_blocks=time_blocks)


def _take(batch: Any, samples: int, size: int) -> Any:
    """The first ``samples`` of a collated batch of ``size`` (other tensors as they are)."""
    return map_tensors(lambda t: t[:samples] if t.dim() and t.shape[0] == size else t, batch)


def _attributed(model: nn.Module, blocks: Sequence[str]) -> dict[str, nn.Module]:
    """The modules saved tensors are attributed to, in the model's order: its blocks and the
    top-level children that hold none."""
    modules = dict(model.named_modules())
    unknown = [b for b in blocks if b not in modules]
    if unknown:
        raise ValueError(f"no module named {', '.join(unknown)} in {type(model).__name__}")
    names: dict[str, nn.Module] = {}
    for name, module in model.named_children():
        inner = [b for b in blocks if b == name or b.startswith(name + ".")]
        if not inner:
            names[name] = module
        else:
            names.update((b, modules[b]) for b in inner)
    names[TOP_LEVEL] = model
    return names


@dataclass
class _Totals:
    held: int = 0
    freeable: int = 0
    compressible: list[tuple[float, bool]] = field(default_factory=list)


@dataclass
class _Saved:
    ref: weakref.ref[torch.Tensor]
    block: str
    compressible: bool


def _saved(
    trial: Trial, batch: Any, names: dict[str, nn.Module], batch_size: int
) -> tuple[dict[str, _Totals], list[TensorRecord]]:
    """Per block, the bytes its forward leaves saved for backward on ``batch`` (a slice of a
    batch of ``batch_size``); and every tensor saved."""
    stack: list[str] = []
    inputs: dict[str, set[Any]] = {name: set() for name in names}
    saved: list[_Saved] = []
    size = leading_size(batch)

    def pack(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            alias = value.detach()  # not the tensor itself: see measure.memory.activation_bytes
            compressible = value.dtype == torch.float32 and not value.is_leaf
            block = stack[-1] if stack else TOP_LEVEL
            saved.append(_Saved(weakref.ref(alias), block, compressible))
            return alias
        return value

    handles = []
    for name, module in names.items():
        if name == TOP_LEVEL:
            continue
        enter = _enter(stack, inputs, name)
        handles.append(module.register_forward_pre_hook(enter, with_kwargs=True))
        handles.append(module.register_forward_hook(_leave(stack), always_call=True))
    excluded = {
        entry[0]
        for t in (*trial.model.parameters(), *trial.model.buffers())
        if (entry := storage_key(t))
    }
    try:
        with _forward_only(trial), saved_tensor_packer(pack, lambda value: value):
            loss = trial.turbo.forward(trial.recipe.loss_fn, batch)[0]
        totals = _totals(saved, inputs, excluded, size)
        del loss
    finally:
        for handle in handles:
            handle.remove()
        trial.optimizer.zero_grad(set_to_none=True)
    return totals


@contextlib.contextmanager
def _forward_only(trial: Trial) -> Iterator[None]:
    """A forward with no backward after it, under the engine's switches: as a micro-step that
    does not close its window (under DDP, ``no_sync()``, as ``Trial.activation_bytes`` does)."""
    assert trial.turbo.strategy is not None  # set up by Trial
    with trial.turbo.strategy.backward_context(closing=False), trial.turbo.switches():
        yield


def _enter(
    stack: list[str], inputs: dict[str, set[Any]], name: str
) -> Callable[[nn.Module, Any, Any], None]:
    def hook(_module: nn.Module, args: Any, kwargs: Any) -> None:
        stack.append(name)
        inputs[name].update(e[0] for t in iter_tensors((args, kwargs)) if (e := storage_key(t)))

    return hook


def _leave(stack: list[str]) -> Callable[..., None]:
    def hook(*_: Any) -> None:
        stack.pop()

    return hook


def _totals(
    saved: list[_Saved],
    inputs: dict[str, set[Any]],
    excluded: set[Any],
    samples: int,
) -> tuple[dict[str, _Totals], list[TensorRecord]]:
    """Storages still held, deduplicated, each counted for the first block that saved it, of
    a slice of ``samples``."""
    savers: dict[Any, list[str]] = {}
    sizes: dict[Any, int] = {}
    first: dict[Any, _Saved] = {}
    shapes: dict[Any, torch.Tensor] = {}
    for record in saved:
        tensor = record.ref()
        entry = storage_key(tensor) if tensor is not None else None
        if tensor is None or entry is None or entry[0] in excluded:
            continue
        key, nbytes = entry
        sizes[key] = nbytes
        savers.setdefault(key, []).append(record.block)
        first.setdefault(key, record)
        if key not in shapes or tensor.numel() > shapes[key].numel():
            shapes[key] = tensor
    totals: dict[str, _Totals] = {}
    records = []
    for key, record in first.items():
        block = totals.setdefault(record.block, _Totals())
        nbytes = sizes[key]
        block.held += nbytes
        frees = set(savers[key]) == {record.block} and key not in inputs.get(record.block, set())
        if frees:
            block.freeable += nbytes
        if record.compressible:
            block.compressible.append((nbytes / samples, frees))
        tensor = shapes[key]
        dtype = str(tensor.dtype).removeprefix("torch.")
        records.append(TensorRecord(record.block, tuple(tensor.shape), dtype, nbytes))
    return totals, records


def _block_times(trial: Trial, batch: Any, names: dict[str, nn.Module]) -> dict[str, float]:
    """Each block's forward seconds on ``batch``, recording the graph as recomputation does
    (the fastest of two passes; the graphs are dropped unused)."""
    device = trial.turbo.device
    starts: dict[str, float] = {}
    best: dict[str, float] = {}

    def enter(name: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            sync(device)
            starts[name] = time.perf_counter()

        return hook

    def leave(name: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            sync(device)
            seconds = time.perf_counter() - starts[name]
            best[name] = min(best.get(name, seconds), seconds)

        return hook

    handles = []
    for name, module in names.items():
        if name != TOP_LEVEL:
            handles.append(module.register_forward_pre_hook(enter(name)))
            handles.append(module.register_forward_hook(leave(name)))
    try:
        with torch.enable_grad(), _forward_only(trial):
            for _ in range(2):
                trial.turbo.forward(trial.recipe.loss_fn, batch)
    finally:
        for handle in handles:
            handle.remove()
    return best


def _nbytes(tensor: torch.Tensor) -> int:
    """Bytes this process holds (an FSDP2 shard's local part, a quantised state's codes)."""
    return tensor_bytes(tensor)
