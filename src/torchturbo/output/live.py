"""Progress lines for long commands: live on a terminal, plain lines in a log, redrawn on their
own clock, third-party output above them.

On a terminal (stderr is one) the line is drawn live with rich. Piped to a file, as on a
cluster, the same words are printed as plain lines to stdout, with the command's other output
(stderr keeps the one-line errors; a command whose stdout is JSON, ``--json -``, passes stderr):
one when what the command does changes, at most one per :data:`MIN_GAP_S`, and one every
:data:`EVERY_S` while it does the same thing, from a thread, since a step or a compile can take
minutes (:class:`PlainLines`).

The tuner reports progress only between candidates, and a candidate can train for minutes, so a
line redrawn only on reports freezes ("90 s left" for a minute). These lines keep the time of
the last report and redraw four times a second: the budget's countdown and the time spent on the
current candidate move while it runs. Reported names are shown as plain text: ``[precision]``
is not rich markup.

While a line is live, output that other code writes to the terminal is printed above it, dimmed,
instead of tearing it apart. rich's ``Live`` redirects ``sys.stdout``/``sys.stderr``, but C++
libraries write to the file descriptors directly (torch's profiler prints ``USDT: ...
profiler_start`` to descriptor 2), so the descriptors are pointed at a pipe whose lines the
console prints. No library found does that part; it is the few lines of :func:`_captured`.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

from rich.console import Console, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.spinner import Spinner
from rich.table import Table
from rich.text import Text

Clock = Callable[[], float]


def fmt_clock(seconds: float) -> str:
    """``75`` -> ``1:15``; ``3725`` -> ``1:02:05``."""
    whole = max(0, int(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class TuneLine:
    """``tune text [precision] bf16  ━━━━━━━━  3:10 left · 0:42 on it``, on its own clock.

    ``report(stage, candidate, seconds_left)`` is the tuner's ``on_progress``; between reports
    the countdown goes on from the last one, and the candidate's time counts up from it.
    """

    def __init__(self, title: str, budget_s: float, clock: Clock = time.monotonic) -> None:
        self.title, self.budget_s, self.clock = title, budget_s, clock
        self.stage, self.candidate = "starting", ""
        self.left_at_report, self.reported_at = budget_s, clock()
        self.spinner = Spinner("dots")

    def report(self, stage: str, candidate: str, seconds_left: float) -> None:
        self.stage, self.candidate = stage, candidate
        self.left_at_report, self.reported_at = max(0.0, seconds_left), self.clock()

    def seconds_left(self) -> float:
        return max(0.0, self.left_at_report - (self.clock() - self.reported_at))

    def _clocks(self) -> str:
        on_it = fmt_clock(self.clock() - self.reported_at)
        left = self.seconds_left()
        # The budget can run out while a candidate (or the confirmation) is still measuring.
        budget = f"{fmt_clock(left)} left" if left > 0 else "budget spent"
        return f"{budget} · {on_it} on it"

    def topic(self) -> str:
        """What it does, without the clocks: a new topic is worth a line in a log."""
        return f"{self.title} [{self.stage}] {self.candidate}".rstrip()

    def plain(self) -> str:
        spent = fmt_clock(self.budget_s - self.seconds_left())
        return f"{self.topic()} · {spent} of {fmt_clock(self.budget_s)} · {self._clocks()}"

    def __rich__(self) -> RenderableType:
        left = self.seconds_left()
        bar = ProgressBar(total=self.budget_s, completed=self.budget_s - left, width=10)
        return _line(self.spinner, Text(self.topic()), bar, Text(self._clocks()))


class StatusLine:
    """``bench vision: timing (interleaved)  0:42``, the time counting up from the last report."""

    def __init__(self, title: str, clock: Clock = time.monotonic) -> None:
        self.title, self.clock = title, clock
        self.message, self.reported_at = "", clock()
        self.spinner = Spinner("dots")

    def report(self, message: str) -> None:
        self.message, self.reported_at = message, self.clock()

    def topic(self) -> str:
        return f"{self.title}: {self.message}" if self.message else self.title

    def plain(self) -> str:
        return f"{self.topic()} · {fmt_clock(self.clock() - self.reported_at)}"

    def __rich__(self) -> RenderableType:
        words = Text(self.topic())
        return _line(self.spinner, words, Text(fmt_clock(self.clock() - self.reported_at)))


class TrainLine:
    """``train tiny step 120/400 · loss 0.4321 · 812 samples/s · ETA 0:34 · saved ckpt-…100``.

    ``report(progress)`` is ``train``'s ``on_progress`` (a ``train.TrainProgress``). Throughput
    and ETA are measured from the first step this process trained onwards, so that start-up
    (and a first step that compiles) does not count, nor steps a resumed run did not train.
    Where the output is no terminal, :meth:`plain` gives the same words for a log
    (:class:`PlainLines`).
    """

    def __init__(self, title: str, steps: int, clock: Clock = time.monotonic) -> None:
        self.title, self.steps, self.clock = title, steps, clock
        self.step, self.samples = 0, 0
        self.loss: float | None = None
        self.checkpoint = "nothing"
        #: (clock, step, samples) at the first report.
        self.first: tuple[float, int, int] | None = None
        self.spinner = Spinner("dots")

    def report(self, progress: Any) -> None:
        self.step, self.steps = progress.optimizer_steps, progress.steps
        self.loss, self.samples = progress.loss, progress.samples
        if self.first is None:
            self.first = (self.clock(), self.step, self.samples)
        if progress.checkpoint is not None:
            self.checkpoint = progress.checkpoint.name

    def topic(self) -> str:
        """A run trains one thing throughout: its lines in a log are the periodic ones."""
        return self.title

    def plain(self) -> str:
        loss = "n/a" if self.loss is None else f"{self.loss:.4g}"
        rate, eta = "- samples/s", "ETA -"
        if self.first is not None:
            at, step, samples = self.first
            elapsed = self.clock() - at
            if self.step > step and elapsed > 0:
                rate = f"{(self.samples - samples) / elapsed:,.0f} samples/s"
                eta = f"ETA {fmt_clock((self.steps - self.step) * elapsed / (self.step - step))}"
        return (
            f"{self.title} step {self.step}/{self.steps} · loss {loss} · {rate} · {eta} · "
            f"saved {self.checkpoint}"
        )

    def __rich__(self) -> RenderableType:
        bar = ProgressBar(total=self.steps, completed=self.step, width=10)
        return _line(self.spinner, Text(self.plain()), bar)


def _line(spinner: Spinner, words: Text, *rest: RenderableType) -> Table:
    """One row: the words take the room the rest leaves, cut with an ellipsis, never wrapped."""
    grid = Table.grid(padding=(0, 1), expand=True)
    grid.add_column(no_wrap=True)
    grid.add_column(ratio=1, no_wrap=True, overflow="ellipsis")
    for _ in rest:
        grid.add_column(no_wrap=True)
    grid.add_row(spinner, words, *rest)
    return grid


#: Seconds between plain lines while a command does the same thing (a heartbeat in a log).
EVERY_S = 30.0
#: The fewest seconds between two plain lines: a tuner reporting rounds fills no log.
MIN_GAP_S = 2.0

Line = TuneLine | StatusLine | TrainLine


class PlainLines:
    """A progress line as plain text lines for a log: printed when its topic changes (at
    most once per ``min_gap_s``) and every ``every_s`` seconds while it stays the same.

    :meth:`tick` decides and prints; :func:`live` calls it from a thread every second, and
    a caller may call it on each report (``train`` does, so that a line can follow every
    step when ``every_s`` is 0).
    """

    def __init__(
        self,
        line: Line,
        stream: TextIO,
        *,
        every_s: float = EVERY_S,
        min_gap_s: float = MIN_GAP_S,
        clock: Clock = time.monotonic,
    ) -> None:
        self.line, self.stream, self.clock = line, stream, clock
        self.every_s, self.min_gap_s = every_s, min_gap_s
        self.printed_topic: str | None = None
        self.printed_at = -math.inf
        self.lock = threading.Lock()

    def tick(self) -> bool:
        """Print the line if it is due; whether it printed."""
        with self.lock:
            now, topic = self.clock(), self.line.topic()
            since = now - self.printed_at
            changed = topic != self.printed_topic and since >= min(self.min_gap_s, self.every_s)
            if not (changed or since >= self.every_s):
                return False
            self.stream.write(self.line.plain() + "\n")
            self.stream.flush()
            self.printed_topic, self.printed_at = topic, now
            return True


@contextlib.contextmanager
def live(
    line: Line, *, every_s: float = EVERY_S, stream: TextIO | None = None
) -> Iterator[PlainLines | None]:
    """Draw ``line`` while the block runs: live on stderr when it is a terminal (yields None),
    else as :class:`PlainLines` on ``stream`` (default stdout) every ``every_s`` seconds
    (yields them).

    The live line is transient: it disappears when the block ends, leaving what was printed
    above it.
    """
    if not Console(stderr=True).is_terminal:
        plain = PlainLines(line, stream or sys.stdout, every_s=every_s)
        with _plain_lines(plain) as lines:
            yield lines
        return
    # stdout is only taken over when it is the same terminal: `tune > log.txt` keeps its file.
    same_terminal = os.isatty(1)
    with (
        _captured() as console,
        Live(
            line,
            console=console,
            refresh_per_second=4,
            transient=True,
            redirect_stdout=same_terminal,
        ),
    ):
        yield None


@contextlib.contextmanager
def _plain_lines(lines: PlainLines) -> Iterator[PlainLines]:
    """``lines`` ticked every second by a daemon thread while the block runs."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(1.0):
            lines.tick()

    lines.tick()  # what it starts with
    thread = threading.Thread(target=beat, name="torchturbo-progress", daemon=True)
    if lines.every_s > 0:  # at 0 every report prints, and the caller ticks on each one
        thread.start()
    try:
        yield lines
    finally:
        stop.set()
        if thread.is_alive():
            thread.join(timeout=2.0)


