"""Writing into the report's output folder: checked up front, every file replaced atomically.

Every file is written to a temporary name in the output folder and renamed into place, so an
interrupted run leaves the previous file or the new one, never half of one.
"""

from __future__ import annotations

import errno
import os
import secrets
from pathlib import Path


def write_atomic(path: Path, data: bytes) -> None:
    """Write beside ``path`` under a temporary name, then rename over it (atomic on POSIX)."""
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with open(temporary, "xb") as f:  # open(), not mkstemp: the file keeps the umask's mode
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def prepare_dir(out_dir: Path) -> None:
    """Create ``out_dir`` if missing; fail naming it when it is a file or cannot be written."""
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(
            errno.ENOTDIR, "the report's output path exists and is not a folder", str(out_dir)
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise PermissionError(
            errno.EACCES, "the report's output folder is not writable", str(out_dir)
        )
