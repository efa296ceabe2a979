"""Checkpoint directories on disk: atomic, checksummed, the last K kept, safe to load.

A checkpoint is a directory ``<root>/ckpt-<step>/`` of named files (``*.pt`` written by
``torch.save``, ``*.json``, ``*.toml``) and a ``manifest.json`` with the SHA-256 of each file.

- **Atomic**: the files are written into ``<root>/.tmp-ckpt-<step>-<pid>/``, each fsynced, the
  manifest last; then the directory is renamed to its final name and the root is fsynced. A
  crash at any moment leaves either a complete checkpoint or a temporary directory that is
  ignored (and removed by the next save); a write that fails removes its temporary directory at
  once, and older checkpoints are pruned only after the new one is in place.
- **Checked**: loading hashes every file it reads and compares it with the manifest, so a
  truncated or corrupted checkpoint is detected; :func:`read_latest` then falls back to the
  previous one with a warning. Under torchrun each rank reads (and verifies) only its files
  (``select``), and the ranks fall back together (``any_failed``).
- **Streamed**: each file is written straight to its temporary path while its SHA-256 is
  computed, and ``.pt`` files are loaded with ``torch.load(mmap=True)``: the state is never
  held a second time in memory (``benchmarks/checkpoint_memory.py`` measures it).
- **Safe**: ``.pt`` files are read with ``torch.load(weights_only=True)``, which rebuilds tensors
  and plain containers only: a checkpoint never executes code (a pickled callable is refused).

What goes *into* a checkpoint is the engine's business (``torchturbo.engine.state``). Why
hand-written: ``torch.distributed.checkpoint`` targets sharded state and neither keeps the last K
nor checksums files; safetensors holds flat tensors only, not optimizer state.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch

MANIFEST = "manifest.json"
#: Subdirectory of files written by others (``torch.distributed.checkpoint`` shards, one set per
#: rank): checksummed like the rest, read by their writer rather than decoded here.
SHARDS = "shards"
_NAME = re.compile(r"^ckpt-(\d{10})$")
_FORMAT = 1
_CHUNK = 4 * 2**20  # bytes hashed at a time when verifying


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt or unsafe; the message names the path and the problem."""


def write_checkpoint(
    root: str | Path,
    step: int,
    files: Mapping[str, Any],
    keep_last: int,
    *,
    shards: Path | None = None,
) -> Path:
    """Write ``files`` (name -> object) as checkpoint ``step`` under ``root``; keep the last K.

    Objects of ``.pt`` names go through ``torch.save``, ``.json`` through ``json``, ``.toml``
    must be text. ``shards``, a directory on the same filesystem, is moved in as ``SHARDS/``
    and its files are checksummed too. Returns the checkpoint directory. A write that fails (a
    full disk, a file size limit) removes its temporary directory and leaves the checkpoints
    already saved as they were; the :class:`CheckpointError` names the path and the system's
    reason.
    """
    root = Path(root)
    final = root / checkpoint_name(step)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as err:
        raise CheckpointError(
            f"cannot write a checkpoint in {str(root)!r}: {err.strerror or err}"
        ) from err
    try:
        digests = {name: _write_file(tmp / name, obj) for name, obj in files.items()}
        if shards is not None:
            shards.rename(tmp / SHARDS)
            for shard in sorted((tmp / SHARDS).iterdir()):
                digests[f"{SHARDS}/{shard.name}"] = file_digest(shard)
        manifest = {"format": _FORMAT, "step": step, "files": digests}
        _write_file(tmp / MANIFEST, manifest)
        _fsync_dir(tmp)
        _rename_into_place(tmp, final)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(err, OSError):
            raise
        raise CheckpointError(_failed_write(root, final, files, err)) from err
    _fsync_dir(root)
    _prune(root, keep_last)
    return final


def _failed_write(root: Path, final: Path, files: Mapping[str, Any], err: OSError) -> str:
    """One sentence for a write that failed: why, and for a full disk what it needed and had,
    and the checkpoint that is kept."""
    reason = err.strerror or str(err)
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            free = f", {format_bytes(free_space(root))} free"
        except OSError:
            free = ""
        needed = format_bytes(payload_bytes(files))
        reason += f" in {str(root)!r} (the checkpoint needs about {needed}{free})"
    kept = next((p for p in list_checkpoints(root) if p != final), None)
    before = (
        f"the newest checkpoint kept is {str(kept)!r}, intact"
        if kept is not None
        else "no checkpoint was saved before it"
    )
    return f"cannot write checkpoint {str(final)!r}: {reason}; nothing of it was kept, and {before}"


