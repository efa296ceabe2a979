"""Automatic micro-batching: a step that runs out of memory is retried in smaller pieces.

Each batch from the loader runs as ``split`` pieces (along dim 0), each a forward and backward
whose loss is weighted by its sample or token count, so the accumulated gradient is the batch's
(``techniques/tools/accumulation.py``: count weighting makes the split exact up to rounding). When a
piece runs out of memory (``torch.OutOfMemoryError``: a real CUDA OOM, or the activation budget
below), the accumulation window is restarted: gradients are dropped, ``split`` doubles, and the
window's batches so far are run again followed by the failing one. Replaying the window rather
than only the failing piece is what keeps the result exact: an OOM in backward leaves part of the
failed piece's gradient already added to ``.grad``, which cannot be subtracted. So no batch is
lost and none is applied twice; the window's batches are held (references, no copies) until it
closes. The effective batch and the loss normalization do not change; only the piece size does.
The split is kept for later steps, logged, and reported in ``StepMetrics.micro_batches``.
A piece of one sample that still does not fit raises :class:`MemoryBudgetError`.

**Activation budget** (``[reliability] memory_budget_bytes``): the bytes of tensors that the
forward saves for backward, counted by ``torch.autograd.graph.saved_tensors_hooks`` (each tensor
once, parameters excluded; tensors saved inside non-reentrant activation-checkpoint regions are
not kept, so checkpointing lowers the count as it lowers real memory). Exceeding it raises
``torch.OutOfMemoryError`` inside the forward, as a real out-of-memory would: this is how CPU
runs and tests exercise the same path, and how a run is kept under a budget on any device.

Why hand-written: Composer's ``microbatch='auto'`` does this inside Composer's Trainer only;
Lightning's batch-size finder searches once before training and does not work under DDP.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from torchturbo.base.nested import iter_tensors, map_tensors
from torchturbo.reliability.guard import describe_batch

log = logging.getLogger("torchturbo")

#: One micro-step: (piece, closing) -> (detached mean loss, count).
MicroStep = Callable[[Any, bool], tuple[torch.Tensor, torch.Tensor]]


class MemoryBudgetError(ValueError):
    """Even a micro-batch of one sample does not fit in memory (or the batch cannot be split)."""


class MicroBatcher:
    """Runs batches as pieces; on out-of-memory doubles the pieces and replays the window."""

    def __init__(
        self,
        model: nn.Module,
        *,
        budget_bytes: int | None,
        auto: bool,
        device: torch.device,
        split: int = 1,
    ) -> None:
        self.budget_bytes = budget_bytes
        self.auto = auto
        self.device = device
        #: Pieces each batch is cut into (``split``, doubled at each out-of-memory).
        self.split = split
        #: Samples in the largest piece of the last batch.
        self.micro_batch_size: int | None = None
        #: One line per change of ``split``, for reports.
        self.events: list[str] = []
        # Parameter storages are not activations: the budget leaves them out. Read only with a
        # budget (never under torchrun, where FSDP's sharded parameters have no plain storage).
        self._params = (
            {p.untyped_storage().data_ptr() for p in model.parameters()}
            if budget_bytes is not None
            else set()
        )
        self._window: list[Any] = []

    def run(
        self, batch: Any, micro_step: MicroStep, restart: Callable[[], None], closing: bool
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Run ``batch`` (closing the window or not); returns (mean loss, count, pieces)."""
        replay: list[Any] = []
        while True:
            try:
                for earlier in replay:
                    self._run_pieces(earlier, micro_step, closing=False)
                loss, count, pieces = self._run_pieces(batch, micro_step, closing)
                break
            except torch.OutOfMemoryError as err:
                if not self.auto:
                    raise
                message = str(err).splitlines()[0] if str(err) else "out of memory"
            # Out of the except block, so the traceback (and the activations its frames hold)
            # is released before the retry.
            restart()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self._shrink(batch, message)
            replay = list(self._window)
        self._window = [] if closing else [*self._window, batch]
        return loss, count, pieces

    def window_closed(self) -> None:
        """Forget the batches of the window (after an optimizer step or a flush)."""
        self._window = []

    def _run_pieces(
        self, batch: Any, micro_step: MicroStep, closing: bool
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        pieces = split_batch(batch, self.split) if self.split > 1 else [batch]
        self.micro_batch_size = _largest(pieces)
        results = []
        for index, piece in enumerate(pieces):
            with self._budget():
                results.append(micro_step(piece, closing and index == len(pieces) - 1))
        if len(results) == 1:
            loss, count = results[0]
            return loss, count, 1
        count = torch.stack([c for _, c in results]).sum()
        loss = torch.stack([lo.float() * c for lo, c in results]).sum() / count
        return loss, count, len(pieces)

    def _shrink(self, batch: Any, message: str) -> None:
        size = leading_size(batch)
        piece = -(-size // min(self.split, size))
        if piece <= 1:
            raise MemoryBudgetError(
                f"out of memory with a micro-batch of 1 sample ({message}): "
                + (
                    f"[reliability] memory_budget_bytes = {self.budget_bytes} cannot hold one "
                    "sample; raise the memory budget"
                    if self.budget_bytes is not None
                    else "the device cannot hold one sample"
                )
                + ", or shrink the model or the sample (activation checkpointing, bf16)"
            )
        self.split *= 2
        event = (
            f"out of memory ({message}): micro-batch {piece} -> {-(-size // self.split)} "
            f"samples, {self.split} micro-batches per batch; retrying the accumulation window"
        )
        self.events.append(event)
        log.warning(event)

    @contextlib.contextmanager
    def _budget(self) -> Iterator[None]:
        if self.budget_bytes is None:
            yield
            return
        budget, params = self.budget_bytes, self._params
        seen: set[tuple[int, int]] = set()
        kept = 0

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            nonlocal kept
            # The tensor's own bytes, not its storage's: a piece of a split batch is a view
            # whose storage is the whole batch.
            key = (tensor.data_ptr(), tensor.numel())
            if tensor.untyped_storage().data_ptr() not in params and key not in seen:
                seen.add(key)
                kept += tensor.numel() * tensor.element_size()
                if kept > budget:
                    raise torch.OutOfMemoryError(
                        f"activations saved for backward exceed memory_budget_bytes = {budget}"
                    )
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield


def leading_size(batch: Any) -> int:
    """Samples in a batch: the leading size of its first tensor with at least one dimension
    (in the order :func:`torchturbo.base.nested.iter_tensors` visits them)."""
    for tensor in iter_tensors(batch):
        if tensor.dim() > 0:
            return tensor.shape[0]
    raise ValueError(
        f"cannot tell how many samples a batch of structure {describe_batch(batch)} holds: "
        "return (loss, count) from loss_fn"
    )


def split_batch(batch: Any, pieces: int) -> list[Any]:
    """Cut ``batch`` into at most ``pieces`` nearly equal pieces along dim 0, keeping structure.

    Tensors whose leading size is the batch's are split; anything else (scalars, strings, tensors
    of another leading size) is repeated in every piece.
    """
    try:
        size = leading_size(batch)
    except ValueError as err:
        raise MemoryBudgetError(f"out of memory, and the batch cannot be split: {err}") from None
    count = min(pieces, size)
    parts: dict[int, tuple[torch.Tensor, ...]] = {}  # id -> pieces: each tensor is cut once

    def piece(index: int) -> Any:
        def cut(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.dim() == 0 or tensor.shape[0] != size:
                return tensor
            if id(tensor) not in parts:
                parts[id(tensor)] = torch.tensor_split(tensor, count)
            return parts[id(tensor)][index]

        return map_tensors(cut, batch)

    return [piece(index) for index in range(count)]


def _largest(pieces: list[Any]) -> int | None:
    try:
        return max(leading_size(piece) for piece in pieces)
    except ValueError:
        return None
