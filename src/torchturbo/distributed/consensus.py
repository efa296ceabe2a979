"""Decisions that every rank must take the same way: rank 0 decides, the others follow.

Under torchrun every rank runs the same program, and the ranks' DDP/FSDP collectives only pair
up while all ranks take the same branches. A branch on a measured time (the tuner's budget, its
verdicts, a speed probe) would split them: each rank measures its own clock, the ranks disagree,
one waits in a collective its peer never enters. So the value that decides the branch is taken
from rank 0 (``agree``), or, for failures, from all ranks at once (``any_rank``). Both are the
identity in a single process.
"""

from __future__ import annotations

from typing import TypeVar

import torch
import torch.distributed as dist

from torchturbo.distributed.launch import current_env

T = TypeVar("T")


def agree(value: T) -> T:
    """Rank 0's ``value`` on every rank (any picklable object)."""
    if not current_env().is_distributed:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def any_rank(flag: bool, device: torch.device | str = "cpu") -> bool:
    """Whether ``flag`` is true on at least one rank. ``device`` must suit the backend (a CUDA
    device for NCCL)."""
    if not current_env().is_distributed:
        return flag
    value = torch.tensor(int(flag), device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())
