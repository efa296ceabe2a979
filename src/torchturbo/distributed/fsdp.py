"""FSDP2: shard parameters, gradients and optimizer state across processes with ``fully_shard``,
and the strategy that trains and checkpoints (sharded, through ``torch.distributed.checkpoint``)
that way.

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

import shutil
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from torchturbo.base.blocks import find_blocks
from torchturbo.config import DistributedConfig
from torchturbo.distributed.comm import CommStats
from torchturbo.distributed.normalize import Reference, scale_output_gradients
from torchturbo.distributed.strategy import DataParallel
from torchturbo.resume.files import SHARDS, CheckpointError, checkpoint_name
from torchturbo.techniques.framework.result import TechniqueResult, applied

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def apply_fsdp(model: nn.Module, config: DistributedConfig) -> TechniqueResult:
    """Shard each block of ``model``, then the root, in place, with the configured mixed
    precision; the result's ``targets`` are the blocks sharded as units of their own."""
    policy = MixedPrecisionPolicy(
        param_dtype=DTYPES[config.fsdp_param_dtype],
        reduce_dtype=DTYPES[config.fsdp_reduce_dtype],
    )
    blocks = find_blocks(model)
    for _name, block in blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return applied("fsdp", tuple(name for name, _ in blocks))


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


class FSDPStrategy(DataParallel):
    """Parameters, gradients and optimizer state sharded across processes (``fully_shard``).

    Gradients are reduce-scattered every micro-step (``no_sync`` would keep whole unsharded
    gradients in memory). Checkpoints are sharded: every rank writes its own shards of the model
    and optimizer state through ``torch.distributed.checkpoint`` and reads them back into the
    live sharded state, so no rank ever holds the whole model; rank 0 writes the shared files
    (counters, config, loss scale) and every rank's random state beside them.
    """

    name: ClassVar[str] = "fsdp"

    def wrap(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        reference: Reference,
        comm_stats: CommStats | None,
    ) -> nn.Module:
        if comm_stats is not None:
            raise ValueError(
                "comm_stats= counts DDP comm hooks; strategy = 'fsdp' reduce-scatters without them"
            )
        self._reference = reference
        sharded = shard_with_optimizer(model, self.config.distributed, optimizer)
        scale_output_gradients(sharded, reference)
        return sharded

    def state_dicts(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        # DTensor shards keyed by parameter name (the optimizer's too, not by position).
        return get_state_dict(model, optimizer)

    def load_state_dicts(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        model_state: dict[str, Any],
        optimizer_state: dict[str, Any],
    ) -> None:
        set_state_dict(
            model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state
        )

    def _save_tensors(
        self, root: str | Path, step: int, tensors: dict[str, Any], shared: dict[str, Any]
    ) -> Path | None:
        # Named like write_checkpoint's temporaries, so that a crash mid-save leaves a directory
        # the next save prunes. Every rank writes into it: a filesystem all ranks share.
        staging = Path(root) / f".tmp-{checkpoint_name(step)}-shards"
        if self.env.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        self._barrier()
        dcp.save(tensors, checkpoint_id=staging)
        return staging

    def load_tensors(
        self, path: Path, files: dict[str, Any], live: dict[str, Any]
    ) -> dict[str, Any]:
        if not (path / SHARDS).is_dir():
            raise CheckpointError(
                f"checkpoint {str(path)!r} holds whole state dicts, not FSDP shards: it was "
                "saved by a single process or DDP; resume it with the strategy that saved it"
            )
        dcp.load(live, checkpoint_id=path / SHARDS)
        return live
