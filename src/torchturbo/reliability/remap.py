"""A mid-epoch loader position carried onto another number of ranks, exactly.

A loader position counts the batches *this rank* trained; under another world size those counts
mean other samples (resumed from 1 process on 2, the per-rank count of 4 batches would skip 8
global batches where 4 were trained). What is invariant is how far into the epoch's *global*
order the ranks got together: every loader the engine builds draws that order independently of
the world size, and rank r of W takes units r, r+W, r+2W, ... of it:

- ``distributed``: a ``BatchSampler`` over a ``DistributedSampler`` (the engine under torchrun):
  the order is ``randperm(N)`` seeded by ``seed + epoch``, whatever the world size;
- ``loader``: a ``BatchSampler`` over the loader's ``RandomSampler`` (or ``SequentialSampler``)
  in one process: the order is what the loader draws from its generator at the epoch's start,
  saved in the checkpoint;
- ``plan``: a batch plan's sampler (``data.batch_plan.PlannedSampler``): its plan of whole batches,
  seeded by ``(seed, epoch)``; its unit is a batch, not a sample.

A position saved by W ranks after k batches each has consumed ``k x B x W`` samples of the
order (``k x W`` batches of a plan). :func:`remainder_batches` gives rank r of W' the units not
consumed yet, dealt out as above (padded by repeating the order's first units, as
``DistributedSampler`` pads, so that every rank gets the same number of batches) and grouped into
this loader's batch size: every sample of the epoch is trained once, none is skipped and none
twice, except the padding that any world size has. From there training goes on with W' ranks:
the global batch becomes ``B x W'``.

Loaders whose order cannot be rebuilt (a stream, a loader or a stream that saves its own state
per rank, a sampler of the user's) get :func:`spec` None, and a resume at another world size
mid-epoch is refused (``resume.checks``); at an epoch's start there is nothing to carry over.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from torchturbo.data.batch_plan import PlannedSampler


def spec(loader: DataLoader, epoch: int) -> dict[str, Any] | None:
    """What epoch ``epoch``'s global order of ``loader`` is built from (JSON): its kind, the
    dataset's ``size`` in samples, the world size, the units one batch of one rank takes
    (``unit``: samples, or 1 batch of a plan); None when it cannot be rebuilt. Cheap: a plan is
    not drawn here (it is on a resume that carries a position over)."""
    if type(loader) is not DataLoader or isinstance(loader.dataset, IterableDataset):
        return None
    batches: Any = loader.batch_sampler
    if isinstance(batches, PlannedSampler):
        if batches.drop_last:
            return None
        return {
            "kind": "plan",
            "world_size": int(batches.num_replicas),
            "seed": int(batches.seed),
            "epoch": epoch,
            "size": len(loader.dataset),  # type: ignore[arg-type]  # map-style: it has one
            "unit": 1,
        }
    if type(batches) is not BatchSampler:
        return None
    sampler: Any = batches.sampler
    size = len(loader.dataset)  # type: ignore[arg-type]  # map-style: it has one
    if type(sampler) is DistributedSampler and not sampler.drop_last:
        return {
            "kind": "distributed",
            "world_size": sampler.num_replicas,
            "seed": sampler.seed,
            "shuffle": sampler.shuffle,
            "epoch": epoch,
            "size": size,
            "unit": batches.batch_size,
        }
    plain = type(sampler) is SequentialSampler or (
        type(sampler) is RandomSampler
        and not sampler.replacement
        and sampler.num_samples == size
        and sampler.generator is loader.generator
    )
    if not plain:
        return None
    return {
        "kind": "loader",
        "world_size": 1,
        "shuffle": type(sampler) is RandomSampler,
        "epoch": epoch,
        "size": size,
        "unit": batches.batch_size,
    }


def carried_over(order: dict[str, Any] | None, loader: DataLoader) -> bool:
    """Whether a position of ``order`` resumes on ``loader`` by carrying it over: it was saved
    at another world size (or in an epoch already carried over), part way into the epoch."""
    if order is None or not order.get("consumed"):
        return False
    return bool(order.get("remapped")) or order["world_size"] != world(loader)[0]


def problem(loader: DataLoader, saved: dict[str, Any] | None) -> str | None:
    """Why the position of order ``saved`` cannot be carried onto ``loader``; None if it can."""
    if saved is None:
        return (
            "its loader's order cannot be rebuilt (a stream, a loader that saves its own "
            "state per rank, or a sampler of the user's)"
        )
    here = spec(loader, int(saved["epoch"]))
    if here is None:
        return "this run's loader cannot take a rebuilt order (a stream or a sampler of the user's)"
    if (saved["kind"] == "plan") != (here["kind"] == "plan"):
        return "one run batches by length and the other does not"
    if here["size"] != saved.get("size"):
        return f"its epoch has {saved.get('size')} samples, this run's {here['size']}"
    return None


def remainder_batches(
    loader: DataLoader,
    saved: dict[str, Any],
    consumed: int,
    generator_state: torch.Tensor | None,
    torch_state: torch.Tensor,
) -> list[list[int]]:
    """This rank's batches of the rest of the epoch of order ``saved``, ``consumed`` units in.
    ``generator_state``/``torch_state`` are the random state the epoch began with."""
    here = spec(loader, int(saved["epoch"]))
    assert here is not None  # problem() said it can
    order = _global_order(loader, saved, generator_state, torch_state)
    ranks, rank = world(loader)
    rest = order[consumed:]
    padding = -len(rest) % ranks
    rest += [order[i % len(order)] for i in range(padding)]  # as DistributedSampler pads
    mine = rest[rank::ranks]
    if saved["kind"] == "plan":
        return [list(batch) for batch in mine]
    batches = loader.batch_sampler
    assert isinstance(batches, BatchSampler)
    size = batches.batch_size
    grouped = [mine[i : i + size] for i in range(0, len(mine), size)]
    if batches.drop_last and grouped and len(grouped[-1]) < size:
        grouped.pop()
    return grouped


def _global_order(
    loader: DataLoader,
    saved: dict[str, Any],
    generator_state: torch.Tensor | None,
    torch_state: torch.Tensor,
) -> list[Any]:
    """The epoch's units in the order the ranks take them, rebuilt from ``saved``."""
    kind, epoch, size = saved["kind"], int(saved["epoch"]), int(saved["size"])
    if kind == "plan":
        batches: Any = loader.batch_sampler
        previous = batches.epoch
        batches.set_epoch(epoch)
        try:
            return list(batches.global_batches())
        finally:
            batches.set_epoch(previous)
    if kind == "distributed":
        # One replica: the same permutation every world size deals out, unpadded.
        whole: DistributedSampler[int] = DistributedSampler(
            range(size),  # type: ignore[arg-type]  # any sized sequence: only len() is read
            num_replicas=1,
            rank=0,
            shuffle=saved["shuffle"],
            seed=saved["seed"],
        )
        whole.set_epoch(epoch)
        return list(whole)
    if not saved["shuffle"]:
        return list(range(size))
    return _drawn_order(size, generator_state, torch_state)


