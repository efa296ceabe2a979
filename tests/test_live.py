"""Live status lines: a countdown that moves between reports, names shown literally, and
third-party output printed above the line instead of through it."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from torchturbo.output.live import PlainLines, StatusLine, TrainLine, TuneLine, fmt_clock


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _render(line: object, width: int = 80) -> str:
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(line)
    return console.export_text()


def test_fmt_clock() -> None:
    seconds = (0, 9.9, 75, 3725, -3)
    assert [fmt_clock(s) for s in seconds] == ["0:00", "0:09", "1:15", "1:02:05", "0:00"]


def test_the_countdown_and_the_candidate_time_move_between_reports() -> None:
    clock = _Clock()
    line = TuneLine("tune text", budget_s=300, clock=clock)
    line.report("precision", "bf16", 90.0)
    assert "1:30 left · 0:00 on it" in _render(line)
    clock.now += 25  # no report for 25 s: the candidate is still training
    assert "1:05 left · 0:25 on it" in _render(line)
    clock.now += 100
    assert "budget spent · 2:05 on it" in _render(line)
    line.report("confirmation", "bf16", 0.0)
    assert "budget spent · 0:00 on it" in _render(line)


def test_stage_names_print_literally_and_the_line_fits_80_columns() -> None:
    line = TuneLine("tune text", budget_s=300, clock=_Clock())
    line.report("precision", "compile[bold] " + "x" * 100, 90.0)
    text = _render(line)
    assert "tune text [precision] compile[bold] xxx" in text
    assert len(text.rstrip("\n").splitlines()) == 1 and len(text.rstrip("\n")) <= 80


def test_a_status_line_counts_up_from_its_last_report() -> None:
    clock = _Clock()
    line = StatusLine("bench vision", clock=clock)
    line.report("timing [interleaved]")
    clock.now += 42
    assert "bench vision: timing [interleaved]" in _render(line) and "0:42" in _render(line)


def test_the_train_line_shows_step_loss_throughput_eta_and_the_last_checkpoint() -> None:
    from torchturbo.runs.train import TrainProgress

    clock = _Clock()
    line = TrainLine("train tiny", steps=400, clock=clock)
    assert line.plain() == (
        "train tiny step 0/400 · loss n/a · - samples/s · ETA - · saved nothing"
    )
    # Resumed at step 100: throughput and ETA count from this process's first step on.
    line.report(TrainProgress(101, 400, 0.9, 8, None))
    clock.now += 10
    saved = Path("ck") / "ckpt-0000000120"
    line.report(TrainProgress(120, 400, 0.4321, 8 + 19 * 8, saved))
    assert line.plain() == (
        "train tiny step 120/400 · loss 0.4321 · 15 samples/s · ETA 2:27 · saved ckpt-0000000120"
    )  # 19 steps in 10 s: 280 steps left take 147 s
    text = _render(line)
    assert len(text.rstrip("\n").splitlines()) == 1 and len(text.rstrip("\n")) <= 80


def test_in_a_log_a_line_follows_each_new_topic_and_a_heartbeat_every_30_s() -> None:
    clock, log = _Clock(), io.StringIO()
    line = TuneLine("tune big", 300, clock=clock)
    plain = PlainLines(line, log, clock=clock)
    assert plain.tick()  # what it starts with
    line.report("precision", "bf16", 290)
    assert not plain.tick()  # a new topic, but within 2 s of the last line
    clock.now += 2
    assert plain.tick() and not plain.tick()
    clock.now += 29  # one candidate for half a minute: silent ...
    assert not plain.tick()
    clock.now += 1  # ... then the heartbeat
    assert plain.tick()
    lines = log.getvalue().splitlines()
    assert lines[0].startswith("tune big [starting]")
    assert lines[1] == "tune big [precision] bf16 · 0:12 of 5:00 · 4:48 left · 0:02 on it"
    assert lines[2] == "tune big [precision] bf16 · 0:42 of 5:00 · 4:18 left · 0:32 on it"


def test_a_status_line_in_a_log_says_what_it_does_and_for_how_long() -> None:
    clock, log = _Clock(), io.StringIO()
    line = StatusLine("bench vision", clock=clock)
    plain = PlainLines(line, log, clock=clock)
    line.report("timing (interleaved), round 2/5")
    clock.now += 3
    assert plain.tick()
    assert log.getvalue() == "bench vision: timing (interleaved), round 2/5 · 0:03\n"


_PIPED = r"""
import sys, time
import torchturbo.output.live as live_module

live_module.EVERY_S = float(sys.argv[1])
line = live_module.StatusLine("tune slow")
with live_module.live(line, every_s=live_module.EVERY_S):
    line.report("one long step")
    time.sleep(3.5)
print("result")
"""


def test_piped_the_heartbeat_comes_from_a_thread_while_one_step_runs() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _PIPED, "1"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    beats = [line for line in done.stdout.splitlines() if line.startswith("tune slow")]
    assert len(beats) >= 3, done.stdout  # a line a second during one 3.5-s call
    assert done.stdout.endswith("result\n") and not done.stderr  # stderr keeps errors only


_SCRIPT = r"""
import contextlib, os, sys, time
from rich.console import Console
import torchturbo.output.live as live_module

if sys.argv[1] == "uncaptured":  # the negative control: rich's Live alone
    live_module._captured = contextlib.contextmanager(lambda: (yield Console(stderr=True)))
line = live_module.StatusLine("bench tiny")
with live_module.live(line):
    line.report("timing")
    time.sleep(0.5)
    os.write(2, b"USDT: written by C++ to descriptor 2\n")
    time.sleep(0.5)
"""


def _in_a_terminal(mode: str) -> bytes:
    """Run the script with stdout and stderr on a pseudo-terminal; return what it drew."""
    pty = pytest.importorskip("pty")
    master, slave = pty.openpty()
    env = os.environ | {"COLUMNS": "80", "LINES": "24", "TERM": "xterm"}
    process = subprocess.Popen(
        [sys.executable, "-c", _SCRIPT, mode], stdin=slave, stdout=slave, stderr=slave, env=env
    )
    os.close(slave)
    drawn = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        drawn += chunk
    assert process.wait(timeout=60) == 0, drawn.decode(errors="replace")
    os.close(master)
    return drawn


@pytest.mark.skipif(sys.platform == "win32", reason="pseudo-terminals are POSIX")
def test_descriptor_level_output_is_printed_above_the_live_line() -> None:
    erase_line, dim = b"\x1b[2K", b"\x1b[2m"
    drawn = _in_a_terminal("captured")
    # The live line is erased, the foreign line printed (dimmed) on its own, the line redrawn.
    assert erase_line + dim + b"USDT: written by C++ to descriptor 2" in drawn
    assert b"bench tiny: timing" in drawn.split(b"USDT")[1]
    # Negative control: without the capture the bytes land wherever the cursor is, right
    # after the live line's own text.
    uncaptured = _in_a_terminal("uncaptured")
    assert b"USDT: written by C++" in uncaptured
    assert erase_line + dim + b"USDT" not in uncaptured
