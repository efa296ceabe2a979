"""DDP: the strategy (no_sync between window ends, the exact global count, rank-0 checkpoints
that check the replicas agree), gradient-compression comm hooks, and the rank-local pre-scale.

Hooks are torch's own (``torch.distributed.algorithms.ddp_comm_hooks``), named by the config's
``comm_hook`` through :data:`COMM_HOOKS`:

- ``none``: fp32 all-reduce of each bucket (what DDP does without a hook);
- ``fp16`` / ``bf16``: cast each bucket, all-reduce, cast back: half the bytes. fp16 keeps 10
  mantissa bits in a narrow range; bf16 keeps fp32's range with 7 bits. torch refuses the bf16
  hook unless the backend is NCCL, so :func:`check_comm_hook` says so before DDP is built;
- ``powersgd``: rank-r approximation ``P Q^T`` of each gradient matrix with error feedback (Vogels
  et al. 2019); an n x m matrix sends r (n + m) numbers instead of n m, after
  ``powersgd_warmup`` plain steps. ``powersgd_fp16`` / ``_bf16`` also cast the factors.

Compression trades compute for bytes: it helps on bandwidth-bound links (Ethernet between
machines) and can cost time on NVLink or loopback, where the all-reduce was cheap already.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel

from torchturbo.config import DistributedConfig
from torchturbo.distributed.comm import CommHook, CommStats, counting_hook
from torchturbo.distributed.normalize import Reference
from torchturbo.distributed.strategy import DataParallel

_NULL = contextlib.nullcontext()


def _no_state(config: DistributedConfig) -> None:
    return None  # the default hooks take the process group as state; None = the default group


def _powersgd_state(config: DistributedConfig) -> powersgd.PowerSGDState:
    return powersgd.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=config.powersgd_rank,
        start_powerSGD_iter=config.powersgd_warmup,
    )


#: config ``comm_hook`` -> (state factory, hook).
COMM_HOOKS: dict[str, tuple[Callable[[DistributedConfig], Any], CommHook]] = {
    "none": (_no_state, default_hooks.allreduce_hook),
    "fp16": (_no_state, default_hooks.fp16_compress_hook),
    "bf16": (_no_state, default_hooks.bf16_compress_hook),
    "powersgd": (_powersgd_state, powersgd.powerSGD_hook),
    "powersgd_fp16": (
        _powersgd_state,
        default_hooks.fp16_compress_wrapper(powersgd.powerSGD_hook),
    ),
    "powersgd_bf16": (
        _powersgd_state,
        default_hooks.bf16_compress_wrapper(powersgd.powerSGD_hook),
    ),
}
#: Hooks that all-reduce bf16 tensors, which torch allows on NCCL only.
NCCL_ONLY_HOOKS = frozenset({"bf16", "powersgd_bf16"})


def check_comm_hook(name: str, backend: str) -> None:
    """Refuse a hook name that does not exist or cannot run on this backend, before DDP starts."""
    if name not in COMM_HOOKS:
        raise ValueError(f"comm_hook = {name!r} is unknown; choose one of {sorted(COMM_HOOKS)}")
    if name in NCCL_ONLY_HOOKS and backend != "nccl":
        raise ValueError(
            f"comm_hook = {name!r} needs the NCCL backend (CUDA), but the process group runs on "
            f"{backend!r}: torch refuses bf16 all-reduce there. Use comm_hook = 'fp16' (same "
            "bytes) or 'powersgd' on CPU; no fallback is made for you"
        )


def prescaled_hook(hook: CommHook, factor: Callable[[], torch.Tensor]) -> CommHook:
    """Multiply this rank's bucket by ``factor()`` before ``hook`` reduces it.

    The factor is read when the bucket is ready, i.e. during the synchronizing backward; see
    distributed/normalize.py for why each rank scales its own gradients by its own count
    reference.
    """

    @functools.wraps(hook)
    def prescaled(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        buffer.mul_(factor().to(buffer.dtype))
        return hook(state, bucket)

    return prescaled


def wrap_ddp(
    model: nn.Module,
    config: DistributedConfig,
    device: torch.device,
    *,
    grad_factor: Callable[[], torch.Tensor] | None = None,
    stats: CommStats | None = None,
) -> DistributedDataParallel:
    """Wrap ``model`` in DDP with the configured bucket and hook settings.

    ``grad_factor`` pre-scales each rank's gradients before reduction; ``stats`` receives the
    bytes and time of every reduction (distributed/comm.py).
    """
    check_comm_hook(config.comm_hook, dist.get_backend())
    ddp = DistributedDataParallel(
        model,
        device_ids=[device.index if device.index is not None else torch.cuda.current_device()]
        if device.type == "cuda"
        else None,
        bucket_cap_mb=config.bucket_cap_mb,
        gradient_as_bucket_view=config.gradient_as_bucket_view,
        static_graph=config.static_graph,
    )
    make_state, hook = COMM_HOOKS[config.comm_hook]
    if grad_factor is not None:
        hook = prescaled_hook(hook, grad_factor)
    if stats is not None:
        hook = counting_hook(hook, stats)
    if hook is not default_hooks.allreduce_hook:
        # Without pre-scale or counting, "none" keeps DDP's built-in C++ all-reduce.
        ddp.register_comm_hook(make_state(config), hook)
    return ddp


class DDPStrategy(DataParallel):
    """A replica per process; gradients all-reduced once per accumulation window.

    Non-final micro-steps run in ``no_sync()``, and ``reduce_count`` refuses to step on gradients
    that were never all-reduced (``Turbo.flush`` after a ``no_sync`` micro-step would let the
    replicas drift apart silently). A checkpoint is written by rank 0 once every rank's
    parameters are found bit-identical (``replicas.json`` records each rank's digest).
    """

    name: ClassVar[str] = "ddp"
    _ddp: DistributedDataParallel | None = None
    _synced = True

    def wrap(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        reference: Reference,
        comm_stats: CommStats | None,
    ) -> nn.Module:
        self._reference = reference
        self._ddp = wrap_ddp(
            model, self.config.distributed, self.device, grad_factor=reference, stats=comm_stats
        )
        return self._ddp

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    def backward_context(self, closing: bool) -> contextlib.AbstractContextManager[Any]:
        if self._ddp is None:
            raise RuntimeError("the DDP strategy has no model yet: call Turbo.setup first")
        self._synced = closing
        return _NULL if closing else self._ddp.no_sync()

    def reduce_count(self, total: torch.Tensor) -> torch.Tensor:
        if not self._synced:
            raise RuntimeError(
                "the optimizer step under DDP follows a micro-step run in no_sync(), whose "
                "gradients were never all-reduced (Turbo.flush() on a partial window?). Iterate "
                "the loader returned by Turbo.setup, which marks the last batch of an epoch"
            )
        return super().reduce_count(total)

    def _verified_files(self, step: int) -> dict[str, Any]:
        if self._ddp is None:
            raise RuntimeError("the DDP strategy has no model yet: call Turbo.setup first")
        # Parameters only: each rank's BatchNorm statistics move with its own batches (DDP
        # broadcasts rank 0's at the next forward), so buffers may differ legitimately.
        digests: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(digests, parameter_digest(self._ddp.module.parameters()))
        if len(set(digests)) > 1:
            raise RuntimeError(
                f"DDP replicas differ at optimizer step {step} (parameter digests {digests}): "
                "some rank stepped on gradients that were not all-reduced; not saving a "
                "checkpoint that only rank 0's replica would be in"
            )
        return {"replicas.json": {"parameter_sha256": digests}}


def parameter_digest(tensors: Iterable[torch.Tensor]) -> str:
    """SHA-256 of the tensors' bytes in order: equal exactly when they are bit-identical."""
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()
