"""The model as the engine trains it: on its device, transformed, then wrapped by the strategy.

``Turbo.setup`` calls :func:`compose` once. The model transforms and their order are the
technique registry's (``techniques/registry.compose_model``, the same function both trainer
callbacks call); distributed wrapping is the strategy's and comes last.
"""

from __future__ import annotations

import torch
from torch import nn

from torchturbo.config import DistributedConfig, TurboConfig
from torchturbo.distributed.comm import CommStats
from torchturbo.distributed.normalize import Reference
from torchturbo.distributed.strategy import Strategy
from torchturbo.techniques import registry
from torchturbo.techniques.framework.result import TechniqueResult, applied, not_applied


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

    Parameter objects are kept through the transforms (all in place), so ``optimizer`` stays
    valid; FSDP replaces them when it wraps and re-points ``optimizer`` at the shards.
    """
    # Device first: every later step must see the final parameter storage (DDP registers hooks
    # on it, FSDP shards it, compile specializes on its device).
    model = model.to(device)
    # The techniques' model transforms, in the registry's order (each says why its place).
    results = registry.compose_model(model, config, device, "engine")
    # Distributed wrapping last: DDP builds its buckets from the final parameters and FSDP
    #    replaces them by shards, so nothing may change them afterwards.
    wrapped = strategy.wrap(model, optimizer, reference, comm_stats)
    if strategy.env.is_distributed:
        results["distributed"] = applied("distributed", (strategy.name,))
    elif config.distributed != DistributedConfig():
        results["distributed"] = not_applied(
            "distributed", "one process: launch with torchrun --nproc-per-node N to run distributed"
        )
    return wrapped, results
