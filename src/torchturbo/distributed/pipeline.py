"""Pipeline parallelism with ``torch.distributed.pipelining``: one stage of the model per rank.

The article's ``torch.distributed.pipeline.sync.Pipe`` was removed from PyTorch;
``torch.distributed.pipelining`` replaces it. A model that runs its children in sequence (an
``nn.Sequential``) is cut at child boundaries, given explicitly or balanced by a cost per child:
the parameter count (memory), or the measured forward + backward time of each child on a sample
batch (speed; parameter counts mislead there: an early convolution has few parameters and the
largest feature maps). Rank r keeps stage r only. Each batch is split into
``pipeline_microbatches`` micro-batches that flow through the stages: ``gpipe`` runs all
forwards then all backwards (activations of every micro-batch alive at once), ``1f1b``
interleaves one forward with one backward once the pipeline is full (at most ``stages``
micro-batches of activations alive), same result, less memory.

The loss is computed on the last stage from its output and the target, ``loss_fn(output,
target)`` (a mean over the micro-batch), and gradients are those of the mean over micro-batches:
for equal micro-batches, the full batch's mean loss.
"""

from __future__ import annotations

import copy
import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from torchturbo.config import DistributedConfig
from torchturbo.distributed.consensus import agree
from torchturbo.distributed.launch import current_env
from torchturbo.measure.timing import sync

SCHEDULES: dict[str, type[ScheduleGPipe] | type[Schedule1F1B]] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
}


def balanced_boundaries(
    model: nn.Sequential, num_stages: int, costs: Sequence[float] | None = None
) -> list[int]:
    """Child indices where stages 1..num_stages-1 start, balancing ``costs`` (one per child;
    default: parameter counts) greedily."""
    if costs is None:
        sizes: list[float] = [sum(p.numel() for p in child.parameters()) for child in model]
    else:
        sizes = list(costs)
    if len(sizes) != len(model):
        raise ValueError(f"{len(sizes)} costs given for a model with {len(model)} children")
    if not 1 <= num_stages <= len(sizes):
        raise ValueError(
            f"num_stages = {num_stages} is invalid: expected 1 to the model's {len(sizes)} "
            "children (a stage holds at least one child)"
        )
    total = sum(sizes)
    boundaries: list[int] = []
    running: float = 0
    for index, size in enumerate(sizes):
        stages_left = num_stages - 1 - len(boundaries)
        children_left = len(sizes) - index
        # Cut before this child once the current stage has its share, or when every remaining
        # stage needs one of the remaining children.
        if (
            index > 0
            and stages_left > 0
            and (
                running >= total * (len(boundaries) + 1) / num_stages
                or children_left == stages_left
            )
        ):
            boundaries.append(index)
        running += size
    return boundaries


def measured_child_seconds(
    model: nn.Sequential, sample: torch.Tensor, *, repeats: int = 3
) -> list[float]:
    """Median seconds of each child's forward and backward, on the activations ``sample``
    produces as it flows through the model: the per-stage cost a pipeline should balance.

    Each child's backward starts from the gradient of its output's sum (the shape, not the value,
    sets the cost). Gradients accumulated by the measurement are cleared afterwards.
    """
    device = sample.device
    seconds: list[list[float]] = [[] for _ in model]
    for _ in range(repeats):
        x = sample
        for index, child in enumerate(model):
            x = x.detach().requires_grad_(x.is_floating_point())
            sync(device)
            begin = time.perf_counter()
            out = child(x)
            out.float().sum().backward()
            sync(device)
            seconds[index].append(time.perf_counter() - begin)
            x = out
    model.zero_grad(set_to_none=True)
    return [statistics.median(s) for s in seconds]


def _measure_on_a_copy(
    model: nn.Sequential, sample: torch.Tensor, device: torch.device
) -> list[float]:
    """:func:`measured_child_seconds` on a copy of the whole model on ``device``, with the RNG
    restored afterwards: the model itself (BatchNorm statistics, placement) and the training's
    random stream are left as they were. The copy must fit one device: for a model that does not,
    give the boundaries or balance by parameter count."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        replica = copy.deepcopy(model).to(device)
        seconds = measured_child_seconds(replica, sample.to(device))
    del replica
    return seconds


def split_sequential(
    model: nn.Sequential, num_stages: int, boundaries: Sequence[int] | None = None
) -> list[nn.Sequential]:
    """Cut ``model`` into ``num_stages`` consecutive stages at the given child indices."""
    if not isinstance(model, nn.Sequential):
        raise ValueError(
            f"pipeline splitting needs an nn.Sequential (children run in order), got "
            f"{type(model).__name__}"
        )
    cuts = list(balanced_boundaries(model, num_stages) if boundaries is None else boundaries)
    in_range = all(0 < cut < len(model) for cut in cuts)
    if len(cuts) != num_stages - 1 or cuts != sorted(set(cuts)) or not in_range:
        raise ValueError(
            f"boundaries = {cuts} is invalid for {num_stages} stages of a model with "
            f"{len(model)} children: expected {num_stages - 1} increasing indices in "
            f"[1, {len(model) - 1}]"
        )
    edges = [0, *cuts, len(model)]
    # A slice of a Sequential is a Sequential; torch annotates __getitem__ as Sequential | Module.
    return [model[start:end] for start, end in itertools.pairwise(edges)]  # type: ignore[misc]


@dataclass
class PipelineRun:
    """This rank's stage and the schedule that drives it. Build it with :func:`build_pipeline`."""

    stage_module: nn.Module
    schedule: ScheduleGPipe | Schedule1F1B
    stage_index: int
    num_stages: int

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def step(
        self, inputs: torch.Tensor | None = None, target: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Forward and backward of one batch; the first stage passes ``inputs``, the last
        ``target``. Returns the mean micro-batch loss on the last stage, None elsewhere."""
        if self.is_first:
            if inputs is None:
                raise ValueError("the first pipeline stage needs inputs= for step()")
            self.schedule.step(inputs)
            return None
        if not self.is_last:
            self.schedule.step()
            return None
        if target is None:
            raise ValueError("the last pipeline stage needs target= for step()")
        losses: list[torch.Tensor] = []
        self.schedule.step(target=target, losses=losses)
        return torch.stack([loss.detach() for loss in losses]).mean()


def build_pipeline(
    model: nn.Sequential,
    config: DistributedConfig,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    device: torch.device,
    *,
    boundaries: Sequence[int] | None = None,
    sample: torch.Tensor | None = None,
) -> PipelineRun:
    """Keep this rank's stage of ``model`` on ``device`` and schedule it (one stage per rank).

    Stages start at ``boundaries`` when given; else, with a ``sample`` batch, they balance the
    measured time of each child (measured by rank 0 on a copy of the model, and broadcast, so
    that every rank cuts alike); else the parameter counts.
    """
    env = current_env()
    if env.world_size < 2:
        raise ValueError("pipeline parallelism needs at least 2 processes: launch with torchrun")
    if boundaries is None and sample is not None:
        costs = agree(_measure_on_a_copy(model, sample, device) if env.rank == 0 else None)
        boundaries = balanced_boundaries(model, env.world_size, costs)
    stages = split_sequential(model, env.world_size, boundaries)
    stage_module = stages[env.rank].to(device)
    stage = PipelineStage(stage_module, env.rank, env.world_size, device)
    schedule_type = SCHEDULES[config.pipeline_schedule]
    schedule = schedule_type(stage, n_microbatches=config.pipeline_microbatches, loss_fn=loss_fn)
    return PipelineRun(stage_module, schedule, env.rank, env.world_size)
