"""The report's output folder, checked up front so that hours of tuning are not lost to it.

Files go into it through :func:`torchturbo.results.write_atomic` (temporary name, then rename).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path


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
