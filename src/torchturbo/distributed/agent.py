"""torchrun's agent in this process, with the stop signals reaching the workers.

torchrun's agent handles SIGTERM, SIGINT, SIGHUP and SIGQUIT by raising ``SignalException``
inside itself: it forwards the signal, waits for its workers, then exits 1 with a traceback,
whatever the workers did. SIGUSR1 and SIGUSR2 (what SLURM's ``--signal`` sends) it does not
handle at all: they kill the agent (exit 138) while the workers, in sessions of their own, train
on unsupervised. :func:`run_agent` runs the same agent (``torch.distributed.run``, every option
of torchrun) with those four stop signals taken from it: each one is passed on to every worker
as it is, and the agent goes on supervising them, so that they stop after the step under way,
save it and exit, and their exit codes come back (:class:`AgentResult`). Nothing else changes:
SIGHUP and SIGQUIT, restarts, rendezvous and worker failures are torchrun's.

The workers are found as this process's children in ``/proc`` (the agent starts them itself);
where there is no ``/proc``, torchrun keeps the signals and its own forwarding.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Signals the agent leaves to torchrun when this module forwards the stop signals.
_TORCHRUN_KEEPS = "SIGHUP,SIGQUIT"


@dataclass
class AgentResult:
    """How the workers ended: exit code by global rank for those that failed (a negative code:
    killed by that signal), and the stop signals this process passed on, in order."""

    failures: dict[int, int] = field(default_factory=dict)
    forwarded: list[int] = field(default_factory=list)


def run_agent(argv: Sequence[str], stop_signals: Sequence[int], *, quiet: bool) -> AgentResult:
    """Run torchrun with ``argv`` (its options, then the script or ``-m module`` and its
    arguments) in this process, forwarding ``stop_signals`` to the workers. ``quiet`` hides the
    agent's log lines (see :func:`_agent_logs`)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(list(argv))
    result = AgentResult()
    forwarding = Path("/proc").is_dir()
    if forwarding:
        args.signals_to_handle = _TORCHRUN_KEEPS
    elif stop_signals:
        names = {signal.Signals(s).name for s in stop_signals} | set(_TORCHRUN_KEEPS.split(","))
        args.signals_to_handle = ",".join(sorted(names))
    with _agent_logs(quiet), _forwarded(stop_signals if forwarding else (), result):
        try:
            run(args)
        except ChildFailedError as err:
            result.failures = {rank: failure.exitcode for rank, failure in err.failures.items()}
    return result


@contextlib.contextmanager
def _forwarded(stop_signals: Sequence[int], result: AgentResult) -> Iterator[None]:
    def forward(signum: int, frame: Any) -> None:
        result.forwarded.append(signum)
        for pid in children():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    previous = {signum: signal.signal(signum, forward) for signum in stop_signals}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def children(parent: int | None = None) -> list[int]:
    """The pids of ``parent``'s (this process's) child processes, read from ``/proc``."""
    parent = os.getpid() if parent is None else parent
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # ended meanwhile, or not ours to read
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        fields = stat.rpartition(")")[2].split()
        if len(fields) > 1 and int(fields[1]) == parent:
            found.append(int(entry.name))
    return found


@contextlib.contextmanager
def _agent_logs(quiet: bool) -> Iterator[None]:
    """With ``quiet``, the agent's log lines are not shown while it runs: its report of a
    worker's end (a status 75 reads as ``failed (exitcode: 75)``) is the launcher's to say in
    one line, and an error of its own reaches the caller as an exception. Each of its modules'
    loggers has its own level (``torch.distributed.elastic.utils.logging``): all are set."""
    loggers = [
        logger
        for name, logger in logging.root.manager.loggerDict.items()
        if name.startswith(("torch.distributed.elastic", "torch.distributed.run"))
        and isinstance(logger, logging.Logger)
    ]
    levels = [logger.level for logger in loggers]
    if quiet:
        for logger in loggers:
            logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
