"""``apply_distributed``: wrap the engine's model for the running process group, in one place.

Composition order (the whole of it, with ``Turbo._compose`` doing steps 1-4 in ``setup``):

1. device placement; 2. channels_last; 3. activation checkpointing; 4. torch.compile;
5. **distributed wrapping** (this module): DDP or FSDP2 last, because both must see the final
   parameters (DDP registers autograd hooks on them and builds buckets from their order; FSDP2
   replaces them by shards) and compile must trace the model without the wrapper's collectives.

Exact loss normalization across ranks. With ``count`` samples or tokens per micro-batch, the
target is the global mean gradient ``sum_r S_r / T``, where ``S_r`` is the gradient of rank r's
*summed* loss over its window and ``T`` the count over all ranks and micro-steps. The engine's
accumulation leaves ``S_r / ref_r`` in each rank's gradients (``ref_r`` = the rank's first count x
micro-steps, different on each rank) and multiplies by ``ref_r / reduce_count(total_r)`` after
the reduction. DDP and FSDP *average* over the W ranks, so without care the result is
``(1/W) sum_r S_r / ref_r``: every rank weighs the same however many tokens it had, which is the
mean of local means, not the global mean. No factor applied after the reduction can fix that, so:

- before the reduction each rank multiplies its gradients by ``ref_r`` (DDP: in the comm hook, on
  the accumulated bucket; FSDP: on the gradient flowing out of the model's outputs, every
  micro-step), so the reduction averages ``S_r``: ``(1/W) sum_r S_r``;
- ``reduce_count`` returns ``T x ref_r / W`` (one all-reduce of the count per window), so the
  engine's factor ``ref_r / reduce_count`` is ``W / T``, giving ``sum_r S_r / T`` on every rank.

Accumulation under DDP runs the non-final micro-steps in ``no_sync()``: one reduction per window
instead of one per micro-step. FSDP reduce-scatters every micro-step instead, which keeps
gradients sharded (``no_sync`` would keep whole unsharded gradients in memory).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchturbo.distributed.comm import CommStats
from torchturbo.distributed.ddp import wrap_ddp
from torchturbo.distributed.fsdp import shard_with_optimizer
from torchturbo.distributed.launch import current_env
from torchturbo.engine import Turbo


def apply_distributed(
    turbo: Turbo, model: nn.Module, *, stats: CommStats | None = None
) -> nn.Module:
    """Wrap ``model`` (as returned by ``turbo.setup``) per ``[distributed]`` and install the
    engine's ``model``, ``sync_context`` and ``reduce_count``. Returns the model to use from now
    on; the optimizer given to ``setup`` stays valid (FSDP re-points it at the shards).

    With one process this returns ``model`` unchanged and records why in ``turbo.applied``.
    ``stats``, when given, receives the bytes and time of DDP's gradient communication.
    """
    if turbo.model is None:
        raise RuntimeError("call turbo.setup(model, optimizer, ...) before apply_distributed")
    env = current_env()
    if not env.is_distributed:
        turbo.applied["distributed"] = (
            "one process: launch with torchrun --nproc-per-node N to run distributed"
        )
        return model
    config = turbo.config.distributed
    _keep_ranks_in_step(turbo)
    reference = window_reference(turbo)
    count = functools.partial(global_count, reference=reference, world_size=env.world_size)
    if config.strategy == "ddp":
        wrapped = wrap_ddp(model, config, turbo.device, grad_factor=reference, stats=stats)
        sync = _NoSyncUnlessClosing(wrapped, count)
        turbo.sync_context, turbo.reduce_count = sync.context, sync.reduce_count
    else:
        if stats is not None:
            raise ValueError(
                "stats= counts DDP comm hooks; strategy = 'fsdp' reduce-scatters without them"
            )
        wrapped = shard_with_optimizer(model, config, turbo.optimizer)
        scale_output_gradients(wrapped, reference)
        turbo.reduce_count = count
    turbo.model = wrapped
    turbo.applied["distributed"] = None
    return wrapped


def _keep_ranks_in_step(turbo: Turbo) -> None:
    """Refuse or switch off what would split batches differently on each rank.

    Micro-batching after an out-of-memory (``torchturbo.oom``) decides its split on the rank that
    ran out, and replays that rank's window alone. The ranks would then run different numbers of
    forwards (DDP broadcasts buffers in each) and reductions (FSDP reduce-scatters each piece):
    their collectives no longer pair up, and the run hangs instead of failing.
    """
    if turbo.config.reliability.memory_budget_bytes is not None:
        raise ValueError(
            "[reliability] memory_budget_bytes splits each rank's batches on its own, which "
            "leaves the ranks' collectives out of step under torchrun: use [accumulation] steps "
            "(the same on every rank) to shrink the micro-batch"
        )
    if turbo.microbatcher is not None and turbo.microbatcher.auto:
        turbo.microbatcher.auto = False
        turbo.applied["auto_microbatch"] = (
            "off under torchrun: a retry after out-of-memory would replay one rank's steps "
            "alone, out of step with the others; an out-of-memory error stops the run instead"
        )


def window_reference(turbo: Turbo) -> Callable[[], torch.Tensor]:
    """This rank's count reference ``ref_r`` of the open accumulation window, read when needed."""

    def reference() -> torch.Tensor:
        value = turbo.window_reference
        if value is None:
            raise RuntimeError("no accumulation window is open: call turbo.step, not backward")
        return value

    return reference