def payload_bytes(files: Mapping[str, Any]) -> int:
    """The bytes of the tensors in ``files`` (what a checkpoint of them is mostly made of)."""
    total, pending = 0, list(files.values())
    while pending:
        item = pending.pop()
        if isinstance(item, torch.Tensor):
            total += item.numel() * item.element_size()
        elif isinstance(item, Mapping):
            pending.extend(item.values())
        elif isinstance(item, (list, tuple)):
            pending.extend(item)
    return total


def free_space(directory: str | Path) -> int:
    """Bytes an unprivileged writer may still use on ``directory``'s file system."""
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize


def format_bytes(count: int) -> str:
    """``1.5 MiB``: sizes in messages (``output.tables`` would import rich for this)."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{count} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _rename_into_place(tmp: Path, final: Path) -> None:
    """Rename the complete ``tmp`` to ``final``; an existing ``final`` (the same step saved
    again) is replaced only once the rename has succeeded, and put back if it failed."""
    if not final.exists():
        tmp.rename(final)
        return
    old = final.with_name(f".old-{final.name}-{os.getpid()}")
    shutil.rmtree(old, ignore_errors=True)
    final.rename(old)
    try:
        tmp.rename(final)
    except BaseException:
        old.rename(final)
        raise
    shutil.rmtree(old, ignore_errors=True)


def checkpoint_name(step: int) -> str:
    """The directory name of checkpoint ``step``: zero-padded, so names sort as steps do."""
    return f"ckpt-{step:010d}"


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete-looking checkpoint directories under ``root``, newest (highest step) first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name)]
    return sorted(found, key=lambda p: p.name, reverse=True)


#: Chooses, from the names a manifest lists, those this process reads (all by default).
Select = Callable[[Collection[str]], Collection[str]]
#: Says what a checkpoint at a path, whose manifest lists these names, lacks (None: nothing).
Required = Callable[[Path, Collection[str]], str | None]


def read_checkpoint(
    path: str | Path, select: Select | None = None, required: Required | None = None
) -> dict[str, Any]:
    """Verify and read one checkpoint directory: ``{file name: object}`` (the manifest excluded;
    files under ``SHARDS/`` are verified, not returned). ``select`` limits both to the names it
    returns: what this rank reads. A manifest that lacks a file the directory holds, or one that
    ``required`` asks for, is damaged: the checkpoint fails as a corrupt file does."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_bytes())
        digests = manifest["files"]
        if manifest.get("format") != _FORMAT or not isinstance(digests, dict):
            raise ValueError(f"unknown manifest format {manifest.get('format')!r}")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"checkpoint {str(path)!r} has no readable manifest: {err}") from err
    for name in digests:
        if not _is_member(name):
            # A hand-edited manifest must not make loading read outside the checkpoint.
            raise CheckpointError(
                f"checkpoint {str(path)!r}: its manifest lists {name!r}, which is not a file "
                "name of the checkpoint"
            )
    _check_listing(path, digests, required)
    wanted = set(digests) if select is None else set(select(list(digests)))
    out: dict[str, Any] = {}
    for name, expected in digests.items():
        if name not in wanted:
            continue
        try:
            actual = file_digest(path / name)
        except OSError as err:
            raise CheckpointError(f"checkpoint {str(path)!r}: cannot read {name}: {err}") from err
        if actual != expected:
            raise CheckpointError(
                f"checkpoint {str(path)!r}: {name} fails its checksum (SHA-256 {actual[:12]}..., "
                f"manifest says {str(expected)[:12]}...): the file is truncated or corrupt"
            )
        if not name.startswith(f"{SHARDS}/"):
            out[name] = _decode(path / name)
    return out


def _check_listing(path: Path, digests: Mapping[str, Any], required: Required | None) -> None:
    """Raise when the manifest does not list a file of the directory, or lacks a required one."""
    try:
        # Hidden files (a file manager's .DS_Store) are no part of it.
        held = {p.name for p in path.iterdir() if p.is_file() and not p.name.startswith(".")}
        held.discard(MANIFEST)
    except OSError as err:
        raise CheckpointError(f"checkpoint {str(path)!r} cannot be listed: {err}") from err
    unlisted = sorted(held - set(digests))
    if unlisted:
        raise CheckpointError(
            f"checkpoint {str(path)!r}: its manifest does not list {', '.join(unlisted)}, which "
            "the checkpoint holds: the manifest is damaged"
        )
    lacking = required(path, list(digests)) if required is not None else None
    if lacking:
        raise CheckpointError(f"checkpoint {str(path)!r}: {lacking}")


