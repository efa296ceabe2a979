"""train(): a checkpointed run of a recipe that resumes exactly and reports its micro-batch."""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from torchturbo import TurboConfig
from torchturbo.config import ConfigError
from torchturbo.recipe import load_recipe
from torchturbo.reliability import preemption
from torchturbo.reliability.guard import NonFiniteError
from torchturbo.reliability.oom import MemoryBudgetError
from torchturbo.reliability.preemption import StopNow
from torchturbo.resume.files import CheckpointError, read_checkpoint
from torchturbo.runs.train import TrainInterrupted, train

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


def _signals_in_step(recipe, step: int, *signals: int, pause_s: float = 0.0):
    """The recipe, with ``signals`` sent to this process during the forward of micro-step
    ``step``, then ``pause_s`` spent in that forward (in short sleeps a handler can run between)."""
    calls = [0]

    def loss_fn(model, batch):
        calls[0] += 1
        if calls[0] == step:
            for signum in signals:
                os.kill(os.getpid(), signum)
            for _ in range(int(pause_s / 0.02)):
                time.sleep(0.02)
        return recipe.loss_fn(model, batch)

    return dataclasses.replace(recipe, loss_fn=loss_fn)


def _ctrl_c_in_step(recipe, step: int, times: int = 1):
    return _signals_in_step(recipe, step, *[signal.SIGINT] * times)


def _final_state(directory: Path, step: int) -> dict:
    files = read_checkpoint(directory / f"ckpt-{step:010d}")
    return {"model": files["model.pt"], "optimizer": files["optimizer.pt"]}


def assert_bit_equal(a, b) -> None:
    """Nested state dicts hold the same keys and bit-identical tensors."""
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_bit_equal(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_bit_equal(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2])
def test_a_stop_signal_finishes_the_step_saves_it_and_resuming_ends_bit_equal(tmp_path, signum):
    recipe = load_recipe(TINY)
    full = train(recipe, CONFIG, steps=10, checkpoint_dir=tmp_path / "full")
    handler = signal.getsignal(signum)
    with pytest.raises(TrainInterrupted) as caught:
        train(_signals_in_step(recipe, 4, signum), CONFIG, steps=10, checkpoint_dir=tmp_path)
    assert signal.getsignal(signum) is handler
    assert caught.value.optimizer_steps == 4 and caught.value.saved.name == "ckpt-0000000004"
    assert caught.value.signal_name == signal.Signals(signum).name
    rest = train(recipe, CONFIG, steps=10, checkpoint_dir=tmp_path, resume=True)
    assert rest.resumed_from == caught.value.saved
    assert rest.last_loss == full.last_loss  # the saved step was whole
    assert_bit_equal(_final_state(tmp_path, 10), _final_state(tmp_path / "full", 10))


def test_a_forwarded_repeat_of_the_signal_is_the_same_request(tmp_path):
    # torchrun's agent forwards to its workers the SIGTERM the scheduler sent the whole job.
    recipe = _signals_in_step(load_recipe(TINY), 4, signal.SIGTERM, signal.SIGTERM)
    with pytest.raises(TrainInterrupted) as caught:
        train(recipe, CONFIG, steps=10, checkpoint_dir=tmp_path)
    assert caught.value.optimizer_steps == 4


@pytest.mark.parametrize(
    "signals", [(signal.SIGTERM, signal.SIGINT), (signal.SIGINT, signal.SIGINT)], ids=str
)
def test_a_second_signal_stops_at_once_keeping_the_previous_checkpoint(
    tmp_path, monkeypatch, signals
):
    monkeypatch.setattr(preemption, "SAME_SIGNAL_S", 0.0)  # the repeat counts as a second one
    recipe = _signals_in_step(load_recipe(TINY), 4, *signals)
    with pytest.raises(StopNow, match="a second stop signal") as caught:
        train(recipe, CONFIG, steps=10, checkpoint_dir=tmp_path, save_every=2)
    assert caught.value.exit_status == 128 + signals[1]
    # Stopped inside step 4: its checkpoint never started; step 2's is whole and resumes.
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-0000000002"]
    assert train(load_recipe(TINY), CONFIG, steps=3, checkpoint_dir=tmp_path, resume=True)


