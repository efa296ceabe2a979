"""The order in which the engine applies its model transforms, in one function.

``Turbo.setup`` calls :func:`compose` once; nothing else wraps or transforms the model. Each
step says which constraint puts it where it is; ``tests/test_engine.py`` checks the order.
"""

from __future__ import annotations

import torch
from torch import nn

from torchturbo.config import DistributedConfig, TurboConfig
from torchturbo.distributed.comm import CommStats
from torchturbo.distributed.normalize import Reference
from torchturbo.distributed.strategy import Strategy
from torchturbo.techniques.checkpointing import apply_activation_checkpointing
from torchturbo.techniques.compile import apply_compile
from torchturbo.techniques.float8 import apply_float8_training
from torchturbo.techniques.memory_format import apply_channels_last
from torchturbo.techniques.result import TechniqueResult, applied, not_applied


def compose(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    config: TurboConfig,
    device: torch.device,
    strategy: Strategy,
    reference: Reference,
    comm_stats: CommStats | None = None,
) -> tuple[nn.Module, dict[str, TechniqueResult]]:
    """The model as training runs it, and what each requested technique did.

    Parameter objects are kept through steps 1-4 (all in place), so ``optimizer`` stays valid;
    FSDP in step 5 replaces them and re-points ``optimizer`` at the shards.
    """
    results: dict[str, TechniqueResult] = {}
    # 1. Device first: every later step must see the final parameter storage (DDP registers
    #    hooks on it, FSDP shards it, compile specializes on its device).
    model = model.to(device)
    # float8 swaps Linear modules (keeping their parameters) before anything wraps them.
    if config.precision.float8:
        results["float8"] = apply_float8_training(model, device)
    # 2. Layout before compile, so the compiled graph is traced with NHWC strides.
    if config.memory_format.channels_last:
        results["channels_last"] = apply_channels_last(model)
    # 3. Checkpointing before compile: compile must see the checkpoint regions to keep them
    #    (torch.compile traces through checkpoint and honours its recompute boundaries).
    if config.checkpointing.mode != "off":
        results["checkpointing"] = apply_activation_checkpointing(model, config.checkpointing)
    # 4. Compile last among single-device transforms: it traces the model as steps 2-3 left it,
    #    and without the collectives of step 5 (DDP's hooks would break the graph).
    if config.compile.mode != "off":
        results["compile"] = apply_compile(model, config.compile)
    # 5. Distributed wrapping last: DDP builds its buckets from the final parameters and FSDP
    #    replaces them by shards, so nothing may change them afterwards.
    wrapped = strategy.wrap(model, optimizer, reference, comm_stats)
    if strategy.env.is_distributed:
        results["distributed"] = applied("distributed", (strategy.name,))
    elif config.distributed != DistributedConfig():
        results["distributed"] = not_applied(
            "distributed", "one process: launch with torchrun --nproc-per-node N to run distributed"
        )
    return wrapped, results
