"""DataLoader building, nested batch transfer (data/loader.py) and measured loader tuning
(tune/loader/grid.py).

Worker processes take a fraction of a second to start, so the tuning tests use few candidates,
few batches and one or two repeats; each is bounded by a timeout.
"""

from __future__ import annotations

import time
from collections import OrderedDict, namedtuple
from dataclasses import dataclass

import psutil
import pytest
import torch
from torch.utils.data import BatchSampler, Dataset, SequentialSampler, TensorDataset

from torchturbo.base.device import to_device
from torchturbo.config import ConfigError, DataConfig
from torchturbo.data.loader import build_loader
from torchturbo.tune.loader.grid import (
    _choose,
    _Run,
    default_candidates,
    tune_loader,
    usable_cpus,
)

CPU = torch.device("cpu")
WORKERS = DataConfig(num_workers=2, persistent_workers=True, prefetch_factor=2)
# torch warns (an error here) when a loader has more workers than the machine has cores; these
# tests use 2 workers on purpose (sleeping samples overlap even on one core).
more_workers_than_cores = pytest.mark.filterwarnings(
    "ignore:This DataLoader will create:UserWarning"
)


class SlowDataset(Dataset):
    """Each sample sleeps 4 ms, like a decode waiting on I/O: workers overlap the waits."""

    def __len__(self) -> int:
        return 256

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        time.sleep(0.004)
        return torch.full((3, 4, 4), float(index)), index


def cheap_dataset() -> TensorDataset:
    return TensorDataset(torch.randn(512, 3, 8, 8), torch.arange(512))


# --- build_loader


@more_workers_than_cores
def test_build_loader_passes_worker_settings_only_with_workers():
    dataset = cheap_dataset()
    config = DataConfig(num_workers=2, persistent_workers=True, prefetch_factor=3)
    loader = build_loader(dataset, batch_size=8, config=config, device=CPU)
    assert (loader.num_workers, loader.prefetch_factor, loader.persistent_workers) == (2, 3, True)
    plain = build_loader(dataset, batch_size=8, config=DataConfig(), device=CPU)
    assert (plain.num_workers, plain.prefetch_factor, plain.persistent_workers) == (0, None, False)


def test_build_loader_pins_only_for_cuda():
    pinned = DataConfig(pin_memory=True)
    on_cpu = build_loader(cheap_dataset(), batch_size=8, config=pinned, device="cpu")
    assert on_cpu.pin_memory is False
    assert not next(iter(on_cpu))[0].is_pinned()
    # Building (not iterating) needs no GPU: the flag reaches the loader for a CUDA device.
    on_cuda = build_loader(cheap_dataset(), batch_size=8, config=pinned, device="cuda")
    assert on_cuda.pin_memory is True


def test_build_loader_seed_fixes_the_order():
    def order(seed: int) -> list[int]:
        loader = build_loader(
            cheap_dataset(), batch_size=64, config=DataConfig(), device=CPU, seed=seed
        )
        return torch.cat([labels for _, labels in loader]).tolist()

    assert order(1) == order(1)
    assert order(1) != order(2)  # negative control: the seed does change the order
    assert sorted(order(1)) == list(range(512))


def test_build_loader_batch_sampler_owns_batches():
    dataset = cheap_dataset()
    sampler = BatchSampler(SequentialSampler(dataset), batch_size=5, drop_last=False)
    loader = build_loader(dataset, config=DataConfig(), device=CPU, batch_sampler=sampler)
    first_labels = next(iter(loader))[1]
    assert first_labels.tolist() == [0, 1, 2, 3, 4]  # shuffle=True (the default) is ignored
    with pytest.raises(ValueError, match="batch_size=5"):
        build_loader(dataset, batch_size=5, config=DataConfig(), device=CPU, batch_sampler=sampler)
    with pytest.raises(ValueError, match="batch_size=None"):
        build_loader(dataset, config=DataConfig(), device=CPU)


# --- to_device

Pair = namedtuple("Pair", "image label")


@dataclass
class Sample:
    image: torch.Tensor
    name: str


def test_to_device_moves_nested_structures_and_keeps_types():
    batch = {
        "pair": Pair(torch.randn(2, 3, 4, 4), torch.tensor([1, 2])),
        "list": [torch.ones(3), (torch.zeros(2), "text", 7)],
        "sample": Sample(torch.randn(2, 3, 4, 4), "a"),
        "ordered": OrderedDict(x=torch.ones(1)),
    }
    # The meta device proves a move on a CPU-only machine: every tensor must land there.
    moved = to_device(batch, "meta", non_blocking=True)
    assert isinstance(moved["pair"], Pair) and moved["pair"].label.device.type == "meta"
    assert moved["list"][0].is_meta and moved["list"][1][0].is_meta
    assert moved["list"][1][1:] == ("text", 7)
    assert isinstance(moved["sample"], Sample) and moved["sample"].image.is_meta
    assert moved["sample"].name == "a"
    assert type(moved["ordered"]) is OrderedDict and moved["ordered"]["x"].is_meta
    assert batch["pair"].image.device == CPU  # the input is not modified


def test_to_device_channels_last_only_for_4d_float():
    images = torch.randn(2, 3, 5, 5)
    masks = torch.randint(0, 2, (2, 3, 5, 5))
    volume = torch.randn(3, 5, 5)
    moved = to_device((images, masks, volume), CPU, non_blocking=False, channels_last=True)
    assert moved[0].is_contiguous(memory_format=torch.channels_last)
    assert not moved[0].is_contiguous()  # it really is NHWC, not a tensor ambiguous in both
    assert torch.equal(moved[0], images)
    assert moved[1].dtype == torch.int64 and moved[1].is_contiguous()
    assert not moved[1].is_contiguous(memory_format=torch.channels_last)
    assert moved[2].is_contiguous()
    unchanged = to_device(images, CPU, non_blocking=False)  # negative control: flag off
    assert not unchanged.is_contiguous(memory_format=torch.channels_last)


