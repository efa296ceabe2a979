"""Turbo.save / Turbo.load: exact resume, atomic checksummed files, fallback, safe loading.

Exact means bit-identical: the model has dropout (so the RNG state matters), the loader shuffles
(so the sampler position and its random state matter), Adam and a StepLR carry state, and
accumulation windows span epoch boundaries. A resume that missed any of these would diverge.
"""

from __future__ import annotations

import argparse
import errno
import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import edit_checkpoint_json
from torch import nn

from torchturbo import Turbo, TurboConfig
from torchturbo.reliability.epochs import LoaderPosition
from torchturbo.resume import files as checkpoint
from torchturbo.resume.files import (
    MANIFEST,
    CheckpointError,
    list_checkpoints,
    read_checkpoint,
    write_checkpoint,
)

TOTAL_STEPS = 9  # optimizer steps of 2-batch windows: more than two epochs of both datasets
CONFIG = TurboConfig(device="cpu").replace(accumulation__steps=2)
BUCKETED = CONFIG.replace(data__batches="buckets", data__max_tokens=96)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.drop = nn.Dropout(0.3)
        self.head = nn.Linear(8, 5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.embed(tokens)))


def _dense_loss(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def _token_loss(model, batch):
    logits = model(batch["tokens"])
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
    return loss, batch["mask"].sum()


def _workload(kind: str, init_seed: int):
    """(turbo, model, optimizer, scheduler, loader, loss_fn), with weights from ``init_seed``."""
    data_generator = torch.Generator().manual_seed(0)
    torch.manual_seed(init_seed)
    if kind == "shuffled":
        model = Net()
        dataset = torch.utils.data.TensorDataset(
            torch.randn(27, 8, generator=data_generator),
            torch.randint(0, 3, (27,), generator=data_generator),
        )
        config, loss_fn, extra = CONFIG, _dense_loss, {"batch_size": 4}
    else:
        model = Tagger()
        lengths = [int(n) for n in torch.randint(2, 20, (40,), generator=data_generator)]
        dataset = [
            {
                "tokens": torch.randint(0, 32, (n,), generator=data_generator),
                "labels": torch.randint(0, 5, (n,), generator=data_generator),
            }
            for n in lengths
        ]
        config, loss_fn, extra = BUCKETED, _token_loss, {"lengths": lengths}
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    turbo = Turbo(config)
    model, optimizer, loader = turbo.setup(model, optimizer, dataset, seed=7, **extra)
    return turbo, model, optimizer, scheduler, loader, loss_fn


def _train(turbo, scheduler, loader, loss_fn, *, save_to=None, save_at=(), stop_after=None):
    """Train to TOTAL_STEPS optimizer steps; returns the losses of the batches trained.

    After each save, ``turbo.saved_after`` is the number of batches trained so far.
    """
    losses = []
    while turbo.optimizer_steps < TOTAL_STEPS:
        for batch in loader:
            metrics = turbo.step(loss_fn, batch)
            losses.append(metrics.loss.item())
            if stop_after is not None and len(losses) == stop_after:
                return losses  # "killed": possibly inside an accumulation window
            if metrics.optimizer_stepped:
                scheduler.step()
                if turbo.optimizer_steps in save_at:
                    turbo.save(save_to, scheduler=scheduler)
                    turbo.saved_after = len(losses)
                if turbo.optimizer_steps == TOTAL_STEPS:
                    break
    return losses


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _uninterrupted(kind):
    turbo, model, _opt, scheduler, loader, loss_fn = _workload(kind, init_seed=0)
    losses = _train(turbo, scheduler, loader, loss_fn)
    return losses, _params(model)


def _resumed(kind, tmp_path, *, save_at, stop_after, restart_epoch=False):
    """Train, save, stop; then resume in a fresh engine. Returns (before, after, params, saved)."""
    turbo, _model, _opt, scheduler, loader, loss_fn = _workload(kind, init_seed=0)
    first = _train(
        turbo, scheduler, loader, loss_fn, save_to=tmp_path, save_at=save_at, stop_after=stop_after
    )
    saved_after = turbo.saved_after
    # A new process would start from other weights and other random states.
    torch.manual_seed(1234)
    random.seed(5)
    np.random.seed(5)
    turbo, model, _opt, scheduler, loader, loss_fn = _workload(kind, init_seed=99)
    path = turbo.load(tmp_path, scheduler=scheduler)
    if restart_epoch:  # a resume that does not keep the sampler position: the epoch restarts
        loader.resume(LoaderPosition(0, 0, None, torch.get_rng_state()))
    rest = _train(turbo, scheduler, loader, loss_fn)
    return first[:saved_after], rest, _params(model), read_checkpoint(path)["state.json"]


@pytest.mark.parametrize("kind", ["shuffled", "bucketed"])
def test_resume_mid_epoch_and_mid_window_is_bit_identical(kind, tmp_path):
    expected_losses, expected = _uninterrupted(kind)
    # Killed one batch into a window (batch 12); the last checkpoint, at optimizer step 5, is
    # mid-epoch; the window that was cut is re-trained from its first batch.
    before, after, actual, state = _resumed(kind, tmp_path, save_at=(4, 5), stop_after=12)
    _epoch, batches = state["loader"]
    assert batches > 0, "the save point must lie inside an epoch"
    assert len(before) < 12  # batches trained after the save were lost with the process
    assert all(torch.equal(a, e) for a, e in zip(actual, expected, strict=True))
    # The loss trajectory after the resume point is the uninterrupted one, bit for bit.
    assert before + after == expected_losses


def test_negative_control_restarting_the_epoch_diverges(tmp_path):
    _, expected = _uninterrupted("shuffled")
    _, _, actual, _ = _resumed(
        "shuffled", tmp_path, save_at=(5,), stop_after=12, restart_epoch=True
    )
    assert not all(torch.equal(a, e) for a, e in zip(actual, expected, strict=True))


def test_save_inside_an_accumulation_window_is_refused(tmp_path):
    turbo, _model, _opt, _sched, loader, loss_fn = _workload("shuffled", init_seed=0)
    metrics = turbo.step(loss_fn, next(iter(loader)))
    assert not metrics.optimizer_stepped
    with pytest.raises(CheckpointError, match="inside an accumulation window"):
        turbo.save(tmp_path)


def test_keeps_the_last_k_and_leaves_no_temporaries(tmp_path):
    turbo, _model, _opt, scheduler, loader, loss_fn = _workload("shuffled", init_seed=0)
    turbo.config = turbo.config.replace(reliability__keep_last=2)
    _train(turbo, scheduler, loader, loss_fn, save_to=tmp_path, save_at=(1, 2, 3, 4))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-0000000003", "ckpt-0000000004"]


def _train_and_save_two(tmp_path):
    turbo, _model, _opt, scheduler, loader, loss_fn = _workload("shuffled", init_seed=0)
    _train(turbo, scheduler, loader, loss_fn, save_to=tmp_path, save_at=(2, 3))
    return turbo


def test_truncated_latest_checkpoint_falls_back_to_the_previous_with_a_warning(tmp_path):
    _train_and_save_two(tmp_path)
    model_file = tmp_path / "ckpt-0000000003" / "model.pt"
    model_file.write_bytes(model_file.read_bytes()[:100])
    turbo, *_ = _workload("shuffled", init_seed=0)
    with pytest.warns(RuntimeWarning, match=r"model\.pt fails its checksum.*falling back to "):
        path = turbo.load(tmp_path)
    assert path.name == "ckpt-0000000002" and turbo.optimizer_steps == 2


def test_a_modified_byte_fails_the_checksum(tmp_path):
    _train_and_save_two(tmp_path)
    target = tmp_path / "ckpt-0000000003" / "optimizer.pt"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"optimizer\.pt fails its checksum"):
        read_checkpoint(tmp_path / "ckpt-0000000003")
    assert read_checkpoint(tmp_path / "ckpt-0000000002")  # the intact one still reads


