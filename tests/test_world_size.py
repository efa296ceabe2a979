"""A resume on another number of ranks: the epoch's samples trained once each, or a refusal.

The loaders are built as the engine builds them (a shuffled DataLoader with its generator in one
process, a BatchSampler over a DistributedSampler per rank, the bucketing sampler per rank), each
rank in this process: a sampler needs no process group. What must hold: the samples the first
world trained and those the second deals out after the resume are the epoch's samples, each
once (padding aside), and a save inside a carried-over epoch resumes exactly.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset

from torchturbo.data.bucketing import BucketBatchSampler
from torchturbo.reliability import remap
from torchturbo.reliability.epochs import EpochLoader, LoaderPosition
from torchturbo.reliability.remap import world_problems
from torchturbo.resume.files import CheckpointError

N, BATCH = 50, 4
DATA = TensorDataset(torch.arange(N))
LENGTHS = [1 + (i * 7) % 13 for i in range(N)]


def _loaders(world: int, kind: str = "indices") -> list[EpochLoader]:
    """One engine-style loader per rank of ``world``."""
    if kind == "plan":
        return [
            EpochLoader(
                DataLoader(
                    DATA,
                    batch_sampler=BucketBatchSampler(
                        LENGTHS, max_tokens=30, seed=3, num_replicas=world, rank=rank
                    ),
                )
            )
            for rank in range(world)
        ]
    if world == 1:
        generator = torch.Generator().manual_seed(5)
        return [EpochLoader(DataLoader(DATA, batch_size=BATCH, shuffle=True, generator=generator))]
    loaders = []
    for rank in range(world):
        sampler = DistributedSampler(DATA, num_replicas=world, rank=rank, shuffle=True, seed=5)
        batches = BatchSampler(sampler, BATCH, drop_last=False)
        loaders.append(
            EpochLoader(DataLoader(DATA, batch_sampler=batches, generator=torch.Generator()))
        )
    return loaders


def _train(loaders: list[EpochLoader], batches: int | None) -> tuple[list[int], list]:
    """The samples the ranks take in ``batches`` steps (the whole epoch: None), and each rank's
    position after them."""
    seen: list[int] = []
    iterators = [iter(loader) for loader in loaders]
    steps = 0
    while batches is None or steps < batches:
        taken = [next(it, None) for it in iterators]
        if any(t is None for t in taken):
            assert all(t is None for t in taken), "the ranks' batch counts differ"
            break
        for (indices,) in taken:
            seen += indices.tolist()
        steps += 1
    return seen, [loader.position() for loader in loaders]


def _resumed(loaders: list[EpochLoader], position: LoaderPosition) -> list[EpochLoader]:
    for loader in loaders:
        # Every new rank gets rank 0's position when it had none (the checkpoint's fallback).
        loader.resume(position)
    return loaders


@pytest.mark.parametrize(
    ("before", "after", "kind"),
    [(1, 2, "indices"), (2, 1, "indices"), (2, 3, "indices"), (3, 2, "indices"), (2, 1, "plan")],
)
def test_the_epoch_resumed_on_another_world_trains_every_sample_once(before, after, kind):
    trained, positions = _train(_loaders(before, kind), batches=3)
    assert positions[0].order["consumed"] > 0
    rest, _ = _train(_resumed(_loaders(after, kind), positions[0]), batches=None)
    counts = collections.Counter(trained + rest)
    assert set(counts) == set(range(N))  # nothing skipped
    repeats = sum(counts.values()) - N
    # Repeats are only the padding that deals the epoch out evenly: under world w, fewer than
    # w units of it per dealing (a unit is a sample, or a batch of the bucketing plan).
    most = (before + after) * (max(len(b) for b in _plan_batches()) if kind == "plan" else 1)
    assert repeats < most, counts


def _plan_batches() -> list[list[int]]:
    return BucketBatchSampler(LENGTHS, max_tokens=30, seed=3).global_batches()


def test_negative_control_the_per_rank_count_reused_skips_samples():
    """The position read as per-rank batches, as before: resumed on 2 ranks after 3 batches of
    one, it skips 3 batches of each rank, and samples the first world never trained are lost."""
    trained, positions = _train(_loaders(1), batches=3)
    position = positions[0]
    position.order = None  # no global order: the old, per-rank skip
    rest, _ = _train(_resumed(_loaders(2), position), batches=None)
    assert set(trained + rest) != set(range(N))


def test_a_save_inside_a_carried_over_epoch_resumes_exactly():
    _, positions = _train(_loaders(1), batches=3)
    carried = _resumed(_loaders(2), positions[0])
    whole, _ = _train(carried, batches=None)
    half, inner = _train(_resumed(_loaders(2), positions[0]), batches=2)
    assert inner[0].order["remapped"] and inner[0].order["world_size"] == 1
    assert inner[0].order["consumed"] == 3 * BATCH + 2 * BATCH * 2
    rest, _ = _train(_resumed(_loaders(2), inner[0]), batches=None)
    assert half + rest == whole  # the same batches, in the same order, as without the save


def test_the_next_epoch_is_the_new_worlds_own():
    _, positions = _train(_loaders(1), batches=3)
    carried = _resumed(_loaders(2), positions[0])
    _train(carried, batches=None)
    second, _ = _train(carried, batches=None)
    fresh = _loaders(2)
    _train(fresh, batches=None)
    assert second == _train(fresh, batches=None)[0]


def test_the_order_a_shuffled_loader_drew_is_rebuilt():
    loader = _loaders(1)[0]
    start = loader.position()
    drawn = [i for (batch,) in loader for i in batch.tolist()]
    rebuilt = remap.remainder_batches(
        loader.loader, start.order, 0, start.generator_state, start.torch_state
    )
    assert [i for batch in rebuilt for i in batch] == drawn


def _state(world: int, position: LoaderPosition) -> dict:
    return {
        "world_size": world,
        "loader": [position.epoch, position.batches],
        "loader_order": position.order,
    }


def test_a_loader_whose_order_cannot_be_rebuilt_is_refused_naming_both_worlds():
    class Shuffled(torch.utils.data.Sampler):
        def __iter__(self):
            return iter(torch.randperm(N).tolist())

        def __len__(self):
            return N

    custom = EpochLoader(DataLoader(DATA, batch_size=BATCH, sampler=Shuffled()))
    _, positions = _train([custom], batches=3)
    assert positions[0].order is None
    (problem,) = world_problems(_state(1, positions[0]), custom, world_size=2)
    assert problem.startswith(
        "it was saved by 1 process(es) at epoch 0, batch 3, and this run has 2: the position "
        "cannot be carried over, as its loader's order cannot be rebuilt"
    )
    assert "torchrun --nproc-per-node 1" in problem
    # The controls: the same world, or an epoch's start, need no carrying over.
    assert world_problems(_state(2, positions[0]), custom, world_size=2) == []
    start = LoaderPosition(1, 0, None, torch.get_rng_state())
    assert world_problems(_state(1, start), custom, world_size=2) == []
    assert issubclass(CheckpointError, ValueError)


def test_a_dataset_of_another_size_is_refused():
    _, positions = _train(_loaders(1), batches=3)
    smaller = EpochLoader(DataLoader(TensorDataset(torch.arange(N - 1)), batch_size=BATCH))
    (problem,) = world_problems(_state(1, positions[0]), smaller, world_size=2)
    assert f"its epoch has {N} samples, this run's {N - 1}" in problem


@pytest.mark.slow
def test_train_resumed_under_torchrun_from_one_process_carries_the_epoch_over(tmp_path):
    tiny = str(Path(__file__).parent / "recipes" / "tiny.py") + ":recipe"
    command = ["-m", "torchturbo", "train", tiny, "--device", "cpu", "--checkpoint-dir", tmp_path]
    env = os.environ | {"OMP_NUM_THREADS": "1"}

    def run(*launcher: str, steps: int, resume: bool) -> subprocess.CompletedProcess:
        argv = [*launcher, *command, "--steps", str(steps), *(["--resume"] if resume else [])]
        return subprocess.run(
            [str(a) for a in argv], capture_output=True, text=True, env=env, timeout=300
        )

    first = run(sys.executable, steps=3, resume=False)  # 3 of the epoch's 8 batches
    assert first.returncode == 0, first.stderr[-3000:]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    resumed = run(*torchrun, "--nproc-per-node", "2", steps=6, resume=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (
        "data: epoch 0, 3 batches in on 1 rank(s): the 24 samples all ranks trained of it "
        "carried over to 2 rank(s)" in resumed.stdout
    ), resumed.stdout
