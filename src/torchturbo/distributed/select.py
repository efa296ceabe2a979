"""Which strategy a launch trains with: the registry of names and the one choice."""

from __future__ import annotations

import torch

from torchturbo.config import TurboConfig
from torchturbo.distributed.ddp import DDPStrategy
from torchturbo.distributed.fsdp import FSDPStrategy
from torchturbo.distributed.launch import DistEnv
from torchturbo.distributed.strategy import Strategy

#: ``[distributed] strategy`` -> the strategy it names under torchrun.
STRATEGIES: dict[str, type[Strategy]] = {"ddp": DDPStrategy, "fsdp": FSDPStrategy}


def select_strategy(config: TurboConfig, device: torch.device, env: DistEnv) -> Strategy:
    """One process: :class:`Strategy` itself. Under torchrun: ``[distributed] strategy``."""
    if not env.is_distributed:
        return Strategy(config, device, env)
    name = config.distributed.strategy
    try:
        strategy_type = STRATEGIES[name]
    except KeyError:
        raise ValueError(
            f"[distributed] strategy = {name!r} is unknown; choose one of {sorted(STRATEGIES)}"
        ) from None
    return strategy_type(config, device, env)