def test_a_pickled_callable_is_refused_even_with_a_valid_checksum(tmp_path):
    # The manifest is honest here: the checksum cannot protect against a malicious writer,
    # torch.load(weights_only=True) does.
    path = write_checkpoint(tmp_path, 1, {"model.pt": {"hook": os.system}}, keep_last=1)
    with pytest.raises(CheckpointError, match="weights_only"):
        read_checkpoint(path)


SAVED_BY_TWO = [
    "model.pt", "optimizer.pt", "state.json", "config.toml", "replicas.json",
    "rng.pt", "random.json", "rng.rank1.pt", "random.rank1.json",
]  # fmt: skip
SHARDED_BY_TWO = ["state.json", "rng.pt", "rng.rank1.pt", "shards/.metadata"] + [
    f"shards/__{rank}_0.distcp" for rank in range(4)
]


@pytest.mark.parametrize(
    ("rank", "world", "names", "reads"),
    [
        (0, 2, SAVED_BY_TWO, set(SAVED_BY_TWO) - {"rng.rank1.pt", "random.rank1.json"}),
        (1, 2, SAVED_BY_TWO, set(SAVED_BY_TWO) - {"rng.pt", "random.json"}),
        # A third process, where two saved: rank 0's random state stands in for its own.
        (2, 3, SAVED_BY_TWO, set(SAVED_BY_TWO) - {"rng.rank1.pt", "random.rank1.json"}),
        (1, 2, SHARDED_BY_TWO, {"state.json", "rng.rank1.pt", "shards/.metadata"}
         | {"shards/__1_0.distcp", "shards/__3_0.distcp"}),
    ],
)  # fmt: skip
def test_each_rank_reads_and_verifies_only_its_files(rank, world, names, reads):
    from torchturbo.distributed.launch import DistEnv
    from torchturbo.distributed.strategy import Strategy

    strategy = Strategy(CONFIG, torch.device("cpu"), DistEnv(rank, rank, world))
    assert strategy._files_read_here(names) == reads


