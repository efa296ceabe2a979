"""A resume onto other data than the checkpoint's: exact, or refused in one line, never silent.

A checkpoint's loader position counts batches of the data it was saved with. Mid-epoch, on a
dataset grown, shrunk or reordered, or under another batch plan, continuing would skip some
samples and train others twice: refused, naming what changed and ``next_epoch``. At an epoch's
start nothing is counted yet: the resume goes on (with a warning), each sample once per epoch.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from torchturbo import Recipe, TurboConfig
from torchturbo.resume.checks import data_problems
from torchturbo.resume.files import CheckpointError
from torchturbo.runs.train import train

CONFIG = TurboConfig(device="cpu")
BATCH = 4


class Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(32, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(input_ids).mean(dim=1)).squeeze(-1)


def _recipe(samples: int, trained: list[int], *, reverse: bool = False) -> Recipe:
    """``samples`` token rows of lengths 3-9, each with its ``id``; every id trained is appended
    to ``trained``."""
    lengths = [3 + (i * 5) % 7 for i in range(samples)]
    rows = [
        {"input_ids": torch.arange(n) % 32, "id": torch.tensor(i)} for i, n in enumerate(lengths)
    ]
    if reverse:
        rows, lengths = rows[::-1], lengths[::-1]

    def loss_fn(model: nn.Module, batch: dict) -> torch.Tensor:
        trained.extend(int(i) for i in batch["id"])
        return model(batch["input_ids"]).pow(2).mean()

    return Recipe(
        name="rows",
        model=Bag,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.01),
        loss_fn=loss_fn,
        dataset=rows,
        batch_size=BATCH,
        lengths=lengths,
        seed=3,
    )


def _saved_mid_epoch(tmp_path: Path, samples: int = 24, config: TurboConfig = CONFIG) -> Path:
    """A run of ``samples`` rows (6 batches an epoch) saved after 3 batches of its first epoch."""
    train(_recipe(samples, []), config, steps=3, checkpoint_dir=tmp_path, save_every=3)
    return tmp_path


@pytest.mark.parametrize(
    ("changed", "said"),
    [
        ({"samples": 28}, "the dataset has 28 samples, the checkpoint's had 24"),
        ({"samples": 20}, "the dataset has 20 samples, the checkpoint's had 24"),
        ({"reverse": True}, "the samples' lengths differ in order"),
        ({"config": CONFIG.replace(data__batches="buckets")}, "the batches are planned by"),
    ],
    ids=["grown", "shrunk", "reordered", "bucketed"],
)
def test_a_mid_epoch_resume_onto_changed_data_is_refused_naming_what_changed(
    tmp_path, changed, said
):
    directory = _saved_mid_epoch(tmp_path)
    trained: list[int] = []
    recipe = _recipe(changed.get("samples", 24), trained, reverse=changed.get("reverse", False))
    config = changed.get("config", CONFIG)
    with pytest.raises(CheckpointError) as refused:
        train(recipe, config, steps=6, checkpoint_dir=directory, resume=True)
    message = str(refused.value)
    assert said in message and "epoch 0, 3 batches in" in message
    assert "resume with --next-epoch (Turbo.load(..., next_epoch=True))" in message
    assert trained == []  # refused before the first step


def test_next_epoch_trains_every_sample_of_the_changed_data_once(tmp_path):
    directory = _saved_mid_epoch(tmp_path)
    trained: list[int] = []
    grown = _recipe(28, trained)
    result = train(
        grown, CONFIG, steps=3 + 7, checkpoint_dir=directory, resume=True, next_epoch=True
    )
    assert result.optimizer_steps == 10
    assert sorted(trained) == list(range(28))  # epoch 1 of the grown data: each sample once


def test_an_unchanged_resume_continues_the_epoch_exactly(tmp_path):
    """The control: the same data resumes mid-epoch, and the epoch's samples are each trained
    once across the two runs."""
    first: list[int] = []
    train(_recipe(24, first), CONFIG, steps=3, checkpoint_dir=tmp_path, save_every=3)
    rest: list[int] = []
    train(_recipe(24, rest), CONFIG, steps=6, checkpoint_dir=tmp_path, resume=True)
    assert sorted(first + rest) == list(range(24))


def test_a_resume_at_an_epochs_start_onto_changed_data_goes_on_and_says_so(tmp_path):
    train(_recipe(24, []), CONFIG, steps=6, checkpoint_dir=tmp_path, save_every=6)
    trained: list[int] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(_recipe(28, trained), CONFIG, steps=13, checkpoint_dir=tmp_path, resume=True)
    said = [str(w.message) for w in caught if "onto changed data" in str(w.message)]
    assert said and "the next epoch trains the current data" in said[0]
    assert sorted(trained) == list(range(28))


def test_next_epoch_needs_resume(tmp_path):
    with pytest.raises(ValueError, match=r"next_epoch .* needs resume=True"):
        train(_recipe(24, []), CONFIG, steps=3, checkpoint_dir=tmp_path, next_epoch=True)


def test_a_checkpoint_without_a_data_record_is_not_refused():
    """Checkpoints of an earlier torchturbo record no data: nothing to compare, no refusal."""
    identity = {"samples": 28, "lengths": "0123", "plan": "BatchSampler"}
    older = {"loader": [0, 3]}
    assert data_problems(older, identity) == []
    recorded = {**older, "data": {**identity, "samples": 24}}
    assert "the dataset has 28 samples" in data_problems(recorded, identity)[0]


def test_the_cli_asks_for_resume_with_next_epoch(tmp_path, capsys):
    from torchturbo.cli import main

    tiny = str(Path(__file__).parent / "recipes" / "tiny.py") + ":recipe"
    argv = ["train", tiny, "--device", "cpu", "--steps", "2", "--next-epoch"]
    assert main([*argv, "--checkpoint-dir", str(tmp_path)]) == 2
    assert "--next-epoch starts the epoch after a checkpoint's: give --resume too" in (
        capsys.readouterr().err
    )


def _with_a_float64_sample(odd: int, fixed: bool = False) -> Recipe:
    generator = torch.Generator().manual_seed(0)
    rows = []
    for i in range(24):
        x = torch.randn(8, generator=generator)
        rows.append((x.double() if i == odd and not fixed else x, (x.sum() > 0).long()))
    return Recipe(
        name="f64",
        model=lambda: nn.Linear(8, 2),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        loss_fn=lambda model, batch: nn.functional.cross_entropy(model(batch[0]), batch[1]),
        dataset=rows,
        batch_size=BATCH,
        seed=3,
    )


def test_a_sample_of_another_dtype_names_its_index_and_step_and_the_steps_trained_are_kept(
    tmp_path,
):
    from torchturbo.data.collate import SampleDtypeError

    # Sample 17 is in the seeded shuffle's 3rd batch: two steps train before it.
    with pytest.raises(SampleDtypeError) as bad:
        train(_with_a_float64_sample(17), CONFIG, steps=6, checkpoint_dir=tmp_path)
    message = str(bad.value)
    assert message.startswith("dataset sample 17 (epoch 0, ")
    assert "is float64 where the other samples of its batch hold float32" in message
    saved = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt-"))
    assert "(at optimizer step 3); the last optimizer step is saved in " in message
    assert saved == ["ckpt-0000000002"] and message.endswith("fix the sample and --resume")
    fixed = _with_a_float64_sample(17, fixed=True)
    result = train(fixed, CONFIG, steps=6, checkpoint_dir=tmp_path, resume=True)
    assert result.optimizer_steps == 6
