"""Turbo: compose the configured techniques around a user's model, optimizer and data.

The engine holds no technique logic of its own: each lives in ``techniques/`` as a plain function.
This module decides the order they are applied in (``_compose``) and runs one training micro-step
(``step``) with autocast, loss scaling, exact accumulation and clipping.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from torchturbo.config import TurboConfig
from torchturbo.data.loader import build_loader, to_device
from torchturbo.measure.breakdown import NullRecorder
from torchturbo.techniques.accumulation import AccumulationWindow, scale_gradients
from torchturbo.techniques.checkpointing import apply_activation_checkpointing
from torchturbo.techniques.compile import apply_compile
from torchturbo.techniques.memory_format import apply_channels_last
from torchturbo.techniques.precision import (
    autocast_context,
    float32_matmul_precision,
    make_grad_scaler,
)

LossOutput = torch.Tensor | tuple[torch.Tensor, int | float | torch.Tensor]


@dataclass(frozen=True)
class StepMetrics:
    """What one call to ``Turbo.step`` did.

    ``loss`` is the micro-batch's mean loss as a detached tensor: reading it with ``float()`` is
    a device sync, so the engine leaves that to the caller.
    """

    loss: torch.Tensor
    count: torch.Tensor
    optimizer_stepped: bool
    skipped: bool
    grad_norm: torch.Tensor | None


def resolve_device(name: str) -> torch.device:
    """``auto`` is CUDA when available, else CPU; an unavailable CUDA is a clear error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device = {name!r} was asked for, but no CUDA device is available")
    return device