def test_a_corrupt_file_this_rank_does_not_read_is_not_its_concern(tmp_path):
    files = {"state.json": {"n": 1}, "rng.pt": torch.ones(3), "rng.rank1.pt": torch.zeros(3)}
    path = write_checkpoint(tmp_path, 1, files, keep_last=1)
    (path / "rng.pt").write_bytes(b"corrupt")
    own = read_checkpoint(path, select=lambda names: {"state.json", "rng.rank1.pt"})
    assert own.keys() == {"state.json", "rng.rank1.pt"} and torch.equal(
        own["rng.rank1.pt"], files["rng.rank1.pt"]
    )
    # Negative control: the rank that reads it finds it corrupt.
    with pytest.raises(CheckpointError, match=r"rng\.pt fails its checksum"):
        read_checkpoint(path, select=lambda names: {"rng.pt"})


def test_resume_from_a_directory_without_checkpoint_is_a_clear_error(tmp_path):
    turbo, *_ = _workload("shuffled", init_seed=0)
    with pytest.raises(CheckpointError, match="holds no checkpoint"):
        turbo.load(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        turbo.load(tmp_path / "missing")


def test_an_unwritable_checkpoint_directory_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    turbo, _model, _opt, _sched, _loader, _loss = _workload("shuffled", init_seed=0)
    with pytest.raises(CheckpointError, match="cannot write a checkpoint in"):
        turbo.save(blocker / "ckpt")


def _failing_write(monkeypatch, fail_on: str) -> None:
    """Make writing ``fail_on`` fail as a full disk does (ENOSPC), the other files unchanged."""
    real = checkpoint._write_file

    def write(path, data):
        if path.name == fail_on:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, data)

    monkeypatch.setattr(checkpoint, "_write_file", write)


def test_a_failed_write_removes_its_temporary_and_keeps_the_checkpoints_before(
    tmp_path, monkeypatch
):
    turbo = _train_and_save_two(tmp_path)
    before = {p.name: sorted(f.name for f in p.iterdir()) for p in tmp_path.iterdir()}
    _failing_write(monkeypatch, "optimizer.pt")
    with pytest.raises(CheckpointError, match=r"ckpt-0000000009'.*No space left on device"):
        turbo.save(tmp_path)
    after = {p.name: sorted(f.name for f in p.iterdir()) for p in tmp_path.iterdir()}
    assert after == before  # no .tmp-ckpt-*, ckpt-2 and ckpt-3 as they were


