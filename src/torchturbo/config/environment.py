"""Checks of a config against the machine and the launch, run when a command loads one."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

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
    #: Devices of the accelerator torch finds here other than CUDA (mps, xpu, a PrivateUse1
    #: backend), by type: what a config's ``device = "xpu:1"`` is checked against.
    other_devices: Mapping[str, int] = field(default_factory=dict)
    #: Processes of the run: torchrun's WORLD_SIZE, 1 without torchrun.
    processes: int
    #: The CPU has native fp16 arithmetic (AVX512-FP16 or AMX-FP16).
    cpu_fp16: bool

    @classmethod
    def current(cls) -> Environment:
        import torch

        from torchturbo.measure.system import cpu_flags

        world_size = os.environ.get("WORLD_SIZE", "1")
        accelerator = torch.accelerator.current_accelerator()
        other = {}
        if accelerator is not None and accelerator.type != "cuda":
            available = torch.accelerator.is_available()
            other[accelerator.type] = torch.accelerator.device_count() if available else 0
        return cls(
            cuda_devices=torch.cuda.device_count() if torch.cuda.is_available() else 0,
            other_devices=other,
            processes=int(world_size) if world_size.isdigit() else 1,
            cpu_fp16=bool(cpu_flags() & {"avx512_fp16", "amx_fp16"}),
        )


def check_environment(config: TurboConfig, env: Environment) -> tuple[list[str], list[str]]:
    """(errors, warnings) that ``config`` meets on this machine and launch, before any step runs.

    Errors are combinations that cannot run; warnings are settings that run but do not do what
    their name promises here. Each is one sentence naming the fields.
    """
    errors, warnings = [], []
    if (problem := _device_missing(config.device, env)) is not None:
        errors.append(problem)
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


def _device_missing(device: str, env: Environment) -> str | None:
    """Why ``device`` (a valid name) is not on this machine, or None."""
    match = DEVICE_NAME.fullmatch(device)
    kind, index = match["type"], match["index"]  # type: ignore[index]  # validated
    if kind in (None, "cpu"):
        return None
    count = env.cuda_devices if kind == "cuda" else env.other_devices.get(kind, 0)
    if count == 0:
        if kind == "cuda":
            return f"device = {device!r} needs CUDA; this machine has no CUDA device"
        here = {"cpu": 1, "cuda": env.cuda_devices, **env.other_devices}
        found = ", ".join(name for name, n in here.items() if n)
        return f"device = {device!r}: torch finds no {kind} device here (devices here: {found})"
    if index is not None and int(index) >= count:
        return (
            f"device = {device!r} is not on this machine: it has {count} {kind} device(s), "
            f"{kind}:0 to {kind}:{count - 1}"
        )
    return None
