"""Preemption: real signals sent to `torchturbo train` at a random micro-step, then --resume.

Each run is a fresh process (or a torchrun job of two) training tests/recipes/marked.py, which
prints a marker at every micro-step: a test waits for the marker of a randomly drawn step before
it signals, so that a busy machine cannot make it signal too early or too late. What must hold:
the run saves the step under way (or a later one, never an earlier one), exits with status 75,
and resuming ends with weights and optimizer state bit-identical to an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import terminal_stop_signals

from torchturbo.base.stop_signals import leave_stop_signals_to_the_trainer
from torchturbo.reliability.preemption import (
    EXIT_STOPPED,
    StopNow,
    StopRequest,
    agree_to_stop,
    raise_on_stop_signals,
    stop_on_signals,
)
from torchturbo.resume.files import list_checkpoints, read_checkpoint

MARKED = str(Path(__file__).parent / "recipes" / "marked.py") + ":recipe"
STALLED_SAVE = Path(__file__).parent / "scripts" / "stalled_save.py"
STEPS, SAVE_EVERY = 40, 5
TIMEOUT_S = 180
TRAIN = ["train", MARKED, "--device", "cpu", "--steps", str(STEPS)]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
TORCHRUN += ["-m", "torchturbo"]


class Run:
    """A process started in its own session whose output lines are collected as they come."""

    def __init__(self, command: list[str], env: dict[str, str] | None = None) -> None:
        env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"} | (env or {})
        self.process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self.changed = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with self.changed:
                self.lines.append(line)
                self.changed.notify_all()
        self.process.stdout.close()
        with self.changed:
            self.changed.notify_all()

    def wait_for(self, pattern: str) -> re.Match[str]:
        """The first output line matching ``pattern``, waiting for it (bounded). Two ranks
        share the pipe and torchrun's agent relays them, so one rank's line may start inside
        another's: patterns are searched, not anchored at the line's start."""
        regex = re.compile(pattern)
        with self.changed:
            found = self.changed.wait_for(
                lambda: (
                    next((m for line in self.lines if (m := regex.search(line))), None)
                    or self.process.poll() is not None
                ),
                timeout=TIMEOUT_S,
            )
            match = next((m for line in self.lines if (m := regex.search(line))), None)
        if match is None:
            self.kill()
            pytest.fail(f"no line matched {pattern!r} ({found=}):\n{self.output[-6000:]}")
        return match

    def finish(self) -> int:
        try:
            status = self.process.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the run hung for {TIMEOUT_S}s:\n{self.output[-6000:]}")
        self.reader.join(timeout=TIMEOUT_S)  # every line read
        return status

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):  # the whole session ended already
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.reader.join(timeout=TIMEOUT_S)

    @property
    def output(self) -> str:
        with self.changed:
            return "".join(self.lines)


def _final_state(directory: Path) -> dict:
    files = read_checkpoint(directory / f"ckpt-{STEPS:010d}")
    return {"model": files["model.pt"], "optimizer": files["optimizer.pt"]}


def _assert_bit_equal(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_bit_equal(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_bit_equal(x, y)
    else:
        assert a == b


def _train(*args: str, launcher: list[str], env: dict[str, str] | None = None) -> Run:
    return Run([*launcher, *TRAIN, *args], env)


ONE = [sys.executable, "-m", "torchturbo"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    directory = tmp_path_factory.mktemp("full")
    run = _train("--checkpoint-dir", str(directory), launcher=ONE)
    assert run.finish() == 0, run.output[-4000:]
    return _final_state(directory)


def test_sigterm_at_a_random_step_saves_it_and_resume_is_bit_identical(tmp_path, uninterrupted):
    # SIGUSR1, SIGUSR2 and Ctrl-C take the same path: test_train sends each to train().
    signum = signal.SIGTERM
    at = random.Random().randint(2, STEPS - 5)
    run = _train("--checkpoint-dir", str(tmp_path), "--save-every", str(SAVE_EVERY), launcher=ONE)
    run.wait_for(rf"micro-step {at} ")
    os.kill(run.process.pid, signum)
    assert run.finish() == EXIT_STOPPED, run.output[-4000:]
    name = signal.Signals(signum).name
    stopped = run.wait_for(rf"{name}: stopped after optimizer step (\d+) and saved it in ")
    saved = int(stopped[1])
    assert at <= saved < STEPS, f"signalled in step {at}"  # nothing before the signal is lost
    assert list_checkpoints(tmp_path)[0].name == f"ckpt-{saved:010d}"
    resumed = _train("--checkpoint-dir", str(tmp_path), "--resume", launcher=ONE)
    assert resumed.finish() == 0, resumed.output[-4000:]
    assert f"at optimizer step {saved}; data: epoch" in resumed.output
    _assert_bit_equal(_final_state(tmp_path), uninterrupted)


def test_sigkill_during_the_save_a_signal_started_resumes_from_the_checkpoint_before(
    tmp_path, uninterrupted
):
    at = random.Random().choice([s for s in range(7, STEPS - 5) if s % SAVE_EVERY])
    script = [sys.executable, str(STALLED_SAVE), str(SAVE_EVERY)]
    run = _train(
        "--checkpoint-dir", str(tmp_path), "--save-every", str(SAVE_EVERY), launcher=script
    )
    run.wait_for(rf"micro-step {at} ")
    os.kill(run.process.pid, signal.SIGTERM)
    stalled = int(run.wait_for(r"^stalled saving step (\d+)")[1])
    run.kill()  # SIGKILL, the files of step `stalled` written but not renamed into place
    before = list_checkpoints(tmp_path)[0]
    assert int(before.name.rpartition("-")[2]) == stalled // SAVE_EVERY * SAVE_EVERY
    assert any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())
    resumed = _train("--checkpoint-dir", str(tmp_path), "--resume", launcher=ONE)
    assert resumed.finish() == 0, resumed.output[-4000:]
    assert f"resumed from {before}" in resumed.output
    _assert_bit_equal(_final_state(tmp_path), uninterrupted)


@pytest.fixture(scope="module")
def uninterrupted_two_ranks(tmp_path_factory) -> dict:
    directory = tmp_path_factory.mktemp("full2")
    run = _train("--checkpoint-dir", str(directory), launcher=TORCHRUN)
    assert run.finish() == 0, run.output[-4000:]
    return _final_state(directory)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["rank 1 alone", "the torchrun agent"])
def test_under_torchrun_the_ranks_stop_after_the_same_step_and_resume_bit_identically(
    tmp_path, uninterrupted_two_ranks, target
):
    """Rank 1 alone: as when a scheduler signals each process at its own moment; the agent:
    as Kubernetes does, torchrun forwarding the signal to both workers."""
    # The agent forwards the signal after it has logged and looked at its workers, which on a
    # loaded machine takes a while: 100 ms steps and 28 or more of them left give it 2.8 s.
    at = random.Random().randint(2, 12)
    run = _train(
        *("--checkpoint-dir", str(tmp_path), "--save-every", str(SAVE_EVERY)),
        launcher=TORCHRUN,
        env={"MARKED_STEP_S": "0.1"},
    )
    marker = run.wait_for(rf"micro-step {at} rank 1 pid (\d+)")
    os.kill(int(marker[1]) if target == "rank 1 alone" else run.process.pid, signal.SIGTERM)
    run.finish()  # torchrun reports a worker's status 75 (or its own signal) as a failure
    stopped = run.wait_for(r"^SIGTERM: stopped after optimizer step (\d+) and saved it in ")
    saved = int(stopped[1])
    assert at <= saved < STEPS and run.output.count(" stopped after optimizer step ") == 1
    assert list_checkpoints(tmp_path)[0].name == f"ckpt-{saved:010d}"
    files = read_checkpoint(list_checkpoints(tmp_path)[0])
    assert {"rng.pt", "rng.rank1.pt"} <= files.keys()  # both ranks saved that step
    resumed = _train("--checkpoint-dir", str(tmp_path), "--resume", launcher=TORCHRUN)
    assert resumed.finish() == 0, resumed.output[-4000:]
    _assert_bit_equal(_final_state(tmp_path), uninterrupted_two_ranks)


LAUNCH = [sys.executable, "-m", "torchturbo", "launch", "--standalone", "--nproc-per-node", "2"]
LAUNCH += ["-m", "torchturbo"]


@pytest.mark.slow
def test_sigusr1_to_torchturbo_launch_reaches_the_workers_and_it_exits_75(
    tmp_path, uninterrupted_two_ranks
):
    """torchrun itself dies of SIGUSR1 (exit 138), its workers training on."""
    at = random.Random().randint(2, 12)
    run = _train(
        *("--checkpoint-dir", str(tmp_path), "--save-every", str(SAVE_EVERY)),
        launcher=LAUNCH,
        env={"MARKED_STEP_S": "0.1"},
    )
    run.wait_for(rf"micro-step {at} rank 1 pid (\d+)")
    os.kill(run.process.pid, signal.SIGUSR1)
    assert run.finish() == EXIT_STOPPED, run.output[-4000:]
    saved = int(run.wait_for(r"SIGUSR1: stopped after optimizer step (\d+) and saved it in ")[1])
    assert at <= saved < STEPS
    last = run.output.strip().splitlines()[-1]
    # Which rank exits 75 first is a race; torchrun then ends the other, and the line says so.
    assert (
        re.fullmatch(
            r"torchturbo launch: the workers stopped on SIGUSR1 after saving their last step "
            r"\(rank 0: (exit 75|ended by torchrun after it), rank 1: (exit 75|ended by torchrun "
            r"after it)\); run the same command with --resume to go on",
            last,
        )
        and "exit 75" in last
    ), last
    assert "Traceback" not in run.output and "failed (exitcode" not in run.output
    resumed = _train("--checkpoint-dir", str(tmp_path), "--resume", launcher=LAUNCH)
    assert resumed.finish() == 0, resumed.output[-4000:]
    _assert_bit_equal(_final_state(tmp_path), uninterrupted_two_ranks)


@pytest.mark.slow
def test_workers_whose_launcher_was_killed_stop_and_save(tmp_path):
    at = random.Random().randint(2, 12)
    run = _train("--checkpoint-dir", str(tmp_path), launcher=LAUNCH, env={"MARKED_STEP_S": "0.1"})
    workers = {int(run.wait_for(rf"micro-step {at} rank {rank} pid (\d+)")[1]) for rank in (0, 1)}
    os.kill(run.process.pid, signal.SIGKILL)  # the agent: its workers live on in their sessions
    run.process.wait()
    for pid in workers:  # they end on their own, having saved
        for _ in range(int(TIMEOUT_S / 0.1)):
            if not _alive(pid):
                break
            threading.Event().wait(0.1)
        assert not _alive(pid), f"worker {pid} trains on"
    run.reader.join(timeout=TIMEOUT_S)  # the workers' output, to the end
    # Rank 0 says so when it saw the launcher gone first; else it stops with rank 1, agreeing.
    stopped = re.search(r"SIGHUP: stopped after optimizer step (\d+) and saved it in ", run.output)
    assert stopped is not None, run.output[-4000:]
    saved = int(stopped[1])
    assert at <= saved < STEPS and list_checkpoints(tmp_path)[0].name == f"ckpt-{saved:010d}"


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (an orphan that ended may stay a zombie in a container)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_an_ignored_or_custom_handler_is_left_alone():
    def custom(signum, frame):
        pass

    previous = signal.signal(signal.SIGTERM, custom), signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        with stop_on_signals() as request:
            assert signal.getsignal(signal.SIGTERM) is custom
            assert signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGUSR2) is not signal.SIG_DFL  # taken over
            os.kill(os.getpid(), signal.SIGUSR2)
        assert request.signal_name == "SIGUSR2" and agree_to_stop(request)
        assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL  # given back
    finally:
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGUSR1, previous[1])


def test_each_test_starts_with_the_stop_signals_of_a_terminal_and_must_give_them_back():
    # conftest's autouse guard: a suite started in the background inherits SIGINT ignored.
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with terminal_stop_signals():
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # given back
        leak = pytest.raises(AssertionError, match="handler for SIGUSR1: restore it")
        with leak, terminal_stop_signals():
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # left behind
        assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # restored all the same
    finally:
        signal.signal(signal.SIGINT, previous)


def test_in_one_process_agreeing_reads_the_flag():
    request = StopRequest()
    assert not agree_to_stop(request)
    request.set(signal.SIGTERM)
    assert agree_to_stop(request)


def _worker(ready, init) -> None:
    import time

    if init:
        leave_stop_signals_to_the_trainer()
    ready.set()
    time.sleep(60)


@pytest.mark.parametrize("init", [True, False])
def test_a_loader_worker_ends_quietly_on_a_stop_signal(init):
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    worker = context.Process(target=_worker, args=(ready, init))
    worker.start()
    assert ready.wait(TIMEOUT_S)
    os.kill(worker.pid, signal.SIGTERM)
    worker.join(TIMEOUT_S)
    # Status 0, not "killed by SIGTERM", which the DataLoader's SIGCHLD handler raises on at
    # once, inside the trainer's step under way (negative control: without the init function).
    assert worker.exitcode == (0 if init else -signal.SIGTERM)


def test_sigterm_to_the_whole_job_with_loader_workers_still_saves_the_step(tmp_path):
    config = tmp_path / "workers.toml"
    config.write_text("[data]\nnum_workers = 2\npersistent_workers = true\n")
    at = random.Random().randint(2, STEPS - 5)
    ck = tmp_path / "ck"
    run = _train("--checkpoint-dir", str(ck), "--config", str(config), launcher=ONE)
    run.wait_for(rf"micro-step {at} ")
    os.killpg(run.process.pid, signal.SIGTERM)  # as SLURM does: the trainer and its workers
    assert run.finish() == EXIT_STOPPED, run.output[-4000:]
    saved = int(run.wait_for(r"^SIGTERM: stopped after optimizer step (\d+) and saved it")[1])
    assert at <= saved < STEPS and list_checkpoints(ck)[0].name == f"ckpt-{saved:010d}"


def test_the_launchers_line_says_what_the_workers_did():
    from torchturbo.cli.launch import outcome

    assert outcome({0: 75, 1: -15}, [signal.SIGUSR1], EXIT_STOPPED) == (
        75,
        "the workers stopped on SIGUSR1 after saving their last step (rank 0: exit 75, rank 1: "
        "ended by torchrun after it); run the same command with --resume to go on",
    )
    assert outcome({0: 2, 1: -15}, [], EXIT_STOPPED)[0] == 2
    assert outcome({1: -9}, [], EXIT_STOPPED) == (
        137,
        "worker rank 1 failed (rank 1: killed by SIGKILL); torchrun stopped the others",
    )


def test_the_launcher_finds_its_workers_among_its_children():
    from torchturbo.distributed.agent import children

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in children()
        assert os.getpid() not in children()
    finally:
        child.kill()
        child.wait()


def test_a_worker_whose_parent_is_gone_asks_to_stop_as_on_sighup(monkeypatch):
    from torchturbo.reliability import preemption

    parents = iter([4321, 4321])  # then adopted: the launcher is gone
    monkeypatch.setattr(preemption.os, "getppid", lambda: next(parents, 1))
    monkeypatch.setattr(preemption, "PARENT_POLL_S", 0.01)
    with terminal_stop_signals(), stop_on_signals(watch_parent=True, announce=False) as request:
        for _ in range(500):
            if request.is_set():
                break
            threading.Event().wait(0.01)
    assert request.signal_name == "SIGHUP"
    # The control: a parent that stays leaves the run alone.
    monkeypatch.setattr(preemption.os, "getppid", lambda: 4321)
    with terminal_stop_signals(), stop_on_signals(watch_parent=True, announce=False) as request:
        threading.Event().wait(0.1)
    assert not request.is_set()


def test_raise_on_stop_signals_stops_at_once_and_restores_the_handlers():
    before = signal.getsignal(signal.SIGTERM)
    with raise_on_stop_signals(), pytest.raises(StopNow) as stopped:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # interrupted by the handler long before
    assert stopped.value.signal_name == "SIGTERM" and stopped.value.exit_status == 143
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_stop_swallowed_by_a_weakref_callback_is_delivered_again():
    """Python ignores an exception raised in a weakref callback (or a ``__del__``), printing
    "Exception ignored": a stop raised there must still stop the run."""
    import weakref

    class Held:
        pass

    def stopped_inside(ref: object) -> None:
        raise StopNow(signal.SIGTERM, "stopped at once")

    with raise_on_stop_signals(), pytest.raises(StopNow):
        held = Held()
        ref = weakref.ref(held, stopped_inside)
        del held  # the callback runs here, and its StopNow is swallowed ...
        time.sleep(5)  # ... then delivered again
    assert ref() is None