def _drawn_order(
    size: int, generator_state: torch.Tensor | None, torch_state: torch.Tensor
) -> list[int]:
    """The indices a one-process shuffled DataLoader drew in an epoch that began with this
    random state: a DataLoader of indices built alike, iterated on a copy of the state (its
    iterator draws a worker seed before the sampler's permutation, as the real one did)."""
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(torch_state)
        generator = None
        if generator_state is not None:
            generator = torch.Generator()
            generator.set_state(generator_state)
        indices: DataLoader[int] = DataLoader(
            range(size),  # type: ignore[arg-type]  # a sequence of its own indices
            batch_size=None,
            shuffle=True,
            generator=generator,
        )
        return [int(i) for i in _iterate(indices)]


def _iterate(loader: DataLoader) -> Iterator[Any]:
    yield from loader


def world(loader: DataLoader) -> tuple[int, int]:
    """(ranks, this rank) that ``loader``'s sampler deals out to; (1, 0) in one process."""
    batches = loader.batch_sampler
    for sampler in (batches, getattr(batches, "sampler", None)):
        if isinstance(sampler, (DistributedSampler, PlannedSampler)):
            return int(sampler.num_replicas), int(sampler.rank)
    return 1, 0


def world_problems(state: Any, loader: Any, world_size: int) -> list[str]:
    """Why the position of ``state.json`` (saved part way into an epoch by another number of
    processes) cannot resume on ``loader`` (an ``EpochLoader``, None for a manual loop) with
    ``world_size`` processes: only where the epoch's order can be rebuilt and dealt out anew.
    At an epoch's start there is nothing to carry over; checkpoints saved before the world
    size was recorded are not checked."""
    if not isinstance(state, dict):
        return []
    saved, position = state.get("world_size"), state.get("loader")
    whole = isinstance(saved, int) and not isinstance(saved, bool)
    if not whole or saved == world_size or not isinstance(position, list):
        return []
    if len(position) != 2 or not position[1]:
        return []
    why = "a manual loop's" if loader is None else problem(loader.loader, state.get("loader_order"))
    if why is None:
        return []
    return [
        f"it was saved by {saved} process(es) at epoch {position[0]}, batch {position[1]}, and "
        f"this run has {world_size}: the position cannot be carried over, as {why}; resume "
        f"with {saved} process(es) (torchrun --nproc-per-node {saved}), or from a checkpoint "
        "at the start of an epoch"
    ]


def carried_over_state(state: Any, loader: Any) -> bool:
    """Whether the position of ``state.json`` resumes on ``loader`` (an ``EpochLoader``) by
    being carried over from another number of ranks."""
    order = state.get("loader_order") if isinstance(state, dict) else None
    return loader is not None and carried_over(order, loader.loader)