class _FullDisk:
    """A file of a disk that has ``room`` bytes left: the write past it fails with ENOSPC."""

    def __init__(self, handle, room: list[int]) -> None:
        self.handle, self.room = handle, room

    def write(self, data) -> int:
        size = memoryview(data).nbytes
        if size > self.room[0]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room[0] -= size
        return self.handle.write(data)

    def __getattr__(self, name):
        return getattr(self.handle, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.handle.close()


def test_a_disk_filling_inside_torch_save_names_the_directory_the_size_and_what_is_kept(
    tmp_path, monkeypatch
):
    turbo = _train_and_save_two(tmp_path)
    room = [3000]  # the disk fills in the middle of model.pt, inside torch.save

    def full_disk_open(path, mode):
        return _FullDisk(open(path, mode), room)

    monkeypatch.setattr(checkpoint, "open", full_disk_open, raising=False)
    with pytest.raises(CheckpointError) as raised:
        turbo.save(tmp_path)
    message = str(raised.value)
    assert "unexpected pos" not in message  # torch's words for it, which name no reason
    assert re.search(
        rf"No space left on device in '{re.escape(str(tmp_path))}' \(the checkpoint needs about "
        r"[\d.]+ KiB, [\d.]+ \w+ free\); nothing of it was kept, and the newest checkpoint kept "
        rf"is '{re.escape(str(tmp_path / 'ckpt-0000000003'))}', intact",
        message,
    ), message
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-0000000003", "ckpt-0000000002"]
    assert not list(tmp_path.glob(".tmp-*"))


def test_a_full_disk_at_the_first_save_says_no_checkpoint_was_saved_before(tmp_path, monkeypatch):
    _failing_write(monkeypatch, "model.pt")
    with pytest.raises(CheckpointError, match="no checkpoint was saved before it"):
        write_checkpoint(tmp_path, 1, {"model.pt": {"w": torch.zeros(4)}}, keep_last=1)


def test_saving_the_same_step_again_keeps_the_old_one_if_the_new_one_fails(tmp_path, monkeypatch):
    turbo = _train_and_save_two(tmp_path)
    write_checkpoint(tmp_path, 3, {"state.json": {"n": 1}}, keep_last=3)
    _failing_write(monkeypatch, "manifest.json")
    with pytest.raises(CheckpointError, match="No space left"):
        write_checkpoint(tmp_path, 3, {"state.json": {"n": 2}}, keep_last=3)
    assert read_checkpoint(tmp_path / "ckpt-0000000003") == {"state.json": {"n": 1}}
    assert turbo.optimizer_steps == 9 and not list(tmp_path.glob(".*"))


def test_a_manifest_that_names_a_file_outside_the_checkpoint_is_refused(tmp_path):
    outside = tmp_path / "secret.json"
    outside.write_text("{}")
    path = write_checkpoint(tmp_path / "ckpt", 1, {"state.json": {}}, keep_last=1)
    edit_checkpoint_json(
        path, "manifest.json", lambda m: m["files"].update({"../../secret.json": "0"})
    )
    with pytest.raises(
        CheckpointError, match=r"lists '\.\./\.\./secret\.json', which is not a file"
    ):
        read_checkpoint(path)


# --- compatibility of a checkpoint with the run resuming it -----------------------------


class Wider(Net):
    def __init__(self) -> None:
        super().__init__()
        self.body[0] = nn.Linear(8, 32)
        self.body[3] = nn.Linear(32, 3)


def _fresh(model: nn.Module, optimizer_class=torch.optim.Adam):
    turbo = Turbo(CONFIG)
    turbo.setup(model, optimizer_class(model.parameters(), lr=0.01))
    return turbo


def _refused(turbo, tmp_path, message: str) -> None:
    weights = _params(turbo.model)
    with pytest.raises(CheckpointError, match=message):
        turbo.load(tmp_path)
    # Checked before anything was restored: the live model is untouched.
    assert all(torch.equal(a, b) for a, b in zip(weights, _params(turbo.model), strict=True))


def test_resuming_another_architecture_names_both_shapes(tmp_path):
    _train_and_save_two(tmp_path)
    _refused(
        _fresh(Wider()),
        tmp_path,
        r"'body\.0\.weight' is \[16, 8\] in the checkpoint and \[32, 8\] in the model; "
        r"'body\.0\.bias' is \[16\]",
    )
    _refused(_fresh(Tagger()), tmp_path, r"the model has 3 entries \('embed\.weight'")


def test_resuming_with_another_optimizer_type_names_both(tmp_path):
    _train_and_save_two(tmp_path)
    _refused(
        _fresh(Net(), torch.optim.SGD),
        tmp_path,
        "the checkpoint's optimizer is Adam, this run's is SGD",
    )


def test_a_checkpoint_without_the_optimizer_name_is_told_by_its_hyperparameters(tmp_path):
    _train_and_save_two(tmp_path)
    edit_checkpoint_json(tmp_path / "ckpt-0000000003", "state.json", lambda s: s.pop("optimizer"))
    _refused(
        _fresh(Net(), torch.optim.SGD),
        tmp_path,
        r"group 0 lacks dampening, momentum, which SGD needs: it was saved from another "
        r"optimizer type \(it has amsgrad, betas",
    )
    _fresh(Net()).load(tmp_path)  # negative control: with Adam it resumes


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: s.update(optimizer_steps="3"), r"optimizer_steps = '3' is invalid"),
        (
            lambda s: s.update(optimizer_steps=5),
            "says optimizer step 5, the checkpoint is named for step 3",
        ),
        (
            lambda s: s.update(skipped_steps=4),
            r"skipped_steps = 4 is invalid: expected an int from 0 to 3",
        ),
        (lambda s: s.update(micro_batch_split=0), "micro_batch_split = 0 is invalid"),
        (
            lambda s: s.update(loader=[0, 7]),
            "batch 7 is out of range: this run's loader has 7 batches",
        ),
        (lambda s: s.update(loader=[0, "1"]), r"loader = \[0, '1'\] is invalid"),
        (lambda s: s.update(version=3), r"version = 3, expected one of \(1, 2\)"),
    ],
)
def test_hand_edited_state_is_refused_with_the_field_and_its_range(tmp_path, edit, message):
    _train_and_save_two(tmp_path)
    edit_checkpoint_json(tmp_path / "ckpt-0000000003", "state.json", edit)
    turbo, *_ = _workload("shuffled", init_seed=0)
    _refused(turbo, tmp_path, message)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: s.update(numpy=[9999, 0, 0.0]), "numpy state is not the tail"),
        (lambda s: s["python"][1].pop(), "python state is not a random.getstate"),
    ],
)
def test_a_hand_edited_random_state_is_refused(tmp_path, edit, message):
    _train_and_save_two(tmp_path)
    edit_checkpoint_json(tmp_path / "ckpt-0000000003", "random.json", edit)
    turbo, *_ = _workload("shuffled", init_seed=0)
    _refused(turbo, tmp_path, message)


