"""Preemption in another trainer's loop: stop between optimizer steps on a signal, as ``train``
does, with the trainer saving its own checkpoint.

:class:`StopWatch` holds ``reliability.preemption.stop_on_signals`` open while a trainer trains
(SIGTERM, SIGUSR1, SIGUSR2, Ctrl-C; under torchrun also the launcher's death) and says, at each
optimizer step boundary and on every rank alike, whether to stop there. The trainer's callback
then has the trainer save that step in its own format, which its own resume reads, and ends the
run with :class:`TrainerStopped`: a ``SystemExit`` of status 75, so that the code after
``trainer.train()`` (saving the "final" model, an evaluation) does not run on a stopped run, and a
requeue script sees 75, as from ``torchturbo train``. A second signal stops at once
(:class:`~torchturbo.reliability.preemption.StopNow`), keeping the checkpoints saved before.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

from torchturbo.reliability.preemption import EXIT_STOPPED, agree_to_stop, stop_on_signals


class TrainerStopped(SystemExit):
    """A stop signal ended training after optimizer step ``step``, saved in ``checkpoint``; exit
    status 75 (``reliability.preemption.EXIT_STOPPED``) when uncaught."""

    def __init__(self, signal_name: str, step: int, checkpoint: str, resume: str) -> None:
        super().__init__(EXIT_STOPPED)
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint
        self.line = (
            f"{signal_name}: stopped after optimizer step {step} and saved it in {checkpoint}; "
            f"{resume} to go on from there"
        )

    def __str__(self) -> str:
        return self.line


class StopWatch:
    """The stop signals, taken over while a trainer trains (:meth:`start` ... :meth:`close`)."""

    def __init__(self, grace_s: float = 0.0, *, take_over: tuple[str, ...] = ()) -> None:
        self.grace_s = grace_s
        #: Modules whose own handlers of the stop signals are replaced too (a trainer's, which
        #: would stop inside a step and save nothing, or save from inside the handler).
        self.take_over = take_over
        self._block = contextlib.ExitStack()
        self._request: Any = None

    def start(self) -> None:
        """Install the handlers (in the main thread; elsewhere nothing can stop the run)."""
        self.close()
        self._request = self._block.enter_context(
            stop_on_signals(
                grace_s=self.grace_s,
                watch_parent="TORCHELASTIC_RUN_ID" in os.environ,
                take_over=self.take_over,
            )
        )

    def should_stop(self, device: Any) -> bool:
        """At an optimizer step boundary, on every rank: whether any rank was asked to stop.
        A collective under torchrun: call it on every rank after every optimizer step."""
        return self._request is not None and agree_to_stop(self._request, device)

    @property
    def signal_name(self) -> str:
        return (self._request and self._request.signal_name) or "a signal"

    def close(self) -> None:
        """Give the signals back to the handlers found at :meth:`start`."""
        self._block.close()


def announce(line: str, rank: int) -> None:
    """Rank 0 says how the run stopped, on stderr (stdout may be a trainer's progress bar)."""
    if rank == 0:
        print(line, file=sys.stderr, flush=True)
