"""Turbo: compose the configured techniques around a user's model, optimizer and data.

The engine holds no technique logic of its own: each lives in ``techniques/`` as a plain function.
This module decides the order they are applied in (``_compose``) and runs one training micro-step
(``step``) with autocast, loss scaling, exact accumulation and clipping. Reliability lives beside
it: ``oom`` (micro-batching on out-of-memory), ``guard`` (non-finite losses, unreadable batches),
``resume`` and ``checkpoint`` (``save``/``load``), ``epochs`` (the resumable loader).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from torchturbo.config import DataConfig, TurboConfig
from torchturbo.data.bucketing import BucketBatchSampler
from torchturbo.data.collate import pad_collate
from torchturbo.data.loader import build_loader, to_device
from torchturbo.epochs import EpochLoader
from torchturbo.guard import NonFiniteGuard, call_loss_fn
from torchturbo.measure.breakdown import NullRecorder
from torchturbo.oom import MicroBatcher, leading_size
from torchturbo.resume import load_training_state, save_training_state
from torchturbo.techniques.accumulation import AccumulationWindow, scale_gradients
from torchturbo.techniques.checkpointing import apply_activation_checkpointing
from torchturbo.techniques.compile import apply_compile
from torchturbo.techniques.float8 import apply_float8_training
from torchturbo.techniques.memory_format import apply_channels_last
from torchturbo.techniques.optimizer import rebuild_optimizer
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
    a device sync, so the engine leaves that to the caller. ``micro_batches`` is how many pieces
    the batch ran as (more than 1 after an out-of-memory split, see ``torchturbo.oom``).
    """

    loss: torch.Tensor
    count: torch.Tensor
    optimizer_stepped: bool
    skipped: bool
    grad_norm: torch.Tensor | None
    micro_batches: int = 1


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
        #: Requested technique -> None when applied, else why it could not apply (for reports).
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
        #: The loader returned by ``setup`` (None for a manual loop): its position is saved.
        self.loader: EpochLoader | None = None
        self.microbatcher: MicroBatcher | None = None
        self.guard = NonFiniteGuard(self.config.reliability.nonfinite_patience)
        self._window = AccumulationWindow(self.config.accumulation.steps)
        #: Loader batches in the open accumulation window (each may run as several pieces).
        self.batches_in_window = 0
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
        lengths: Sequence[int] | None = None,
        pad_values: Mapping[str, int] | None = None,
    ) -> tuple[nn.Module, torch.optim.Optimizer, Iterator[Any] | None]:
        """Move and transform the model, keep the optimizer, and build or wrap the loader.

        The returned loader marks its last batch so that a trailing partial accumulation window
        is applied rather than lost, and calls ``set_epoch`` on its sampler every epoch.
        Parameter objects are preserved, so an optimizer built before ``setup`` stays valid.
        With ``[data] bucketing = true``, ``lengths`` (one per sample) feed a
        :class:`~torchturbo.data.bucketing.BucketBatchSampler`. Without ``collate_fn``,
        :func:`~torchturbo.data.collate.pad_collate` pads variable-length fields of dict samples
        (``pad_values`` per field, e.g. the tokenizer's pad id) and collates the rest as torch's
        default collate does.
        """
        self.model = self._compose(model)
        # After the model moved: a fused optimizer's support depends on the parameters' device.
        # A rebuilt optimizer is a new object: callers use the one setup returns.
        if self.config.optimizer.implementation != "as_built":
            optimizer, self.applied["optimizer"] = rebuild_optimizer(
                optimizer, self.config.optimizer.implementation
            )
        self.optimizer = optimizer
        reliability = self.config.reliability
        self.microbatcher = MicroBatcher(
            self.model,
            budget_bytes=reliability.memory_budget_bytes,
            auto=reliability.auto_microbatch,
            device=self.device,
        )
        if data is None:
            return self.model, optimizer, None
        if isinstance(data, DataLoader):
            loader = data
        else:
            if self.config.data.bucketing:
                batch_sampler = _bucket_sampler(self.config.data, lengths, batch_size, seed)
                batch_size = None
            # Pads variable-length fields of dict samples; otherwise collates as torch does.
            collate_fn = collate_fn or functools.partial(
                pad_collate, pad_to_multiple=self.config.data.pad_to_multiple, pad_values=pad_values
            )
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
        self.loader = EpochLoader(loader, self)
        return self.model, optimizer, self.loader

    def _compose(self, model: nn.Module) -> nn.Module:
        """Apply the model transforms in the one order that is correct. Each step says why."""
        cfg = self.config
        self._precision_scope.close()
        # TF32 is a process-wide switch: hold it for this engine's lifetime, restore on close().
        self._precision_scope.enter_context(float32_matmul_precision(cfg.precision))
        torch.backends.cudnn.benchmark = cfg.backend.cudnn_benchmark
        # 1. Device first: every later transform must see the final parameter storage.
        model = model.to(self.device)
        # float8 swaps Linear modules (keeping their parameters) before anything wraps them.
        if cfg.precision.float8:
            self.applied["float8"] = apply_float8_training(model, self.device)
        # 2. Layout before compile, so the compiled graph is traced with NHWC strides.
        if cfg.memory_format.channels_last:
            self.applied["channels_last"] = apply_channels_last(model)
        # 3. Checkpointing before compile: compile must see the checkpoint regions to keep them
        #    (torch.compile traces through checkpoint and honours its recompute boundaries).
        self.checkpointed_blocks = apply_activation_checkpointing(model, cfg.checkpointing)
        if cfg.checkpointing.mode != "off":
            self.applied["checkpointing"] = (
                None if self.checkpointed_blocks else "the config selected no block of this model"
            )
        # 4. Compile last among single-device transforms; distributed wrapping (DDP/FSDP) goes
        #    after this point and is added by torchturbo.distributed.
        if cfg.compile.mode != "off":
            self.applied["compile"] = apply_compile(model, cfg.compile)
        if cfg.precision.dtype != "fp32":
            self.applied["precision"] = None
        return model

    def close(self) -> None:
        """Restore process-wide switches (TF32) changed by this engine."""
        self._precision_scope.close()

    @property
    def window_open(self) -> bool:
        """Whether gradients of an unfinished accumulation window are pending."""
        return self._window.seen > 0

    @property
    def window_reference(self) -> torch.Tensor | None:
        """The open window's count reference (first micro-batch's count x micro-steps): each
        micro-step's loss is weighted by ``count / reference``. None while no window is open.
        Distributed wrappers read it to normalize gradients across ranks."""
        return self._window.reference

    def save(self, directory: str | Path, *, scheduler: Any = None) -> Path:
        """Checkpoint the run atomically under ``directory`` (see ``torchturbo.resume``).

        Call it right after a step whose metrics say ``optimizer_stepped``; returns the
        checkpoint's own directory. Keeps the newest ``[reliability] keep_last``.
        """
        return save_training_state(self, directory, scheduler)

    def load(self, directory: str | Path, *, scheduler: Any = None) -> Path:
        """Restore the newest checkpoint under ``directory`` that verifies, after ``setup``.

        The loader returned by ``setup`` continues from the saved position. Returns the path read.
        """
        return load_training_state(self, directory, scheduler)

    def step(self, loss_fn: Callable[[nn.Module, Any], LossOutput], batch: Any) -> StepMetrics:
        """Run one micro-batch: forward, backward, and the optimizer step when a window closes.

        A batch that runs out of memory is retried in smaller pieces (``torchturbo.oom``).
        """
        if self.model is None or self.optimizer is None or self.microbatcher is None:
            raise RuntimeError("call Turbo.setup(model, optimizer, ...) before Turbo.step")
        closing = self.batches_in_window + 1 >= self._window.micro_steps or self._epoch_ending
        micro_step = functools.partial(self._micro_step, loss_fn)
        loss, count, pieces = self.microbatcher.run(batch, micro_step, self._restart, closing)
        self.batches_in_window += 1
        stepped, skipped, grad_norm = False, False, None
        if closing:
            skipped, grad_norm = self._optimizer_step()
            stepped = True
        return StepMetrics(loss, count, stepped, skipped, grad_norm, pieces)

    def _micro_step(
        self, loss_fn: Callable[[nn.Module, Any], LossOutput], batch: Any, closing: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        with self.sync_context(closing):
            with self.recorder.phase("forward"):
                loss, count = self.forward(loss_fn, batch)
            with self.recorder.phase("backward"):
                self.guard.observe(loss, functools.partial(self.forward, loss_fn, batch), batch)
                weighted = loss.float() * self._window.weight(count)
                if self.scaler is not None:
                    weighted = self.scaler.scale(weighted)
                weighted.backward()
        return loss.detach(), count

    def _restart(self) -> None:
        """Drop the open window's gradients so that it can be replayed (after out-of-memory)."""
        assert self.optimizer is not None
        self.optimizer.zero_grad(set_to_none=True)
        self._window.reset()
        self.guard.forget_window()

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
            channels_last=self.applied.get("channels_last", "not requested") is None,
        )
        with autocast_context(self.device, self.config.precision):
            return _split_loss(call_loss_fn(loss_fn, self.model, batch), batch, self.device)

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
            # Without a scaler the guard skips a non-finite step rather than write NaN weights.
            skipped = self.guard.window_nonfinite(params, grad_norm, self.scaler is None)
            if self.scaler is not None:
                scale_before = self.scaler.get_scale()
                if not skipped:  # the guard also sees what clipping did after unscale_
                    self.scaler.step(self.optimizer)
                self.scaler.update()
                # GradScaler lowers its scale exactly when it skipped the step for inf/NaN.
                skipped = skipped or self.scaler.get_scale() < scale_before
            elif not skipped:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self._window.reset()
        self.batches_in_window = 0
        self.microbatcher.window_closed()
        self.optimizer_steps += 1
        self.skipped_steps += int(skipped)
        self.guard.raise_if_exhausted(self.model, self.optimizer_steps)
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
        loss, count = output, leading_size(batch)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ValueError(f"loss_fn must return a scalar tensor as the loss, got {loss!r}")
    count = torch.as_tensor(count, dtype=torch.float32, device=device)
    return loss, count


def _bucket_sampler(
    config: DataConfig, lengths: Sequence[int] | None, batch_size: int | None, seed: int | None
) -> BucketBatchSampler:
    """The length-bucketing batch sampler that ``[data] bucketing = true`` asks for."""
    if lengths is None:
        raise ValueError(
            "[data] bucketing = true needs per-sample lengths: pass setup(..., lengths=[...])"
        )
    max_tokens = config.max_tokens
    if max_tokens is None:
        if batch_size is None:
            raise ValueError(
                "[data] bucketing = true without max_tokens needs batch_size= to derive the "
                "token budget (batch_size x mean length)"
            )
        max_tokens = max(round(batch_size * sum(lengths) / len(lengths)), max(lengths))
    return BucketBatchSampler(
        lengths, max_tokens=max_tokens, pad_to_multiple=config.pad_to_multiple, seed=seed or 0
    )