# --- tune_loader


def test_default_candidates_stay_within_the_cores():
    grid = default_candidates("cpu")
    assert DataConfig() in grid
    assert max(c.num_workers for c in grid) == usable_cpus()
    assert not any(c.pin_memory for c in grid)
    assert all(c.persistent_workers and c.prefetch_factor in (2, 4) for c in grid if c.num_workers)
    assert all(c.pin_memory for c in default_candidates("cuda"))


@more_workers_than_cores
@pytest.mark.timeout(120)
def test_tune_loader_picks_workers_for_a_slow_dataset_and_cleans_up():
    me = psutil.Process()
    children_before = {p.pid for p in me.children(recursive=True)}
    # Explicit candidates: the same on every machine, and short on many-core ones.
    one = DataConfig(num_workers=1, persistent_workers=True, prefetch_factor=2)
    candidates = [DataConfig(), one, WORKERS]
    tuning = tune_loader(
        SlowDataset(),
        4,
        device=CPU,
        candidates=candidates,
        batches=6,
        warmup_batches=1,
        repeats=2,
        step_seconds=1.0,
    )
    assert tuning.chosen.num_workers > 0, tuning.reason
    zero = next(t for t in tuning.results if t.config == DataConfig())
    # Sleeping samples overlap across workers: the chosen setting must beat the serial loader.
    assert tuning.chosen_trial.batches_per_s > 1.3 * zero.batches_per_s, tuning.reason
    assert tuning.chosen_trial.startup_s > 0 and tuning.chosen_trial.worker_rss_bytes > 0
    assert tuning.input_bound is False and "Compute-bound" in tuning.reason
    assert {t.config for t in tuning.results} == set(candidates)
    leftover = {p.pid for p in me.children(recursive=True)} - children_before
    assert not leftover  # every measured loader's workers have exited


@more_workers_than_cores
@pytest.mark.timeout(60)
def test_tune_loader_cheap_dataset_gives_a_valid_choice_and_reason():
    candidates = [DataConfig(), WORKERS]
    tuning = tune_loader(
        cheap_dataset(),
        16,
        device=CPU,
        candidates=candidates,
        batches=5,
        warmup_batches=1,
        repeats=1,
        step_seconds=1e-9,
    )
    assert tuning.chosen in candidates
    assert tuning.reason.startswith("Chose ")
    assert [t.verdict for t in tuning.results].count("chosen") == 1
    assert tuning.input_bound is True  # nothing loads a batch in a nanosecond


def test_tune_loader_rejects_invalid_candidates_with_clear_messages():
    with pytest.raises(ConfigError, match="persistent_workers = true needs num_workers > 0"):
        tune_loader(
            cheap_dataset(),
            8,
            device=CPU,
            candidates=[{"num_workers": 0, "persistent_workers": True}],
        )
    with pytest.raises(ConfigError, match="candidate #1"):
        tune_loader(cheap_dataset(), 8, device=CPU, candidates=[DataConfig(), {"workers": 2}])
    with pytest.raises(ConfigError, match="repeated"):
        tune_loader(cheap_dataset(), 8, device=CPU, candidates=[DataConfig(), DataConfig()])
    with pytest.raises(ValueError, match="batches=0"):
        tune_loader(cheap_dataset(), 8, device=CPU, batches=0)


@pytest.mark.timeout(60)
def test_tune_loader_memory_limit_rejects_worker_settings():
    more = DataConfig(num_workers=2, persistent_workers=True, prefetch_factor=4)
    one = DataConfig(num_workers=1, persistent_workers=True, prefetch_factor=2)
    tuning = tune_loader(
        SlowDataset(),
        4,
        device=CPU,
        candidates=[DataConfig(), one, more],
        batches=3,
        warmup_batches=1,
        repeats=1,
        memory_limit_bytes=2**20,  # 1 MiB: less than any worker process needs
    )
    assert tuning.chosen == DataConfig()  # the only setting that copies nothing
    verdicts = {t.config: t for t in tuning.results}
    assert verdicts[one].verdict == "rejected" and "exceeds the 1 MiB limit" in verdicts[one].reason
    # Measured with one worker, two are predicted over the limit and never started.
    assert verdicts[more].reason.startswith("not started") and verdicts[more].batches_per_s is None
    assert "rejected for memory" in tuning.reason
    with pytest.raises(ValueError, match="every candidate was rejected"):
        tune_loader(
            SlowDataset(), 4, device=CPU, candidates=[one], batches=2, memory_limit_bytes=2**20
        )


def test_choice_prefers_fewer_workers_within_the_tolerance():
    # The decision alone, on fixed rates: measured rates would make the test flaky by design.
    one = DataConfig(num_workers=1, persistent_workers=True, prefetch_factor=2)
    configs = [DataConfig(), one, WORKERS]
    runs = {
        config: [
            _Run(
                batches_per_s=rate,
                startup_s=0.1,
                worker_bytes=0,
                projected_worker_bytes=0,
                batch_bytes=0,
            )
        ]
        for config, rate in zip(configs, (50.0, 97.0, 100.0), strict=True)
    }
    near = _choose(configs, runs, {}, 0.05, None, CPU, 2**30)
    assert near.chosen == one and "within 5% of the fastest" in near.reason
    exact = _choose(configs, runs, {}, 0.0, None, CPU, 2**30)  # negative control: no tolerance
    assert exact.chosen == WORKERS and "the fastest" in exact.reason
