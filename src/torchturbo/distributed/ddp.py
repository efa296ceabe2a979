"""DDP with gradient-compression comm hooks, and the rank-local gradient pre-scale.

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

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel

from torchturbo.config import DistributedConfig
from torchturbo.distributed.comm import CommHook, CommStats, counting_hook


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
    distributed/setup.py for why each rank scales its own gradients by its own count reference.
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