@pytest.mark.parametrize("name", ["model.pt", "rng.pt"])
@pytest.mark.parametrize("file_too", [False, True], ids=["entry", "entry and file"])
def test_a_manifest_missing_an_entry_falls_back_as_a_corrupt_file_does(tmp_path, name, file_too):
    _train_and_save_two(tmp_path)
    newest = tmp_path / "ckpt-0000000003"
    edit_checkpoint_json(newest, MANIFEST, lambda m: m["files"].pop(name))
    if file_too:
        (newest / name).unlink()
    turbo, *_ = _workload("shuffled", init_seed=0)
    said = "lists no" if file_too else "does not list"
    with pytest.warns(RuntimeWarning, match=rf"{said} {re.escape(name)}.*falling back to "):
        path = turbo.load(tmp_path)
    assert path.name == "ckpt-0000000002" and turbo.optimizer_steps == 2


def test_when_every_manifest_misses_an_entry_the_resume_is_refused(tmp_path):
    _train_and_save_two(tmp_path)
    for saved in list_checkpoints(tmp_path):
        edit_checkpoint_json(saved, MANIFEST, lambda m: m["files"].pop("model.pt"))
    turbo, *_ = _workload("shuffled", init_seed=0)
    _refused(turbo, tmp_path, r"no checkpoint verifies: .*does not list model\.pt")


# --- a real kill: SIGKILL in a subprocess at a random batch, resumed here ------------------


def _main() -> None:
    """Subprocess entry: train with a checkpoint after every optimizer step; SIGKILL at a batch."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--kill-at", type=int, required=True)
    args = parser.parse_args()
    turbo, _model, _opt, scheduler, loader, loss_fn = _workload("bucketed", init_seed=0)
    trained = 0
    while True:
        for batch in loader:
            metrics = turbo.step(loss_fn, batch)
            trained += 1
            if trained == args.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if metrics.optimizer_stepped:
                scheduler.step()
                turbo.save(args.dir, scheduler=scheduler)


@pytest.mark.slow
def test_sigkill_at_a_random_batch_then_resume_is_bit_identical(tmp_path):
    expected_losses, expected = _uninterrupted("bucketed")
    # Any batch after the first save (batch 2) but the last, inside a window or closing one.
    kill_at = random.Random().randint(3, len(expected_losses) - 1)
    script = [sys.executable, str(Path(__file__).resolve()), "--dir", str(tmp_path)]
    killed = subprocess.run([*script, "--kill-at", str(kill_at)], timeout=120, check=False)
    assert killed.returncode == -signal.SIGKILL
    torch.manual_seed(1234)
    turbo, model, _opt, scheduler, loader, loss_fn = _workload("bucketed", init_seed=99)
    turbo.load(tmp_path, scheduler=scheduler)
    rest = _train(turbo, scheduler, loader, loss_fn)
    assert rest == expected_losses[len(expected_losses) - len(rest) :], f"killed at {kill_at}"
    assert all(torch.equal(a, e) for a, e in zip(_params(model), expected, strict=True))


if __name__ == "__main__":
    _main()