def global_count(
    total: torch.Tensor, *, reference: Callable[[], torch.Tensor], world_size: int
) -> torch.Tensor:
    """``T x ref_r / W`` from this rank's ``total``: see the module docstring for why."""
    total = total.detach().clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total * reference() / world_size


class _NoSyncUnlessClosing:
    """The engine's DDP hooks: ``no_sync`` on non-final micro-steps, and a guard in
    ``reduce_count`` against stepping on gradients that were never all-reduced (``Turbo.flush``
    after a ``no_sync`` micro-step would let the replicas drift apart silently)."""

    def __init__(self, ddp: Any, count: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._ddp = ddp
        self._count = count
        self._synced = True

    def context(self, closing: bool) -> contextlib.AbstractContextManager:
        self._synced = closing
        return contextlib.nullcontext() if closing else self._ddp.no_sync()

    def reduce_count(self, total: torch.Tensor) -> torch.Tensor:
        if not self._synced:
            raise RuntimeError(
                "the optimizer step under DDP follows a micro-step run in no_sync(), whose "
                "gradients were never all-reduced (Turbo.flush() on a partial window?). Iterate "
                "the loader returned by Turbo.setup, which marks the last batch of an epoch"
            )
        return self._count(total)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the incoming gradient by ``factor()``."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, factor: Callable[[], torch.Tensor]) -> Any:
        ctx.factor = factor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor().to(grad.dtype), None


def scale_output_gradients(model: nn.Module, factor: Callable[[], torch.Tensor]) -> None:
    """Scale every gradient that enters ``model`` through its outputs by ``factor()``.

    Backward is linear, so this scales all parameter gradients of the step, before FSDP reduces
    them. Tensors nested in tuples, lists and dicts are covered; a loss term computed from the
    parameters directly (not through the outputs) would not be scaled.
    """

    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        return _map_tensors(output, lambda t: _ScaleGrad.apply(t, factor))

    model.register_forward_hook(hook)


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value) if value.requires_grad else value
    if isinstance(value, (tuple, list)):
        mapped = [_map_tensors(v, fn) for v in value]
        return type(value)(*mapped) if hasattr(value, "_fields") else type(value)(mapped)
    if isinstance(value, dict):
        return type(value)((k, _map_tensors(v, fn)) for k, v in value.items())
    return value
