"""train(): a checkpointed run of a recipe that resumes exactly and reports its micro-batch."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchturbo import TurboConfig
from torchturbo.checkpoint import CheckpointError
from torchturbo.oom import MemoryBudgetError
from torchturbo.recipe import load_recipe
from torchturbo.train import train

TINY = str(Path(__file__).parent / "recipes" / "tiny.py") + ":recipe"
CONFIG = TurboConfig(device="cpu")


def test_resumed_run_ends_where_the_uninterrupted_one_does(tmp_path):
    recipe = load_recipe(TINY)
    full = train(recipe, CONFIG, steps=10)
    first = train(recipe, CONFIG, steps=6, checkpoint_dir=tmp_path, save_every=4)
    assert first.saved is not None and first.saved.name == "ckpt-0000000006"
    rest = train(recipe, CONFIG, steps=10, checkpoint_dir=tmp_path, resume=True)
    assert rest.resumed_from == first.saved and rest.optimizer_steps == 10
    assert rest.last_loss == full.last_loss  # bit-identical training gives the same float


def test_a_budget_below_the_default_micro_batch_completes_and_reports_it():
    recipe = load_recipe(TINY)
    events: list[str] = []
    # This model keeps ~36 kB per sample for backward: 60 kB holds one, not a batch of 8.
    config = CONFIG.replace(reliability__memory_budget_bytes=60_000)
    result = train(recipe, config, steps=3, on_event=events.append)
    assert result.optimizer_steps == 3 and result.last_loss is not None
    assert result.micro_batch_split > 1 and result.micro_batch_size < recipe.batch_size
    assert events and "micro-batch 8 -> 4" in events[0]


def test_a_budget_that_cannot_hold_one_sample_is_a_clear_error():
    config = CONFIG.replace(reliability__memory_budget_bytes=1000)
    with pytest.raises(MemoryBudgetError, match="cannot hold one sample"):
        train(load_recipe(TINY), config, steps=1)


def test_resume_without_a_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="holds no checkpoint"):
        train(load_recipe(TINY), CONFIG, steps=2, checkpoint_dir=tmp_path, resume=True)