@contextlib.contextmanager
def _captured() -> Iterator[Console]:
    """A console on the terminal, while descriptor 2 (and 1, if on the same terminal) feed a pipe.

    A thread prints each line from the pipe through the console, dimmed, so that it lands above
    a live display. On exit the descriptors are restored; lines written later by processes that
    inherited the pipe (loader workers) are still printed.
    """
    targets = [2] + ([1] if os.isatty(1) else [])
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = {fd: os.dup(fd) for fd in targets}
    terminal = os.fdopen(os.dup(saved[2]), "w", encoding="utf-8", errors="replace")
    console = Console(file=terminal)
    read_end, write_end = os.pipe()
    for fd in targets:
        os.dup2(write_end, fd)
    os.close(write_end)
    forwarder = threading.Thread(target=_forward, args=(read_end, console), daemon=True)
    forwarder.start()
    try:
        yield console
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)
        # The pipe ends when no process holds its write end; a worker process that inherited it
        # may keep it open, and then the daemon thread simply keeps forwarding.
        forwarder.join(timeout=1.0)
        if not forwarder.is_alive():
            terminal.close()


def _forward(read_end: int, console: Console) -> None:
    with os.fdopen(read_end, "rb") as pipe:
        for raw in pipe:
            line = Text(raw.decode("utf-8", "replace").rstrip("\r\n"), style="dim")
            console.print(line, soft_wrap=True)  # the terminal wraps it: copied, it is one line
