"""Checks of a config against the machine and the launch, run when a command loads one."""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass

if sys.version_info >= (3, 11):
    pass
else:  # pragma: no cover - exercised only on Python 3.10
    pass

from torchturbo.config.sections import DistributedConfig
from torchturbo.config.turbo import TurboConfig
from torchturbo.config.validation import DEVICE_NAME


@dataclass(frozen=True, kw_only=True)
class Environment:
    """What the machine and the launch offer: the facts :func:`check_environment` reads."""

    cuda_devices: int
    #: Processes of the run: torchrun's WORLD_SIZE, 1 without torchrun.
    processes: int
    #: The CPU has native fp16 arithmetic (AVX512-FP16 or AMX-FP16).
    cpu_fp16: bool

    @classmethod
    def current(cls) -> Environment:
        import torch

        from torchturbo.measure.system import cpu_flags

        world_size = os.environ.get("WORLD_SIZE", "1")
        return cls(
            cuda_devices=torch.cuda.device_count() if torch.cuda.is_available() else 0,
            processes=int(world_size) if world_size.isdigit() else 1,
            cpu_fp16=bool(cpu_flags() & {"avx512_fp16", "amx_fp16"}),
        )


def check_environment(config: TurboConfig, env: Environment) -> tuple[list[str], list[str]]:
    """(errors, warnings) that ``config`` meets on this machine and launch, before any step runs.

    Errors are combinations that cannot run; warnings are settings that run but do not do what
    their name promises here. Each is one sentence naming the fields.
    """
    errors, warnings = [], []
    index = DEVICE_NAME.fullmatch(config.device)["index"]  # type: ignore[index]  # validated
    if config.device.startswith("cuda") and env.cuda_devices == 0:
        errors.append(f"device = {config.device!r} needs CUDA; this machine has no CUDA device")
    elif index is not None and int(index) >= env.cuda_devices:
        errors.append(
            f"device = {config.device!r} is not on this machine: it has {env.cuda_devices} "
            f"CUDA device(s), cuda:0 to cuda:{env.cuda_devices - 1}"
        )
    on_cpu = config.device == "cpu" or (config.device == "auto" and env.cuda_devices == 0)
    if config.precision.dtype == "fp16" and on_cpu and not env.cpu_fp16:
        warnings.append(
            "[precision] dtype = 'fp16' on this CPU runs emulated (no avx512_fp16 or amx_fp16), "
            "slower than fp32, and needs loss scaling; dtype = 'bf16' needs none"
        )
    if env.processes == 1 and config.distributed != DistributedConfig():
        changed = [
            f.name
            for f in dataclasses.fields(DistributedConfig)
            if getattr(config.distributed, f.name) != f.default
        ]
        warnings.append(
            f"[distributed] {', '.join(changed)} take(s) effect only under torchrun "
            "(torchrun --nproc-per-node N -m torchturbo ...); this is one process"
        )
    return errors, warnings