def file_digest(path: Path) -> str:
    """The SHA-256 of the file at ``path``, read in chunks (never the whole file at once)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _is_member(name: Any) -> bool:
    """Whether ``name`` names a file of a checkpoint: a plain file name, or one in ``SHARDS/``."""
    if not isinstance(name, str):
        return False
    folder, _, file = name.rpartition("/")
    plain = file not in ("", ".", "..", MANIFEST) and Path(file).name == file
    return plain and folder in ("", SHARDS)


def read_latest(
    root: str | Path,
    select: Select | None = None,
    any_failed: Callable[[bool], bool] = bool,
    required: Required | None = None,
) -> tuple[Path, dict[str, Any]]:
    """The newest checkpoint under ``root`` that verifies, warning about each one skipped.

    ``root`` may also be one checkpoint directory, which is then read strictly. ``select`` and
    ``required`` are :func:`read_checkpoint`'s; ``any_failed`` turns this process's verdict on a
    checkpoint into everyone's (under torchrun: whether any rank found its files corrupt), so
    that all ranks fall back to the same one.
    """
    root = Path(root)
    if (root / MANIFEST).exists():
        return root, read_checkpoint(root, select, required)
    candidates = list_checkpoints(root)
    if not candidates:
        where = "does not exist" if not root.exists() else "holds no checkpoint (ckpt-*/)"
        raise CheckpointError(f"cannot resume: {str(root)!r} {where}")
    failures = []
    for path in candidates:
        failure, state = None, {}
        try:
            state = read_checkpoint(path, select, required)
        except CheckpointError as err:
            failure = str(err)
        if any_failed(failure is not None):
            failures.append(failure or f"checkpoint {str(path)!r} failed to verify on another rank")
            continue
        for skipped in failures:
            warnings.warn(f"{skipped}; falling back to {path.name}", RuntimeWarning, stacklevel=3)
        return path, state
    raise CheckpointError(
        f"cannot resume from {str(root)!r}: no checkpoint verifies: " + "; ".join(failures)
    )


class _HashingWriter:
    """A binary file that hashes what it writes: ``torch.save`` streams into it.

    It keeps the error of a failed write: ``torch.save`` turns it into a RuntimeError about
    its archive (``unexpected pos 1728 vs 1620``), which names no reason and no file.
    """

    def __init__(self, handle: BinaryIO) -> None:
        self.handle = handle
        self.digest = hashlib.sha256()
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        self.digest.update(data)
        try:
            return self.handle.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self.handle.flush()


def _write_file(path: Path, obj: Any) -> str:
    """Encode ``obj`` by the file name's suffix (``.pt``: ``torch.save``, ``.json``, ``.toml``:
    text) straight into ``path``, fsync it and return its SHA-256."""
    if path.suffix not in (".pt", ".json", ".toml"):
        raise ValueError(f"checkpoint file {path.name!r}: expected a .pt, .json or .toml name")
    with open(path, "wb") as handle:
        writer = _HashingWriter(handle)
        if path.suffix == ".pt":
            try:
                torch.save(obj, writer)  # type: ignore[arg-type]  # any object with write()
            except RuntimeError:
                if writer.error is None:
                    raise
                raise writer.error from None  # the system's reason (a full disk), not torch's
        else:
            text = json.dumps(obj, indent=1) if path.suffix == ".json" else str(obj)
            writer.write(text.encode())
        handle.flush()
        os.fsync(handle.fileno())
    return writer.digest.hexdigest()


def _decode(path: Path) -> Any:
    if path.suffix == ".pt":
        try:
            # mmap: tensors are views of the file's pages, not a second copy read into memory.
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as err:  # weights_only refuses anything but tensors and plain data
            raise CheckpointError(
                f"checkpoint file {str(path)!r} was refused by torch.load(weights_only=True): it "
                f"holds something other than tensors and plain data ({err})"
            ) from err
    try:
        data = path.read_bytes()
        return json.loads(data) if path.suffix == ".json" else data.decode()
    except OSError as err:
        raise CheckpointError(f"checkpoint {str(path)!r}: cannot read {path.name}: {err}") from err
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"checkpoint file {str(path)!r} cannot be read: {err}") from err


def _fsync_dir(path: Path) -> None:
    """Make a rename or new entry in ``path`` durable (POSIX; a no-op where dirs cannot open)."""
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _prune(root: Path, keep_last: int) -> None:
    """Delete checkpoints beyond the newest ``keep_last``, and temporaries of dead saves."""
    for old in list_checkpoints(root)[keep_last:]:
        shutil.rmtree(old, ignore_errors=True)
    for pattern in (".tmp-ckpt-*", ".old-ckpt-*"):
        for tmp in root.glob(pattern):
            if not tmp.name.endswith(f"-{os.getpid()}"):
                shutil.rmtree(tmp, ignore_errors=True)
