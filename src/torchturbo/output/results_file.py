"""Writing results to disk: atomically, and as JSON with the system they were measured on.

A figure without its machine and torch version cannot be compared with another, so every
benchmark and command that writes JSON goes through :func:`write_results`, which adds ``system``
(:func:`torchturbo.measure.machine.summary`) unless the payload has its own. Files are written to a
temporary name beside the target and renamed into place, so an interrupted run leaves the old
file or the new one, never half of one; a symbolic link is written through. ``-`` is standard
output.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torchturbo.measure.machine import summary


def write_atomic(path: Path, data: bytes) -> None:
    """Write beside ``path`` under a temporary name, then rename over it (atomic on POSIX).

    A symbolic link is written through, not replaced: the file it points to is the one
    renamed over (a ``results.json`` linked from a dashboard's folder stays linked).
    """
    path = Path(os.path.realpath(path)) if os.path.islink(path) else path
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with open(temporary, "xb") as f:  # open(), not mkstemp: the file keeps the umask's mode
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException as err:
        temporary.unlink(missing_ok=True)
        if isinstance(err, OSError) and err.errno is not None:  # name the file, not the temporary
            raise OSError(err.errno, err.strerror, str(path)) from err
        raise


#: The file name that means standard output, as for most command-line tools.
STDOUT = "-"


def write_results(path: str | Path, payload: Mapping[str, Any]) -> Path:
    """Write ``payload`` (plus ``system``) as indented JSON to ``path``, creating its folder;
    ``-`` writes it to standard output (the command then prints its tables to stderr)."""
    record = {**payload, "system": payload.get("system", summary())}
    text = json.dumps(record, indent=2)
    if str(path) == STDOUT:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
        return Path(STDOUT)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, text.encode())
    return path
