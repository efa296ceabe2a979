"""Stopping a training run between optimizer steps on a signal: preemption and Ctrl-C alike.

Clusters stop jobs with SIGTERM (SLURM before the time limit, or SIGUSR1/SIGUSR2 with
``--signal``; Kubernetes eviction; spot instances) and SIGKILL a grace period later. Stopped
inside a step, a run could only save half a window of gradients, so the first signal only *asks*
to stop (:class:`StopRequest`); the loop asks :func:`agree_to_stop` at every optimizer step
boundary and, once it says so, saves that step and stops. Under torchrun each rank receives the
signal at its own moment: the flag is all-reduced (MAX) at each boundary, so every rank stops
after the same step and saves the same checkpoint.

A second signal stops at once (:class:`StopNow` is raised wherever the main thread is; a
checkpoint being written is abandoned, and the one before it stays intact, see
``torchturbo.resume.files``). So does the grace period (``grace_s``) running out; should the main
thread be stuck in native code, the process exits 5 s later with ``os._exit``. A repeat of the
*same* signal within :data:`SAME_SIGNAL_S` counts as the first one: torchrun's agent forwards to
its workers the signal that a terminal or a scheduler already sent to the whole job.

A torchrun worker also watches its parent, the agent (``watch_parent``): torchrun dies of
SIGUSR1 and SIGUSR2, and of SIGKILL like any process, leaving its workers to train on in their own
sessions, where no terminal or scheduler signal reaches them; a worker whose parent is gone asks
to stop as on SIGHUP.

Handlers are installed only in the main thread and only over the default disposition (SIG_DFL,
Python's Ctrl-C handler, or torchrun's own handler in a process that inherited it): an ignored
signal or a user's handler is left alone. Why hand-written: Lightning and Composer do this
inside their trainers, not as a piece usable by another loop.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from torchturbo.base.stop_signals import STOP_SIGNALS

if TYPE_CHECKING:
    import torch

#: A repeat of the same signal this soon after it is the same request (torchrun forwarding).
SAME_SIGNAL_S = 2.0
#: How long the main thread has to unwind after a stop at once before the process exits.
HARD_EXIT_S = 5.0
#: How soon a stop that Python swallowed (raised in a weakref callback) is delivered again.
REDELIVER_S = 0.01
#: Seconds between two looks at whether a torchrun worker's parent (the agent) is alive.
PARENT_POLL_S = 0.5
#: The exit status of a run that stopped on a signal after saving its last step: BSD's
#: EX_TEMPFAIL, "try again later": a requeue script tests for it. Stopping at once exits with
#: 128 + the signal's number, as a process killed by it would.
EXIT_STOPPED = 75


class StopNow(KeyboardInterrupt):
    """A second signal (or the grace period) stopped the run at once, inside a step: the step
    under way is lost, the checkpoint saved before it is intact. A KeyboardInterrupt, so that
    code written for Ctrl-C stops on it too."""

    def __init__(self, signum: int, why: str) -> None:
        super().__init__(f"{signal.Signals(signum).name}: {why}")
        self.signum = signum
        self.exit_status = 128 + signum

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name


class StopRequest:
    """Set by the first stop signal; read between steps through :func:`agree_to_stop`."""

    def __init__(self) -> None:
        self._event = threading.Event()
        #: The signal this process received first (None while none came).
        self.signum: int | None = None
        #: The signal the ranks agreed to stop on (another rank's, when this one got none).
        self.agreed_signum: int | None = None

    def is_set(self) -> bool:
        return self._event.is_set()

    def set(self, signum: int) -> None:
        if self.signum is None:
            self.signum = signum
        self._event.set()

    @property
    def signal_name(self) -> str | None:
        signum = self.signum or self.agreed_signum
        return None if signum is None else signal.Signals(signum).name


def agree_to_stop(request: StopRequest, device: torch.device | str = "cpu") -> bool:
    """Whether to stop now: True on every rank as soon as any rank's ``request`` is set.

    Call it on every rank at every optimizer step boundary (under torchrun it is a one-element
    all-reduce, and every rank must call it equally often); ``device`` suits the backend (the
    engine's device: CUDA for NCCL). In one process it reads the flag and communicates nothing.
    """
    # Imported here: the CLI installs the handlers before torch is imported (seconds).
    import torch
    import torch.distributed as dist

    from torchturbo.distributed.launch import current_env

    if not current_env().is_distributed:
        return request.is_set()
    # The signal's number, 0 for none: the MAX says whether any rank asked, and with what.
    value = torch.tensor(request.signum or 0, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    agreed = int(value.item())
    if agreed:
        # Named, not set: this rank's own signal, if it comes later, is still its first.
        request.agreed_signum = agreed
    return agreed > 0


class _Stopper:
    """The handler behind one :func:`stop_on_signals` block, and what it remembers."""

    def __init__(self, announce: bool) -> None:
        self.request = StopRequest()
        self.announce = announce
        self.grace_s = 0.0
        self.first_at: float | None = None
        self.timers: list[threading.Timer] = []
        self.grace_over = threading.Event()
        self.closed = threading.Event()
        # The first request may come from the parent's watcher thread as well as a handler.
        self._first_lock = threading.RLock()

    def set_grace(self, grace_s: float) -> None:
        """Limit the time from the first signal to the stop (also when it came already)."""
        self.grace_s = grace_s
        if grace_s > 0 and self.first_at is not None and self.request.signum is not None:
            self._start_grace(self.request.signum, grace_s - (time.monotonic() - self.first_at))

    def _start_grace(self, signum: int, delay_s: float) -> None:
        if self.timers:  # started already
            return
        timer = threading.Timer(max(0.0, delay_s), self._end_grace, (signum,))
        timer.daemon = True
        self.timers.append(timer)
        timer.start()

    def _end_grace(self, signum: int) -> None:
        self.grace_over.set()
        # Runs on_signal in the main thread (a handler of ours: SIGHUP, the launcher gone, has
        # none, so the stop at once comes as the SIGTERM a scheduler would send).
        handled = signum if signum in STOP_SIGNALS else signal.SIGTERM
        _thread.interrupt_main(signal.Signals(handled))

    def on_signal(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if self._first(signum, now):
            return
        assert self.first_at is not None  # set by the first request
        if self.grace_over.is_set():
            self._stop_at_once(signum, f"the grace period of {self.grace_s:g} s ran out")
        if signum == self.request.signum and now - self.first_at < SAME_SIGNAL_S:
            return  # the same request, forwarded (torchrun's agent) or repeated at once
        self._stop_at_once(signum, "a second stop signal")

    def _first(self, signum: int, now: float, why: str = "") -> bool:
        """Take ``signum`` as the first request, if none came before; whether it was."""
        with self._first_lock:
            if self.first_at is not None:
                return False
            self.first_at = now
            self.request.set(signum)
        if self.announce:
            _announce(signum, self.grace_s, why)
        if self.grace_s > 0:
            self._start_grace(signum, self.grace_s)
        return True

    def parent_gone(self, parent: int) -> None:
        self._first(signal.SIGHUP, time.monotonic(), f"the launcher (pid {parent}) is gone")

    def _stop_at_once(self, signum: int, why: str) -> None:
        # Should the main thread not unwind (stuck in native code), leave anyway.
        hard = threading.Timer(HARD_EXIT_S, os._exit, (128 + signum,))
        hard.daemon = True
        self.timers.append(hard)
        hard.start()
        raise StopNow(signum, why)

    def cancel(self) -> None:
        self.closed.set()
        for timer in self.timers:
            timer.cancel()


#: The blocks of :func:`stop_on_signals` that are open, innermost last.
_OPEN: list[_Stopper] = []


@contextlib.contextmanager
def stop_on_signals(
    enabled: bool = True,
    *,
    grace_s: float = 0.0,
    announce: bool = True,
    watch_parent: bool = False,
    take_over: tuple[str, ...] = (),
) -> Iterator[StopRequest]:
    """Within the block, the first of :data:`STOP_SIGNALS` sets the yielded request instead of
    stopping the process; a second one raises :class:`StopNow`.

    ``grace_s`` > 0: that long after the first signal, stop at once as a second signal would.
    ``announce`` writes one line to stderr on the first signal (rank 0 only). ``watch_parent``
    (a torchrun worker) sets the request, as SIGHUP, once the parent process is gone.
    ``take_over`` names modules whose handlers are replaced too (a trainer's own). The
    previous handlers are back after the block. ``enabled=False`` yields a request nothing sets.
    Inside an open block (the CLI opens one before the slow imports, ``train`` another), a nested
    one yields the same request, with its own ``grace_s``: a signal that came before it counts.
    """
    if not (enabled and threading.current_thread() is threading.main_thread()):
        # Nothing to save: a worker whose launcher is gone ends as SIGHUP would end it.
        closed = threading.Event()
        if watch_parent:
            _watch_parent(closed, lambda parent: os.kill(os.getpid(), signal.SIGHUP))
        try:
            yield StopRequest()
        finally:
            closed.set()
        return
    if _OPEN:
        outer = _OPEN[-1]
        previous = outer.grace_s
        outer.set_grace(grace_s)
        try:
            yield outer.request
        finally:
            outer.grace_s = previous
        return
    stopper = _Stopper(announce)
    stopper.set_grace(grace_s)
    if watch_parent:
        _watch_parent(stopper.closed, stopper.parent_gone)
    installed = {}
    for signum in STOP_SIGNALS:
        previous_handler = signal.getsignal(signum)
        if _is_default(signum, previous_handler) or _module_of(previous_handler).startswith(
            take_over
        ):
            installed[signum] = previous_handler
            signal.signal(signum, stopper.on_signal)
    _OPEN.append(stopper)
    try:
        yield stopper.request
    finally:
        _OPEN.remove(stopper)
        stopper.cancel()
        for signum, previous_handler in installed.items():
            signal.signal(signum, previous_handler)


@contextlib.contextmanager
def raise_on_stop_signals() -> Iterator[None]:
    """Within the block, each of :data:`STOP_SIGNALS` raises :class:`StopNow` at once: for work
    that keeps its results as it goes and has no step to finish (the tuner, whose trials are
    thrown away). Installed over the default dispositions only, in the main thread only, as
    :func:`stop_on_signals` is; the previous handlers are back after the block.

    A handler raises wherever the main thread is, and Python swallows an exception raised
    inside a weakref callback or a ``__del__`` (it only prints "Exception ignored"): such a
    StopNow is delivered again at once (``sys.unraisablehook``), so that no stop is lost."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise StopNow(signum, "stopped at once")

    def deliver_again(unraisable: Any) -> None:
        if not isinstance(unraisable.exc_value, StopNow):
            previous_hook(unraisable)
            return
        # From another thread, a moment later: raised in this hook, it would be swallowed too
        # (and if it lands in another callback, this hook sends it once more). A signal, not
        # _thread.interrupt_main: it also wakes a main thread blocked in a sleep or a wait.
        main = threading.main_thread().ident
        assert main is not None
        args = (main, unraisable.exc_value.signum)
        timer = threading.Timer(REDELIVER_S, signal.pthread_kill, args)
        timer.daemon = True
        timer.start()

    installed = {}
    for signum in STOP_SIGNALS:
        previous_handler = signal.getsignal(signum)
        if _is_default(signum, previous_handler):
            installed[signum] = previous_handler
            signal.signal(signum, stop)
    previous_hook, sys.unraisablehook = sys.unraisablehook, deliver_again
    try:
        yield
    finally:
        sys.unraisablehook = previous_hook
        for signum, previous_handler in installed.items():
            signal.signal(signum, previous_handler)


def _watch_parent(closed: threading.Event, gone: Callable[[int], None]) -> None:
    """Call ``gone(parent)`` once this process's parent is gone, until ``closed`` is set.

    torchrun's agent killed (SIGKILL, out of memory, a signal it does not handle) leaves its
    workers training on unsupervised, in sessions of their own where no terminal or scheduler
    signal reaches them: each asks to stop, as on SIGHUP, instead. A parent's death is seen as a
    change of ``getppid()`` (to the reaper that adopted the process), every PARENT_POLL_S."""
    parent = os.getppid()
    if parent == 1:  # an orphan already, or init's own child: nothing to watch
        return

    def watch() -> None:
        while not closed.wait(PARENT_POLL_S):
            if os.getppid() != parent:
                gone(parent)
                return

    threading.Thread(target=watch, name="torchturbo-parent-watch", daemon=True).start()


def _is_default(signum: int, handler: Any) -> bool:
    """SIG_DFL, Python's Ctrl-C handler, or torchrun's agent handler (inherited by a process
    that runs the agent's code itself): dispositions that would end the run mid-step."""
    if handler is signal.SIG_DFL or handler is signal.default_int_handler:
        return True
    return getattr(handler, "__qualname__", "") == "_terminate_process_handler" and getattr(
        handler, "__module__", ""
    ).startswith("torch.distributed.elastic")


def _module_of(handler: Any) -> str:
    """The module a handler (a function, a bound method, a callable object) comes from."""
    return str(getattr(handler, "__module__", "") or "")


def _announce(signum: int, grace_s: float, why: str = "") -> None:
    if os.environ.get("RANK", "0") != "0":
        return
    limit = f"; stopping at once after {grace_s:g} s" if grace_s > 0 else ""
    name = signal.Signals(signum).name
    cause, as_on = (why, f", as on {name}") if why else (name, "")
    line = (
        f"{cause}: stopping after the optimizer step under way and saving it{as_on} (a second "
        f"signal, {SAME_SIGNAL_S:g} s or more later, stops at once{limit})\n"
    )
    # os.write, not print: a handler may run while the main thread is inside print itself.
    with contextlib.suppress(OSError):
        os.write(2, line.encode())
