"""Distributed training under torchrun: process group start-up, the engine's strategies (DDP with
comm hooks, FSDP2), pipeline parallelism and communication accounting. See docs/distributed.md.

``Turbo.setup`` chooses and applies the strategy itself; nothing here needs calling for that.

The names are imported on first use (``torchturbo.lazy_exports``): importing one module of
the package does not import them all.
"""

from torchturbo import lazy_exports

_EXPORTS = {
    "CommStats": "torchturbo.distributed.comm",
    "counting_hook": "torchturbo.distributed.comm",
    "COMM_HOOKS": "torchturbo.distributed.ddp",
    "DDPStrategy": "torchturbo.distributed.ddp",
    "check_comm_hook": "torchturbo.distributed.ddp",
    "wrap_ddp": "torchturbo.distributed.ddp",
    "FSDPStrategy": "torchturbo.distributed.fsdp",
    "apply_fsdp": "torchturbo.distributed.fsdp",
    "DistEnv": "torchturbo.distributed.launch",
    "current_env": "torchturbo.distributed.launch",
    "init_distributed": "torchturbo.distributed.launch",
    "is_main_process": "torchturbo.distributed.launch",
    "launched": "torchturbo.distributed.launch",
    "main_print": "torchturbo.distributed.launch",
    "read_launch_env": "torchturbo.distributed.launch",
    "shutdown": "torchturbo.distributed.launch",
    "PipelineRun": "torchturbo.distributed.pipeline",
    "balanced_boundaries": "torchturbo.distributed.pipeline",
    "build_pipeline": "torchturbo.distributed.pipeline",
    "measured_child_seconds": "torchturbo.distributed.pipeline",
    "split_sequential": "torchturbo.distributed.pipeline",
    "STRATEGIES": "torchturbo.distributed.select",
    "select_strategy": "torchturbo.distributed.select",
    "Strategy": "torchturbo.distributed.strategy",
}

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

__getattr__ = lazy_exports(__name__, _EXPORTS)