class Turbo:
    """Apply a :class:`TurboConfig` to a training loop.

    >>> turbo = Turbo(TurboConfig.preset("fast"))
    >>> model, optimizer, loader = turbo.setup(model, optimizer, dataset, batch_size=64)
    >>> for batch in loader:
    ...     metrics = turbo.step(loss_fn, batch)
    """

    def __init__(self, config: TurboConfig | None = None) -> None:
        self.config = config or TurboConfig()
        self.device = resolve_device(self.config.device)
        #: technique name -> None when applied, else the reason it was not (for reports).
        self.applied: dict[str, str | None] = {}
        #: Swapped for a measure.breakdown.PhaseRecorder to time forward/backward/optimizer.
        self.recorder: Any = NullRecorder()
        #: Distributed hook points: ``sync_context(closing)`` wraps each micro-step's backward
        #: (DDP puts ``no_sync`` there for non-closing ones); ``reduce_count`` turns the local
        #: sample/token count of a window into the global one.
        self.sync_context: Callable[[bool], contextlib.AbstractContextManager] = lambda closing: (
            contextlib.nullcontext()
        )
        self.reduce_count: Callable[[torch.Tensor], torch.Tensor] = lambda count: count
        self.optimizer_steps = 0
        self.skipped_steps = 0
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scaler = make_grad_scaler(self.device, self.config.precision)
        self._window = AccumulationWindow(self.config.accumulation.steps)
        self._epoch_ending = False
        self._precision_scope = contextlib.ExitStack()

    def setup(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        data: Dataset | DataLoader | None = None,
        *,
        batch_size: int | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        batch_sampler: Any = None,
        shuffle: bool = True,
        seed: int | None = None,
    ) -> tuple[nn.Module, torch.optim.Optimizer, Iterator[Any] | None]:
        """Move and transform the model, keep the optimizer, and build or wrap the loader.

        The returned loader marks its last batch so that a trailing partial accumulation window
        is applied rather than lost. Parameter objects are preserved, so an optimizer built
        before ``setup`` stays valid.
        """
        self.model = self._compose(model)
        self.optimizer = optimizer
        if data is None:
            return self.model, optimizer, None
        if isinstance(data, DataLoader):
            loader = data
        else:
            if batch_size is None and batch_sampler is None:
                raise ValueError("setup() got a dataset: pass batch_size= or batch_sampler=")
            loader = build_loader(
                data,
                batch_size=batch_size,
                config=self.config.data,
                device=self.device,
                shuffle=shuffle,
                collate_fn=collate_fn,
                batch_sampler=batch_sampler,
                seed=seed,
            )
        return self.model, optimizer, _EpochLoader(loader, self)

    def _compose(self, model: nn.Module) -> nn.Module:
        """Apply the model transforms in the one order that is correct. Each step says why."""
        cfg = self.config
        self._precision_scope.close()
        # TF32 is a process-wide switch: hold it for this engine's lifetime, restore on close().
        self._precision_scope.enter_context(float32_matmul_precision(cfg.precision))
        torch.backends.cudnn.benchmark = cfg.backend.cudnn_benchmark
        # 1. Device first: every later transform must see the final parameter storage.
        model = model.to(self.device)
        # 2. Layout before compile, so the compiled graph is traced with NHWC strides.
        self.applied["channels_last"] = (
            apply_channels_last(model) if cfg.memory_format.channels_last else "disabled"
        )
        # 3. Checkpointing before compile: compile must see the checkpoint regions to keep them
        #    (torch.compile traces through checkpoint and honours its recompute boundaries).
        names = apply_activation_checkpointing(model, cfg.checkpointing)
        self.applied["checkpointing"] = (
            None if names else f"mode = {cfg.checkpointing.mode!r}, no block selected"
        )
        self.checkpointed_blocks = names
        # 4. Compile last among single-device transforms; distributed wrapping (DDP/FSDP) goes
        #    after this point and is added by torchturbo.distributed.
        self.applied["compile"] = apply_compile(model, cfg.compile)
        self.applied["precision"] = None if cfg.precision.dtype != "fp32" else "fp32 is baseline"
        return model

    def close(self) -> None:
        """Restore process-wide switches (TF32) changed by this engine."""
        self._precision_scope.close()

    def step(self, loss_fn: Callable[[nn.Module, Any], LossOutput], batch: Any) -> StepMetrics:
        """Run one micro-batch: forward, backward, and the optimizer step when a window closes."""
        if self.model is None or self.optimizer is None:
            raise RuntimeError("call Turbo.setup(model, optimizer, ...) before Turbo.step")
        closing = self._window.closing or self._epoch_ending
        with self.sync_context(closing):
            with self.recorder.phase("forward"):
                loss, count = self.forward(loss_fn, batch)
            with self.recorder.phase("backward"):
                weighted = loss.float() * self._window.weight(count)
                if self.scaler is not None:
                    weighted = self.scaler.scale(weighted)
                weighted.backward()
        stepped, skipped, grad_norm = False, False, None
        if closing:
            skipped, grad_norm = self._optimizer_step()
            stepped = True
        return StepMetrics(loss.detach(), count, stepped, skipped, grad_norm)

    def forward(
        self, loss_fn: Callable[[nn.Module, Any], LossOutput], batch: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward half of a step: batch to the device, autocast, (mean loss, count)."""
        if self.model is None:
            raise RuntimeError("call Turbo.setup(model, optimizer, ...) before Turbo.forward")
        batch = to_device(
            batch,
            self.device,
            non_blocking=self.config.data.non_blocking,
            channels_last=self.applied.get("channels_last") is None,
        )
        with autocast_context(self.device, self.config.precision):
            return _split_loss(loss_fn(self.model, batch), batch, self.device)

    def flush(self) -> bool:
        """Apply a partial accumulation window left open at the end of a manual loop.

        Loaders returned by ``setup`` do this on their own. Returns whether a step was taken.
        """
        if self._window.seen == 0:
            return False
        self._optimizer_step()
        return True

    def _optimizer_step(self) -> tuple[bool, torch.Tensor | None]:
        assert self.model is not None and self.optimizer is not None
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        with self.recorder.phase("optimizer"):
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)  # clipping must see true gradients
            total = self.reduce_count(self._window.total)
            scale_gradients(params, self._window.correction(total))
            grad_norm = None
            clip = self.config.clipping
            if clip.max_norm is not None:
                grad_norm = torch.nn.utils.clip_grad_norm_(params, clip.max_norm, clip.norm_type)
            skipped = False
            if self.scaler is not None:
                scale_before = self.scaler.get_scale()
                self.scaler.step(self.optimizer)
                self.scaler.update()
                # GradScaler lowers its scale exactly when it skipped the step for inf/NaN.
                skipped = self.scaler.get_scale() < scale_before
            else:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self._window.reset()
        self.optimizer_steps += 1
        self.skipped_steps += int(skipped)
        return skipped, grad_norm


def _split_loss(
    output: LossOutput, batch: Any, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean loss, count it is a mean over); the count defaults to the batch's leading size."""
    if isinstance(output, tuple):
        if len(output) != 2:
            raise ValueError(
                f"loss_fn must return a loss or (loss, count), got a tuple of {len(output)}"
            )
        loss, count = output
    else:
        loss, count = output, _leading_size(batch)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ValueError(f"loss_fn must return a scalar tensor as the loss, got {loss!r}")
    count = torch.as_tensor(count, dtype=torch.float32, device=device)
    return loss, count


def _leading_size(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    items = batch.values() if isinstance(batch, dict) else batch
    if isinstance(items, (list, tuple)) or isinstance(batch, dict):
        for item in items:
            if isinstance(item, torch.Tensor) and item.dim() > 0:
                return item.shape[0]
    raise ValueError(
        "cannot tell how many samples the batch holds: return (loss, count) from loss_fn"
    )


class _EpochLoader:
    """Iterate a loader one batch ahead, telling the engine when the epoch's last batch comes.

    Without this a trailing partial accumulation window is silently lost (the article's loop),
    and under DDP its gradients would never be all-reduced.
    """

    def __init__(self, loader: DataLoader, turbo: Turbo) -> None:
        self.loader = loader
        self._turbo = turbo

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        iterator = iter(self.loader)
        try:
            current = next(iterator)
        except StopIteration:
            return
        for upcoming in iterator:
            yield current
            current = upcoming
        self._turbo._epoch_ending = True
        try:
            yield current
        finally:
            self._turbo._epoch_ending = False