def test_the_grace_period_running_out_stops_at_once(tmp_path):
    config = CONFIG.replace(reliability__stop_grace_s=0.1)
    recipe = _signals_in_step(load_recipe(TINY), 4, signal.SIGTERM, pause_s=3.0)
    with pytest.raises(StopNow, match=r"grace period of 0\.1 s ran out"):
        train(recipe, config, steps=10, checkpoint_dir=tmp_path)
    assert not list(tmp_path.iterdir())
    # Negative control: a grace period longer than the step lets it finish and save.
    recipe = _signals_in_step(load_recipe(TINY), 4, signal.SIGTERM, pause_s=0.3)
    with pytest.raises(TrainInterrupted):
        train(
            recipe,
            config.replace(reliability__stop_grace_s=60.0),
            steps=10,
            checkpoint_dir=tmp_path,
        )


def test_without_a_checkpoint_directory_ctrl_c_stops_at_once(tmp_path):
    with pytest.raises(KeyboardInterrupt) as caught:
        train(_ctrl_c_in_step(load_recipe(TINY), 4), CONFIG, steps=10)
    assert type(caught.value) is KeyboardInterrupt


def test_an_ignored_ctrl_c_is_left_ignored(tmp_path):
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as for a job started with &
    try:
        recipe = _ctrl_c_in_step(load_recipe(TINY), 2)
        result = train(recipe, CONFIG, steps=4, checkpoint_dir=tmp_path)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
    assert result.optimizer_steps == 4


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


def test_resuming_with_fewer_steps_than_the_checkpoint_is_refused(tmp_path):
    recipe = load_recipe(TINY)
    train(recipe, CONFIG, steps=4, checkpoint_dir=tmp_path)
    written = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    with pytest.raises(CheckpointError, match=r"step 2 \(--steps\).*already at step 4"):
        train(recipe, CONFIG, steps=2, checkpoint_dir=tmp_path, resume=True)
    # Negative control: as many steps as the checkpoint has trains nothing and rewrites nothing.
    result = train(recipe, CONFIG, steps=4, checkpoint_dir=tmp_path, resume=True)
    assert result.optimizer_steps == 4 and result.last_loss is None and result.saved is None
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == written


def test_more_accumulation_steps_than_an_epoch_has_batches_is_refused():
    recipe = load_recipe(TINY)  # 64 samples in batches of 8: 8 batches per epoch
    with pytest.raises(ConfigError, match="steps = 9 is more than the 8 batches of an epoch"):
        train(recipe, CONFIG.replace(accumulation__steps=9), steps=1)
    assert train(recipe, CONFIG.replace(accumulation__steps=8), steps=1).optimizer_steps == 1


def test_a_run_that_ends_on_non_finite_steps_raises_and_saves_nothing(tmp_path):
    recipe = load_recipe(str(Path(__file__).parent / "recipes" / "broken.py") + ":nan_inputs")
    with pytest.raises(NonFiniteError, match="ended with 2 non-finite optimizer step"):
        train(recipe, CONFIG, steps=2, checkpoint_dir=tmp_path)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"steps": 0}, "steps = 0 is invalid: expected an int >= 1"),
        ({"steps": 2**63}, "<= 2\\*\\*63 - 1"),
        ({"steps": True}, "steps = True is invalid"),
        ({"steps": 2, "save_every": -1}, "save_every = -1 is invalid"),
        ({"steps": 2, "resume": True}, "need a checkpoint directory"),
    ],
)
def test_arguments_no_run_can_use_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        train(load_recipe(TINY), CONFIG, **kwargs)


def test_a_checkpoint_directory_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is not a directory"):
        train(load_recipe(TINY), CONFIG, steps=1, checkpoint_dir=tmp_path / "file")
