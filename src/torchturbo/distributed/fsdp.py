"""FSDP2: shard parameters, gradients and optimizer state across processes with ``fully_shard``.

Each block (``techniques.checkpointing.find_blocks``: the layers of a Sequential/ModuleList) is
its own sharding unit, then the root takes what is left. A unit's parameters are all-gathered
just before its forward and freed after, so peak memory holds the shards plus one or two
unsharded blocks, not the whole model. Mixed precision is FSDP's own ``MixedPrecisionPolicy``
(parameters cast once per all-gather, gradients reduce-scattered in ``fsdp_reduce_dtype``).

``fully_shard`` replaces every parameter by a sharded ``DTensor`` parameter. An optimizer built
before sharding would update the old tensors, so :func:`rebind_optimizer` points its parameter
groups at the new ones (by parameter name), which keeps the engine's "build the optimizer, then
setup" order working.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from torchturbo.config import DistributedConfig
from torchturbo.techniques.checkpointing import find_blocks

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def apply_fsdp(model: nn.Module, config: DistributedConfig) -> nn.Module:
    """Shard each block of ``model``, then the root, with the configured mixed precision."""
    policy = MixedPrecisionPolicy(
        param_dtype=DTYPES[config.fsdp_param_dtype],
        reduce_dtype=DTYPES[config.fsdp_reduce_dtype],
    )
    for _name, block in find_blocks(model):
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def shard_with_optimizer(
    model: nn.Module, config: DistributedConfig, optimizer: torch.optim.Optimizer | None
) -> nn.Module:
    """:func:`apply_fsdp`, then :func:`rebind_optimizer` when an optimizer is given."""
    before = {id(p): name for name, p in model.named_parameters()}
    apply_fsdp(model, config)
    if optimizer is not None:
        rebind_optimizer(optimizer, before, dict(model.named_parameters()))
    return model


def rebind_optimizer(
    optimizer: torch.optim.Optimizer,
    names_before: dict[int, str],
    params_after: dict[str, nn.Parameter],
) -> None:
    """Point ``optimizer`` at the sharded parameters that replaced the ones it was built with."""
    if optimizer.state:
        raise ValueError(
            "the optimizer already holds state (it has stepped): FSDP sharding replaces the "
            "parameters, so shard before the first optimizer step"
        )
    for group in optimizer.param_groups:
        rebound = []
        for param in group["params"]:
            name = names_before.get(id(param))
            if name is None:
                raise ValueError(
                    "the optimizer holds a parameter that is not in the model being sharded; "
                    "build the optimizer from model.parameters()"
                )
            rebound.append(params_after[name])
        group["params"] = rebound
