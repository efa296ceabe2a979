"""Recipes over a stream (an IterableDataset: no len(), its own order) run in every command.

Streams are what Hugging Face ``IterableDataset`` and webdataset pipelines give; nothing may
assume a length or shuffle one, and the tuner must not hand a stream to several loader workers
(each would yield all of it).
"""

from __future__ import annotations

import itertools
import time

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from torchturbo.config import ConfigError, TurboConfig
from torchturbo.doctor import diagnose
from torchturbo.doctor.data_facts import dataset_facts
from torchturbo.recipe import Recipe
from torchturbo.runs.train import train
from torchturbo.trials.trial import fixed_batches
from torchturbo.tune.search.run import TuneOptions, tune

BATCH = 8


class Stream(IterableDataset):
    """``samples`` seeded samples of a learnable 4-class problem, ``delay_s`` to make each."""

    def __init__(self, samples: int, delay_s: float = 0.0) -> None:
        self.samples, self.delay_s = samples, delay_s

    def __iter__(self):
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(16, 4, generator=generator)
        for _ in range(self.samples):
            time.sleep(self.delay_s)
            x = torch.randn(16, generator=generator)
            yield x, (x @ weight).argmax()


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def stream_recipe(samples: int = 32, delay_s: float = 0.0) -> Recipe:
    return Recipe(
        name="stream",
        model=mlp,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        loss_fn=loss_fn,
        dataset=Stream(samples, delay_s),
        batch_size=BATCH,
    )


def test_the_fixed_batches_of_a_stream_are_its_first_batches_in_order():
    batches = fixed_batches(stream_recipe(), 3)
    expected = list(itertools.islice(DataLoader(Stream(32), batch_size=BATCH), 3))
    assert len(batches) == 3
    for got, want in zip(batches, expected, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_a_stream_without_a_full_batch_is_a_clear_error():
    with pytest.raises(ValueError, match=r"the dataset \(a stream\) holds no full batch of 8"):
        fixed_batches(stream_recipe(samples=5), 3)


def test_training_on_a_stream_over_several_epochs_computes_what_a_plain_loop_does():
    steps = 10  # 4 batches per pass: the stream is read again twice and a half
    result = train(stream_recipe(), TurboConfig(device="cpu"), steps=steps)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = itertools.islice(
        itertools.cycle(list(DataLoader(Stream(32), batch_size=BATCH))), steps
    )
    for batch in batches:
        loss = loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert result.optimizer_steps == steps
    assert result.last_loss == loss.item()


def test_more_accumulation_steps_than_a_stream_has_batches_is_refused_after_its_first_pass():
    config = TurboConfig(device="cpu").replace(accumulation__steps=8)  # the stream holds 4
    with pytest.raises(ConfigError, match=r"steps = 8 is more than the 4 batches of an epoch"):
        train(stream_recipe(), config, steps=3)


def test_training_on_an_empty_stream_is_a_clear_error():
    with pytest.raises(ValueError, match="the data loader yields no batch"):
        train(stream_recipe(samples=0), TurboConfig(device="cpu"), steps=2)


def test_the_doctor_describes_a_stream_without_a_length():
    facts = dataset_facts(Stream(32))
    assert facts.kind == "Stream" and facts.num_samples is None and facts.nbytes is None


def test_the_doctor_tells_an_input_bound_stream_to_split_itself(tmp_path):
    recipe = stream_recipe(samples=256, delay_s=0.002)  # 16 ms to load a batch, ~1 ms to train
    diagnosis = diagnose(recipe, device="cpu", trace_dir=tmp_path, profile_steps=3)
    loader = next(i for i in diagnosis.items if i.name == "DataLoader configuration")
    assert loader.state == "recommended" and "get_worker_info" in loader.evidence
    assert "tune measures worker counts" not in loader.evidence  # it does not, on a stream


def test_the_tuner_tries_no_worker_setting_on_a_stream():
    # 2 ms per sample makes loading slower than the step: a map-style dataset would get the grid
    # of worker settings here, and a stream that does not split itself would be read twice.
    recipe = stream_recipe(samples=256, delay_s=0.002)
    options = TuneOptions(time_budget_s=120, device="cpu", max_rounds=3, only=("data_loader",))
    config, result = tune(recipe, options)
    assert result.loader is not None and result.loader["verdict"] == "stream"
    assert "get_worker_info" in result.loader["reason"]
    assert config.data.num_workers == 0
