"""``torchturbo launch``: torchrun, with every stop signal reaching the workers and one line
that says how the job ended (:mod:`torchturbo.distributed.agent`).

``torchturbo launch --nproc-per-node 2 -m torchturbo train ...`` takes torchrun's options and
command unchanged. SIGTERM, SIGINT, SIGUSR1 and SIGUSR2 sent to it (a scheduler signals the
launcher, not the workers it cannot see) go on to every worker, as they would were they sent
to the workers themselves: ``train`` saves the step under way and exits 75. torchrun itself
would exit 138 on SIGUSR1, its workers training on, and 1 with a traceback on SIGTERM.
"""

from __future__ import annotations

import argparse
import signal
from collections.abc import Sequence
from typing import Any

from torchturbo.cli.arguments import CommandParser

#: The exit status of a job some of whose workers refused their input (as ``train`` does).
EXIT_INPUT = 2


class _PassThrough(CommandParser):
    """Hands every argument after ``launch`` to torchrun, options included (argparse's
    REMAINDER would parse leading ``--nproc-per-node`` as an option of its own)."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        args = list(args or [])
        if not args or args[0] in ("-h", "--help"):
            return super().parse_known_args(args, namespace)
        parsed, _ = super().parse_known_args([], namespace)
        parsed.torchrun = args
        return parsed, []


def add_parser(commands: Any) -> None:
    """Add ``torchturbo launch`` to the parser's ``commands``."""
    launch = commands.add_parser(
        "launch",
        help="torchrun, with SIGTERM/SIGUSR1/SIGUSR2/Ctrl-C reaching the workers and one line "
        "saying how the job ended (75: stopped and saved)",
        description=(
            "Run torchrun's agent with its options and command as given (`torchturbo launch "
            "--nproc-per-node 2 -m torchturbo train ...`), except that SIGTERM, SIGINT, SIGUSR1 "
            "and SIGUSR2 sent to this process are passed on to every worker (torchrun dies of "
            "SIGUSR1, leaving its workers training on, and on SIGTERM exits 1 with a "
            "traceback). A worker of `train` whose launcher dies stops and saves on its own. "
            "Exit status: 0 every worker succeeded; 75 the workers stopped on a signal after "
            "saving their last step (run the same command with --resume); 2 a worker refused "
            "its input (its line is above); else the first failing worker's status (128+N: "
            "killed by signal N)."
        ),
    )
    launch.__class__ = _PassThrough
    launch.add_argument(
        "torchrun",
        nargs="*",
        metavar="TORCHRUN-ARGUMENTS",
        help="torchrun's options, then the script or -m module and its arguments",
    )
    launch.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from torchturbo.distributed.agent import run_agent
    from torchturbo.reliability.preemption import EXIT_STOPPED, STOP_SIGNALS

    if not args.torchrun:
        raise ValueError("give torchrun's options and a command, e.g. --nproc-per-node 2 -m ...")
    result = run_agent(args.torchrun, STOP_SIGNALS, quiet=not args.debug)
    if not result.failures:
        return 0
    status, line = outcome(result.failures, result.forwarded, EXIT_STOPPED)
    print(f"torchturbo launch: {line}", flush=True)
    return status


def outcome(failures: dict[int, int], forwarded: Sequence[int], stopped: int) -> tuple[int, str]:
    """(exit status, one line) for workers that did not all succeed: ``failures`` maps a global
    rank to its exit code (negative: killed by that signal); ``forwarded`` are the signals
    passed on; ``stopped`` the status of a worker that stopped after saving."""
    ranks = ", ".join(f"rank {rank}: {_status(code)}" for rank, code in sorted(failures.items()))
    signals = ", ".join(dict.fromkeys(signal.Signals(s).name for s in forwarded))
    got = f" on {signals}" if signals else " on a signal"
    if stopped in failures.values():
        # A rank exits 75 only once the checkpoint's closing barrier passed on every rank:
        # the others' later ends (torchrun stops them as soon as one exits) cost nothing.
        ended = ", ".join(
            f"rank {rank}: {'exit 75' if code == stopped else 'ended by torchrun after it'}"
            for rank, code in sorted(failures.items())
        )
        return stopped, (
            f"the workers stopped{got} after saving their last step ({ended}); run the same "
            "command with --resume to go on"
        )
    if EXIT_INPUT in failures.values():
        return EXIT_INPUT, f"a worker refused its input ({ranks}); its line is above"
    rank, code = min(failures.items())
    status = 128 - code if code < 0 else code
    return status, f"worker rank {rank} failed ({ranks}); torchrun stopped the others"


def _status(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
