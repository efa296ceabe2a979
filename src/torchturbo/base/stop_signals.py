"""The signals that stop a training run, and what a DataLoader worker does on one.

A leaf: the loader (``data/loader.py``) installs the worker's handler, and preemption
(``reliability/preemption.py``) turns the same signals into a stop between optimizer steps.
"""

from __future__ import annotations

import os
import signal
from typing import Any

#: Signals that ask a run to stop after the step under way.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


def leave_stop_signals_to_the_trainer(worker_id: int = 0) -> None:
    """A DataLoader worker's ``worker_init_fn``: end quietly (status 0) on a stop signal.

    SLURM and a terminal signal every process of a job, loader workers included. A worker that
    dies *of* the signal makes the DataLoader raise in the training process at once (its SIGCHLD
    handler), inside the step under way; one that exits with status 0 does not, and the
    training process finishes the step on the batches already fetched, saves it and stops. The
    signal cannot simply be ignored: the DataLoader ends persistent workers at exit with SIGTERM.
    """
    for signum in STOP_SIGNALS[1:]:  # SIGINT: torch's worker loop already exits quietly on it
        signal.signal(signum, _exit_quietly)


def _exit_quietly(signum: int, frame: Any) -> None:
    os._exit(0)
