"""The batch finder on a recipe: each micro-batch size measured as one real training step, and
the ranks' measurements agreed so that every rank chooses the same batch.

A size is measured as the step training will run: a fresh trial (``trials.trial``) of the
config on one recipe batch cut into ``[accumulation] micro_batches`` pieces of that size (the
whole batch stays in memory, as it does when the loader hands it over), or on one larger batch
for ``max``. The figure is its step footprint (``Trial.memory_footprint``: the allocator's peak
on CUDA, saved tensors + weights + gradients + optimizer state on CPU), or "does not fit" when
CUDA runs out of memory. A recipe with per-sample lengths is measured on its longest samples,
padded as the loader pads them, so that no batch of that size needs more. Under torchrun every
rank measures its own step and the verdict is taken over all of them (an ``all_reduce`` of the
largest overshoot): a size fits only where it fits on every rank, so the smallest rank's fit
wins, and every rank takes the same branches of the search (the trials' DDP collectives keep
pairing up).
"""

from __future__ import annotations

import dataclasses
import gc
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchturbo.config import TurboConfig
from torchturbo.data.length import length_or_none
from torchturbo.distributed.launch import current_env, init_distributed
from torchturbo.engine import resolve_device
from torchturbo.recipe import Recipe
from torchturbo.trials.trial import fixed_batches, start_trial
from torchturbo.tune.batch.choice import BatchChoice, BatchMode, plan

__all__ = ["apply_choice", "find_batch", "step_footprint"]

#: How far ``max`` grows the recipe's batch at most (x its batch size).
MAX_GROWTH = 16


def find_batch(
    recipe: Recipe,
    budget_bytes: int,
    *,
    config: TurboConfig | None = None,
    mode: BatchMode = "keep",
) -> BatchChoice:
    """The largest micro-batch of ``recipe`` whose training step fits ``budget_bytes`` under
    ``config`` (default: fp32 eager on the best device), and the plan that keeps the global
    batch (``keep``) or grows it (``max``): see ``tune.batch.choice``. Under torchrun call it on
    every rank; all of them return the same plan, the one that fits on every rank.
    """
    if budget_bytes < 1:
        raise ValueError(f"memory budget {budget_bytes} bytes is not positive")
    config = config or TurboConfig(device=str(resolve_device("auto")))
    config = config.replace(accumulation__micro_batches=1)
    env = init_distributed(config.device)  # under torchrun: joins the group the ranks agree in
    device = resolve_device(config.device)
    budget = _agreed(budget_bytes, device, smallest=True)

    def fits(size: int) -> tuple[bool, int | None]:
        used = step_footprint(recipe, config, size)
        if used is None and device.type == "cpu":
            raise ValueError(
                "the batch finder cannot measure this config's step on CPU (a compiled model "
                "whose saved tensors this torch hides): find the batch with --compile.mode off"
            )
        # A size that ran out of memory counts as an overshoot larger than any budget.
        over = _agreed((used if used is not None else 2 * budget + 1) - budget_bytes, device)
        largest = _agreed(used if used is not None else -1, device)
        return over <= 0, largest if largest >= 0 else None

    model, optimizer = recipe.build()
    found = plan(
        fits,
        recipe_batch=recipe.batch_size,
        budget_bytes=budget,
        world_size=env.world_size,
        mode=mode,
        grow=_growth(recipe, env.world_size),
        optimizer=type(optimizer).__name__,  # picks the learning-rate rule
        accumulation_steps=config.accumulation.steps,
    )
    notes = _length_notes(recipe, found) + _norm_notes(model, found)
    return dataclasses.replace(found, notes=found.notes + notes)


def apply_choice(config: TurboConfig, choice: BatchChoice) -> TurboConfig:
    """``config`` training in ``choice``'s micro-batches (``[accumulation] micro_batches``)."""
    return config.replace(accumulation__micro_batches=choice.micro_batches)


def step_footprint(recipe: Recipe, config: TurboConfig, size: int) -> int | None:
    """Bytes one training step of ``config`` needs with micro-batches of ``size`` samples of
    ``recipe`` (a recipe batch cut into pieces of that size, or a batch of ``size`` above the
    recipe's: see the module); None where CUDA ran out of memory or no figure can be read."""
    pieces = math.ceil(recipe.batch_size / size)
    if math.ceil(recipe.batch_size / pieces) != size and size < recipe.batch_size:
        raise ValueError(f"a batch of {recipe.batch_size} cannot be cut into pieces of {size}")
    batch = probe_batch(recipe, max(size, recipe.batch_size))
    config = config.replace(accumulation__micro_batches=pieces)
    device = resolve_device(config.device)
    trial = None
    try:
        trial, _ = start_trial(recipe, config, [batch])
        used, _ = trial.memory_footprint()
    except torch.OutOfMemoryError:
        used = None
    finally:
        if trial is not None:
            trial.close()
        del trial
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return used


def probe_batch(recipe: Recipe, size: int) -> Any:
    """A collated batch of ``size`` samples: the longest ones when the recipe gives lengths,
    else the first of the recipe's seeded shuffle (as the tuner's trials draw them)."""
    if recipe.lengths is None:
        return fixed_batches(dataclasses.replace(recipe, batch_size=size), 1)[0]
    lengths = list(recipe.lengths)
    if size > len(lengths):
        raise ValueError(
            f"recipe {recipe.name!r}: a batch of {size} samples needs more than its {len(lengths)}"
        )
    longest = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))[:size]
    return recipe.collate_fn()([recipe.dataset[i] for i in longest])


def _agreed(value: int, device: torch.device, *, smallest: bool = False) -> int:
    """The largest (or smallest) ``value`` over the ranks; ``value`` itself in one process."""
    if not current_env().is_distributed:
        return value
    reduce_device = device if device.type == "cuda" else torch.device("cpu")
    tensor = torch.tensor([-value if smallest else value], dtype=torch.int64, device=reduce_device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    result = int(tensor.item())
    return -result if smallest else result


def _growth(recipe: Recipe, world_size: int) -> int:
    """How far ``max`` may grow the batch: :data:`MAX_GROWTH`, within the dataset's samples per
    process."""
    size = length_or_none(recipe.dataset)
    if size is None:
        return MAX_GROWTH
    return max(1, min(MAX_GROWTH, size // world_size // recipe.batch_size))


def _norm_notes(model: nn.Module, found: BatchChoice) -> tuple[str, ...]:
    """BatchNorm is what micro-batching cannot keep exact: say so where the model has one."""
    kinds = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
    norms = any(isinstance(m, kinds) for m in model.modules())
    if not norms or found.micro_batches == 1:
        return ()
    return (
        "the model's BatchNorm layers compute their statistics per micro-batch, not per batch "
        "(GroupNorm or LayerNorm would not change)",
    )


def _length_notes(recipe: Recipe, found: BatchChoice) -> tuple[str, ...]:
    if recipe.lengths is None:
        return ()
    longest = max(recipe.lengths)
    mean = sum(recipe.lengths) / len(recipe.lengths)
    tokens = math.floor(found.planned_global_batch * mean)
    kept = "kept" if found.planned_global_batch == found.global_batch else "changed"
    return (
        f"measured on the longest samples (up to {longest} tokens), padded as the loader pads "
        "them: no batch of the same size needs more",
        f"tokens per optimizer step {kept}: about {tokens:,} ({mean:.0f} per sample on "
        "average), the same samples cut into pieces",
    )
