"""One run at a time in a directory: a lock that a crashed run does not leave behind.

Two runs writing one checkpoint directory (a job launched twice by mistake, as happens on
clusters) interleave their checkpoints, so that a resume continues from the other run's state,
and each one's pruning deletes the other's temporary files; two tunes into one ``--out`` mix
their reports. :func:`hold_directory` takes an exclusive, non-blocking ``flock`` on
``<dir>/.lock`` and writes its owner there (pid, host, start time, command); a second run is
refused at once with a :class:`CheckpointError` that names the first, and the directory as its
:class:`Owner` words it.

The kernel releases a ``flock`` when its process ends, however it ends (SIGKILL and power loss
included: a lock is no state on disk), so a crashed run leaves nothing stuck; the file it leaves
only names the last owner (a run that ends normally removes it). Forked children (DataLoader
workers, which may outlive a killed parent by seconds) close their copy at once.

Why ``flock`` and not a pid file: a pid file outlives a crash and must be judged alive by a pid
that may have been reused, and cannot be judged at all from another host. Why not POSIX
``fcntl`` locks: they are dropped when *any* descriptor of the file closes in the process. On
Linux, NFS clients emulate ``flock`` with byte-range locks, which the server sees from every
host. A file system without locks (ENOLCK, EOPNOTSUPP) gets a warning and an unlocked run rather
than no run.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchturbo.resume.files import CheckpointError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no flock
    fcntl = None  # type: ignore[assignment]

#: The lock file in a checkpoint directory (hidden: no checkpoint name matches it).
LOCK_NAME = ".lock"
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)
#: Lock descriptors this process holds: a forked child (a DataLoader worker) closes its copies,
#: so that only this process keeps the lock alive (a worker may outlive a killed parent).
_HELD: set[int] = set()


@dataclass(frozen=True)
class Owner:
    """What a locked directory is, for the messages: ``what`` names it ("checkpoint directory"),
    ``clash`` says what two runs writing it would do."""

    what: str
    clash: str


CHECKPOINTS = Owner(
    "checkpoint directory", "two runs writing one directory would interleave their checkpoints"
)


def _close_held_in_child() -> None:
    for descriptor in list(_HELD):
        with contextlib.suppress(OSError):
            os.close(descriptor)
    _HELD.clear()


os.register_at_fork(after_in_child=_close_held_in_child)


@contextlib.contextmanager
def hold_directory(directory: str | Path, owner: Owner = CHECKPOINTS) -> Iterator[Path]:
    """Own ``directory`` (which must exist) for the block; yields the lock file's path.

    Raises :class:`CheckpointError` when another process holds it, naming that process from its
    record, and the directory as ``owner`` names it.
    """
    path = Path(directory) / LOCK_NAME
    descriptor, locked = _open_locked(path, directory, owner)
    try:
        if locked:
            _write_owner(descriptor)
        _HELD.add(descriptor)
        yield path
    finally:
        _HELD.discard(descriptor)
        if locked:  # removed while held: a run that opened it since finds it gone and retries
            with contextlib.suppress(OSError):
                path.unlink()
        os.close(descriptor)  # releases the lock


def _open_locked(path: Path, directory: str | Path, owner: Owner) -> tuple[int, bool]:
    """The lock file's descriptor, locked (or False where locks are unsupported). A file that
    its owner removed between our open and our lock is another inode than the path's: retry."""
    while True:
        try:
            descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as err:
            raise CheckpointError(
                f"cannot lock {owner.what} {str(directory)!r}: {err.strerror or err}"
            ) from err
        try:
            locked = _lock(descriptor, directory, owner)
            if not locked or _same_file(path, descriptor):
                return descriptor, locked
        except BaseException:
            os.close(descriptor)
            raise
        os.close(descriptor)


def _same_file(path: Path, descriptor: int) -> bool:
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(descriptor)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def _lock(descriptor: int, directory: str | Path, owner: Owner) -> bool:
    """Take the lock on ``descriptor``: True when held, False on a file system without locks;
    raises when another process holds it."""
    if fcntl is None:  # pragma: no cover - Windows
        return False
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno in _NO_LOCKS:
            warnings.warn(
                f"{owner.what} {str(directory)!r} is on a file system without file locks "
                f"({err.strerror}): a second run on it would not be refused",
                RuntimeWarning,
                stacklevel=4,
            )
            return False
        if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise
        raise CheckpointError(
            f"{owner.what} {str(directory)!r} is in use by another run "
            f"({describe_owner(_read_owner(descriptor))}): {owner.clash}; wait for it to end, "
            "stop it, or give another directory"
        ) from None
    return True


def owner_record() -> dict[str, Any]:
    """What the lock file says about this process."""
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime()),
        "command": " ".join([_program(), *sys.argv[1:]]),
    }


def _program() -> str:
    """``torchturbo`` for ``python -m torchturbo`` (whose argv[0] is its ``__main__.py``)."""
    path = Path(sys.argv[0] if sys.argv and sys.argv[0] else "python")
    return path.parent.name if path.name == "__main__.py" else path.name


def describe_owner(record: dict[str, Any] | None) -> str:
    """``pid 123 on host node7, started 2025-01-02 03:04:05 UTC: torchturbo train ...``."""
    if not record:
        return "its owner has not written its name yet"
    where = f"pid {record.get('pid')} on host {record.get('host')}"
    started = f", started {record['started']}" if record.get("started") else ""
    command = f": {record['command']}" if record.get("command") else ""
    return f"{where}{started}{command}"


def _write_owner(descriptor: int) -> None:
    data = json.dumps(owner_record()).encode()
    os.ftruncate(descriptor, 0)
    os.pwrite(descriptor, data, 0)
    # Not fsynced: the record is for the message only; the lock itself is no state on disk.


def _read_owner(descriptor: int) -> dict[str, Any] | None:
    try:
        data = os.pread(descriptor, 4096, 0)
        record = json.loads(data) if data else None
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None
