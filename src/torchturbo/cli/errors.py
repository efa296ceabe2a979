"""What the user sees of an error: one line for an error they can fix, the traceback for a bug.

An error the user can fix (bad argument, config, recipe code or data, checkpoint, file system)
prints one readable line, ``torchturbo CMD: error: ...``; warnings print one line each.
"""

from __future__ import annotations

import argparse
import contextlib
import dis
import re
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: torchturbo's source directory (this module is in its cli/ package).
_PACKAGE = Path(__file__).resolve().parents[1]


def error_line(err: Exception, args: argparse.Namespace) -> str | None:
    """The one line for an error the user can fix; None for a bug of torchturbo (traceback).

    Those are: torchturbo's own errors (they name the field, file or function); failures of
    the user's code or data (``recipe.user_code_failure``); out of memory; the file system's
    errors; and ValueErrors that a ``raise`` in torchturbo's source threw on bad input.
    """
    import torch

    from torchturbo.recipe import describe_exception, is_torchturbo_error, user_code_failure
    from torchturbo.reliability.guard import BACKWARD_INSIDE, backward_inside

    if is_torchturbo_error(err):
        line = str(err)
    elif isinstance(err, torch.OutOfMemoryError):
        line = (
            f"out of memory: {describe_exception(err)}; lower the batch size, or let "
            "[reliability] auto_microbatch = true split it"
        )
    elif backward_inside(err) and (failure := user_code_failure(err)) is not None:
        located = re.search(r"\(([^()]+:\d+[^()]*)\)$", failure)
        line = BACKWARD_INSIDE + (f" ({located[1]})" if located else "")
    elif (failure := user_code_failure(err)) is not None:
        line = f"{failure}; --debug shows the traceback"
    elif isinstance(err, OSError):
        where = f": {str(err.filename)!r}" if err.filename is not None else ""
        line = f"{err.strerror or describe_exception(err)}{where}"
    elif isinstance(err, ValueError) and _raised_by_torchturbo(err):
        line = str(err)
    else:
        return None
    return _naming_the_option(" ".join(line.split()), args)


def _raised_by_torchturbo(err: BaseException) -> bool:
    """Whether a ``raise`` statement in torchturbo's source threw ``err`` (not torch, called by
    torchturbo with something it should have checked): the instruction that raised it, in the
    innermost frame, is a RAISE_VARARGS of torchturbo's code."""
    last = err.__traceback__
    while last is not None and last.tb_next is not None:
        last = last.tb_next
    if last is None:
        return False
    code = last.tb_frame.f_code
    ours = Path(code.co_filename).resolve().is_relative_to(_PACKAGE)
    instruction = code.co_code[last.tb_lasti] if 0 <= last.tb_lasti < len(code.co_code) else None
    return ours and instruction == dis.opmap["RAISE_VARARGS"]


def _naming_the_option(line: str, args: argparse.Namespace) -> str:
    """Add which option a path in the message came from: ``... (--checkpoint-dir)``."""
    for dest, value in vars(args).items():
        option = "--" + dest.replace("_", "-")
        quoted = isinstance(value, Path) and re.search(rf"'{re.escape(str(value))}[^']*'", line)
        if quoted and option not in line:
            return f"{line} ({option})"
    return line


@contextlib.contextmanager
def warnings_as_lines(command: str) -> Iterator[None]:
    """Show each warning as one ``torchturbo CMD: warning: ...`` line (Python shows two)."""

    def show(message: Any, *_args: Any, **_kwargs: Any) -> None:
        print(f"torchturbo {command}: warning: {' '.join(str(message).split())}", file=sys.stderr)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield
