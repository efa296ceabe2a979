"""Distributed training under torchrun: process group start-up, the engine's strategies (DDP with
comm hooks, FSDP2), pipeline parallelism and communication accounting. See docs/distributed.md.

``Turbo.setup`` chooses and applies the strategy itself; nothing here needs calling for that."""

from torchturbo.distributed.comm import CommStats, counting_hook
from torchturbo.distributed.ddp import COMM_HOOKS, DDPStrategy, check_comm_hook, wrap_ddp
from torchturbo.distributed.fsdp import FSDPStrategy, apply_fsdp
from torchturbo.distributed.launch import (
    DistEnv,
    current_env,
    init_distributed,
    is_main_process,
    launched,
    main_print,
    read_launch_env,
    shutdown,
)
from torchturbo.distributed.pipeline import (
    PipelineRun,
    balanced_boundaries,
    build_pipeline,
    measured_child_seconds,
    split_sequential,
)
from torchturbo.distributed.select import STRATEGIES, select_strategy
from torchturbo.distributed.strategy import Strategy

__all__ = [
    "COMM_HOOKS",
    "STRATEGIES",
    "CommStats",
    "DDPStrategy",
    "DistEnv",
    "FSDPStrategy",
    "PipelineRun",
    "Strategy",
    "apply_fsdp",
    "balanced_boundaries",
    "build_pipeline",
    "check_comm_hook",
    "counting_hook",
    "current_env",
    "init_distributed",
    "is_main_process",
    "launched",
    "main_print",
    "measured_child_seconds",
    "read_launch_env",
    "select_strategy",
    "shutdown",
    "split_sequential",
    "wrap_ddp",
]
