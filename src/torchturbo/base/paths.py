"""A path that cannot be used because of a loop of symbolic links, found and named.

``Path.exists()`` says False for a link that leads back to itself, and ``mkdir`` then fails with
"File exists": a user is told that a folder is missing, or there, when it is neither. The
commands ask :func:`symlink_loop` first and say what it is.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path


def symlink_loop(path: str | Path) -> Path | None:
    """The first of ``path`` and its parents that is a link in a loop of links; None if none."""
    path = Path(path)
    for candidate in (path, *path.parents):
        if not candidate.is_symlink():
            continue
        try:
            os.stat(candidate)
        except OSError as err:
            if err.errno == errno.ELOOP:
                return candidate
    return None


def loop_words(loop: Path, target: str = "a real directory") -> str:
    """What to tell the user about ``loop`` (from :func:`symlink_loop`), a path that should lead
    to ``target``."""
    return (
        f"{str(loop)!r} is a loop of symbolic links (it leads back to itself): point it at "
        f"{target}, or give another path"
    )
