"""A checkpoint directory is owned by one run at a time and checked before the first step.

The lock: a second run is refused naming the first; a killed owner (SIGKILL, with a forked
child still alive, as loader workers are) leaves nothing stuck. The checks: a path under a file,
a read-only file system, a directory without write permission and a disk without room for one
checkpoint are each one error before the model trains a step.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from torchturbo import TurboConfig
from torchturbo.recipe import load_recipe
from torchturbo.resume import directory as checkpoint_dir
from torchturbo.resume.directory import estimate_state_bytes, room_problem
from torchturbo.resume.files import CheckpointError
from torchturbo.resume.lock import LOCK_NAME, hold_directory
from torchturbo.runs.train import train

TINY = str(Path(__file__).parent / "recipes" / "tiny.py") + ":recipe"
HOLD_LOCK = Path(__file__).parent / "scripts" / "hold_lock.py"
CONFIG = TurboConfig(device="cpu")


def _counting(recipe):
    """The recipe, counting its loss calls: 0 after a refusal means no step was trained."""
    calls = [0]

    def loss_fn(model, batch):
        calls[0] += 1
        return recipe.loss_fn(model, batch)

    return dataclasses.replace(recipe, loss_fn=loss_fn), calls


# --- one run at a time -------------------------------------------------------------------------


def test_a_second_run_on_a_directory_in_use_is_refused_naming_the_first(tmp_path):
    recipe, calls = _counting(load_recipe(TINY))
    with hold_directory(tmp_path), pytest.raises(CheckpointError) as refused:
        train(recipe, CONFIG, steps=2, checkpoint_dir=tmp_path)
    message = str(refused.value)
    assert f"{str(tmp_path)!r} is in use by another run (pid {os.getpid()} on host " in message
    assert socket.gethostname() in message and ", started " in message
    assert calls[0] == 0
    # Released at the end of the block: the same run now goes ahead, and leaves no lock behind.
    assert train(recipe, CONFIG, steps=2, checkpoint_dir=tmp_path).optimizer_steps == 2
    assert not (tmp_path / LOCK_NAME).exists()


def _holder(directory: Path, *more: str) -> tuple[subprocess.Popen, dict[str, int]]:
    process = subprocess.Popen(
        [sys.executable, str(HOLD_LOCK), str(directory), *more], stdout=subprocess.PIPE, text=True
    )
    pids = {}
    assert process.stdout is not None
    for line in process.stdout:
        name, pid = line.split()
        pids[name] = int(pid)
        if name == "held":
            return process, pids
    raise AssertionError(f"the holder ended with {process.wait()}")


@pytest.mark.slow
@pytest.mark.parametrize("fork", [False, True], ids=["alone", "with a forked child alive"])
def test_a_killed_owner_leaves_no_stuck_lock(tmp_path, fork):
    process, pids = _holder(tmp_path, *(["--fork"] if fork else []))
    try:
        held = rf"in use by another run \(pid {pids['held']} "
        with pytest.raises(CheckpointError, match=held), hold_directory(tmp_path):
            pass  # the control: held while the owner lives
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        assert (tmp_path / LOCK_NAME).exists()  # a killed owner cannot remove it ...
        with hold_directory(tmp_path):  # ... and it holds nothing: the kernel released it
            pass
    finally:
        if "child" in pids:
            os.kill(pids["child"], signal.SIGKILL)
        process.kill()
        process.wait()
        assert process.stdout is not None
        process.stdout.close()


# --- writable, before the first step -----------------------------------------------------------


def test_a_path_under_a_file_is_refused_before_the_first_step(tmp_path):
    recipe, calls = _counting(load_recipe(TINY))
    (tmp_path / "notes.txt").write_text("")
    target = tmp_path / "notes.txt" / "ckpt"
    with pytest.raises(
        CheckpointError, match=r"cannot create checkpoint directory .*notes\.txt' is a file"
    ):
        train(recipe, CONFIG, steps=2, checkpoint_dir=target)
    assert calls[0] == 0


@pytest.mark.parametrize("resume", [False, True], ids=["fresh", "resume"])
def test_a_loop_of_symbolic_links_is_named_as_one(tmp_path, resume):
    """Path.exists() is False for a link loop and mkdir says "File exists": neither is what
    the user needs to hear."""
    recipe, calls = _counting(load_recipe(TINY))
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    said = r"checkpoint directory .*: '.*a' is a loop of symbolic links \(it leads back to itself\)"
    with pytest.raises(CheckpointError, match=said):
        train(recipe, CONFIG, steps=2, checkpoint_dir=tmp_path / "a" / "ckpt", resume=resume)
    assert calls[0] == 0


def test_a_loop_of_symbolic_links_as_tune_out_is_named_as_one(tmp_path, capsys):
    from torchturbo.cli import main

    (tmp_path / "a").symlink_to(tmp_path / "a")
    assert main(["tune", TINY, "--device", "cpu", "--out", str(tmp_path / "a")]) == 2
    assert "is a loop of symbolic links (it leads back to itself)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("code", "said"),
    [
        (errno.EROFS, "it is on a read-only file system"),
        (errno.EACCES, "permission denied"),
        (errno.EPERM, "operation not permitted (an immutable or append-only directory?)"),
    ],
)
def test_a_directory_the_system_will_not_write_is_refused_before_the_first_step(
    tmp_path, monkeypatch, code, said
):
    """The system's refusal, raised by the probe's open: a read-only file system needs a mount
    (benchmarks/faults.py mounts a read-only tmpfs), an immutable directory chattr; the test
    below meets a real permission denied."""
    real_open = os.open

    def refusing_open(path, flags, *args):
        if Path(path).name.startswith(".probe-"):
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(checkpoint_dir.os, "open", refusing_open)
    recipe, calls = _counting(load_recipe(TINY))
    with pytest.raises(CheckpointError, match=rf"is not writable: {re.escape(said)}$"):
        train(recipe, CONFIG, steps=2, checkpoint_dir=tmp_path / "ckpt")
    assert calls[0] == 0
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == []  # no probe left behind


@pytest.mark.slow
def test_a_directory_without_write_permission_is_refused(tmp_path):
    """For real: root is refused too once it lacks CAP_DAC_OVERRIDE (setpriv), as a user is."""
    target = tmp_path / "ckpt"
    target.mkdir(mode=0o555)
    target.chmod(0o555)
    prefix = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root writes a directory of mode 555 anyway, and there is no setpriv")
        dropped = "-dac_override,-dac_read_search"
        prefix = ["setpriv", f"--bounding-set={dropped}", f"--inh-caps={dropped}", "--"]
    probe = (
        "import sys; from torchturbo.resume.directory import prepare_directory; "
        "prepare_directory(sys.argv[1], resume=False)"
    )
    result = subprocess.run(
        [*prefix, sys.executable, "-c", probe, str(target)], capture_output=True, text=True
    )
    assert result.returncode == 1 and "is not writable: permission denied" in result.stderr, (
        result.stderr[-2000:]
    )


def test_resuming_from_a_directory_that_does_not_exist_is_refused_before_building(tmp_path):
    recipe, calls = _counting(load_recipe(TINY))
    with pytest.raises(CheckpointError, match=r"cannot resume: .* does not exist"):
        train(recipe, CONFIG, steps=2, checkpoint_dir=tmp_path / "none", resume=True)
    assert calls[0] == 0 and not (tmp_path / "none").exists()


# --- room for a checkpoint ---------------------------------------------------------------------


def test_the_estimate_is_the_size_of_the_checkpoint_written(tmp_path):
    recipe = load_recipe(TINY)
    model, optimizer = recipe.build()
    estimate = estimate_state_bytes(model, optimizer)  # before the first step: no Adam state yet
    saved = train(recipe, CONFIG, steps=2, checkpoint_dir=tmp_path).saved
    assert saved is not None
    written = sum(p.stat().st_size for p in saved.iterdir())
    # The estimate counts tensor bytes, plus 64 KiB for the small files and the archives'
    # headers: above what was written, and by no more than those 64 KiB.
    assert written <= estimate <= written + 64 * 1024, (written, estimate)


def test_optimizers_whose_state_is_unknown_count_none():
    model = nn.Linear(100, 100)
    sgd = estimate_state_bytes(model, torch.optim.SGD(model.parameters(), lr=0.1))
    momentum = estimate_state_bytes(
        model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    )
    adam = estimate_state_bytes(model, torch.optim.Adam(model.parameters()))
    weights = 101 * 100 * 4
    assert (momentum - sgd, adam - sgd) == (weights, 2 * weights)


def test_a_disk_without_room_for_one_checkpoint_is_refused_before_the_first_step(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(checkpoint_dir, "free_space", lambda path: 1024)
    recipe, calls = _counting(load_recipe(TINY))
    with pytest.raises(
        CheckpointError, match=r"has 1\.0 KiB free, and a checkpoint of this run needs about "
    ):
        train(recipe, CONFIG, steps=2, checkpoint_dir=tmp_path)
    assert calls[0] == 0


def test_room_for_fewer_than_keep_last_checkpoints_is_a_warning(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_dir, "free_space", lambda path: 2500)
    assert room_problem(tmp_path, 1000, keep_last=3) == (
        None,
        f"checkpoint directory {str(tmp_path)!r} has room for 2 more checkpoint(s) of about "
        "1000 B (2.4 KiB free); keeping 3 ([reliability] keep_last) needs 4: a later save will "
        "fail, keeping the checkpoints before it",
    )
    monkeypatch.setattr(checkpoint_dir, "free_space", lambda path: 4000)
    assert room_problem(tmp_path, 1000, keep_last=3) == (None, "")  # the control: room for 4
