"""Memory-mapped datasets: write a map-style dataset to disk once, read it through the page cache.

A dataset that is larger than RAM cannot live in a Python list or a tensor. Written here as one flat
binary file per field and read through ``numpy.memmap``, its pages are *file-backed* page cache:
the kernel reads them on demand and evicts them under pressure, and they never count as the
process's anonymous memory. Training then reads a 100 GB dataset with a resident footprint of a
few batches, and DataLoader workers share the same cached pages instead of each holding a copy.

On-disk layout (a directory)::

    manifest.json       format, version, structure, record count, one entry per field
    field<k>.bin        the field's records back to back, C order, raw little-endian values
    field<k>.offsets    int64[num_records + 1]: record i is rows offsets[i]:offsets[i+1]

A field's records share their dtype and their trailing shape (every dim after dim 0); dim 0 may
vary (token sequences), and the offsets give each record's start and length along it. 0-d fields
(a scalar label) take one row per record. Every file is readable with ``numpy.memmap`` and the
dtype and shape from the manifest, so nothing here is a bespoke binary format.

Why numpy.memmap and not a library: safetensors maps files too, but one file holds a fixed set of
named tensors written in one go from memory (its header, which precedes the data, needs every
tensor's size up front), so it can neither stream a larger-than-RAM dataset nor index records of
varying length; Arrow/HF ``datasets`` would add a heavy dependency for what two raw files per
field and ``numpy.memmap`` already do. numpy is a dependency already.
"""

from __future__ import annotations

import json
import math
import operator
import os
import shutil
import tempfile
from collections.abc import Sized
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import rich.progress
import torch
from torch.utils.data import Dataset, IterableDataset

FORMAT_NAME = "torchturbo.memmap"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
STRUCTURES = ("tensor", "tuple", "dict")

# Dtypes numpy cannot represent (bfloat16, float8 ...) are stored as integers of the same width
# and viewed back on read, so every torch dtype round-trips bit for bit.
_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_WRITE_BUFFER = 8 << 20  # large buffered writes: one syscall per 8 MiB, not per small record


class MemmapFormatError(ValueError):
    """A directory that is not a complete, readable memmap dataset; the message says why."""


@dataclass(frozen=True)
class _Field:
    """One field of the record structure, as stored in the manifest."""

    name: str
    dtype: torch.dtype
    record_ndim: int  # 0 for a scalar per record, else the rank of each record
    trailing_shape: tuple[int, ...]  # shape after dim 0; fixed for every record of the field
    storage_dtype: np.dtype  # what the data file holds; differs from dtype only for bfloat16 etc.
    rows: int  # total rows (dim-0 entries) over all records
    variable: bool  # True when records differ in their dim-0 length
    data_file: str
    offsets_file: str

    @property
    def row_bytes(self) -> int:
        return math.prod(self.trailing_shape) * self.storage_dtype.itemsize

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": str(self.dtype).removeprefix("torch."),
            "storage_dtype": self.storage_dtype.str,
            "record_ndim": self.record_ndim,
            "trailing_shape": list(self.trailing_shape),
            "rows": self.rows,
            "variable": self.variable,
            "data_file": self.data_file,
            "offsets_file": self.offsets_file,
        }


def _storage_dtypes(dtype: torch.dtype) -> tuple[torch.dtype, np.dtype]:
    """The dtype written to disk: ``dtype`` itself if numpy has it, else a same-width integer."""
    try:
        return dtype, torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError:
        storage = _SAME_WIDTH_INT.get(dtype.itemsize)
        if storage is None:
            raise ValueError(
                f"write_memmap: dtype {dtype} has neither a numpy equivalent nor a width in "
                f"{sorted(_SAME_WIDTH_INT)} bytes to store it as"
            ) from None
        return storage, torch.empty(0, dtype=storage).numpy().dtype


def _flatten(item: Any, index: int) -> tuple[str, list[str], list[torch.Tensor]]:
    """Split one record into (structure, field names, tensors)."""
    if isinstance(item, torch.Tensor):
        return "tensor", ["0"], [item]
    if isinstance(item, tuple):
        values = list(item)
        names = [str(k) for k in range(len(values))]
        structure = "tuple"
    elif isinstance(item, dict):
        bad = [k for k in item if not isinstance(k, str)]
        if bad:
            raise ValueError(f"write_memmap: record {index} has non-str dict keys {bad!r}")
        names, values, structure = list(item), list(item.values()), "dict"
    else:
        raise ValueError(
            f"write_memmap: record {index} is a {type(item).__name__}; allowed records are a "
            "tensor, a tuple of tensors or a dict of str -> tensor"
        )
    for name, value in zip(names, values, strict=True):
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"write_memmap: record {index} field {name!r} is a {type(value).__name__}; "
                "every field must be a torch.Tensor"
            )
    return structure, names, values


class _FieldWriter:
    """Streams one field: appends each record's bytes and its end offset, tracks dim-0 lengths."""

    def __init__(self, directory: Path, k: int, name: str, first: torch.Tensor, n: int) -> None:
        self.name = name
        self.dtype = first.dtype
        self.record_ndim = first.dim()
        self.trailing_shape = tuple(first.shape[1:])
        self.storage, self.storage_dtype = _storage_dtypes(first.dtype)
        self.data_file, self.offsets_file = f"field{k}.bin", f"field{k}.offsets"
        self.data = open(directory / self.data_file, "wb", buffering=_WRITE_BUFFER)  # noqa: SIM115
        # The index goes through a memmap too, so even it never has to fit in anonymous memory.
        self.offsets = np.memmap(directory / self.offsets_file, np.int64, "w+", shape=(n + 1,))
        self.offsets[0] = 0
        self.rows = 0
        self.first_length = 1 if first.dim() == 0 else first.shape[0]
        self.variable = False

    def append(self, i: int, value: torch.Tensor) -> None:
        if value.dtype != self.dtype or value.dim() != self.record_ndim:
            raise ValueError(
                f"write_memmap: record {i} field {self.name!r} is {value.dtype} with "
                f"{value.dim()} dims; record 0 set it to {self.dtype} with {self.record_ndim} dims"
            )
        if tuple(value.shape[1:]) != self.trailing_shape:
            raise ValueError(
                f"write_memmap: record {i} field {self.name!r} has shape {tuple(value.shape)}; "
                f"only dim 0 may vary, the rest must be {self.trailing_shape} as in record 0"
            )
        length = 1 if value.dim() == 0 else value.shape[0]
        self.variable |= length != self.first_length
        array = value.detach().cpu().contiguous().view(self.storage).numpy()
        if array.size:  # memoryview cannot cast an empty array
            self.data.write(array.data.cast("B"))
        self.rows += length
        self.offsets[i + 1] = self.rows

    def finish(self) -> _Field:
        """Flush and fsync both files: the manifest must never describe data not yet on disk."""
        self.data.flush()
        os.fsync(self.data.fileno())
        self.data.close()
        self.offsets.flush()
        del self.offsets
        return _Field(
            name=self.name,
            dtype=self.dtype,
            record_ndim=self.record_ndim,
            trailing_shape=self.trailing_shape,
            storage_dtype=self.storage_dtype,
            rows=self.rows,
            variable=self.variable,
            data_file=self.data_file,
            offsets_file=self.offsets_file,
        )

    def close(self) -> None:
        self.data.close()


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_memmap(dataset: Dataset, path: str | Path, *, progress: bool = False) -> Path:
    """Write every record of a map-style ``dataset`` to the directory ``path``; return the path.

    Records are a tensor, a tuple of tensors or a dict of tensors, with the same structure, dtypes
    and trailing shapes throughout (dim 0 may vary). Records are streamed one at a time, so the
    dataset may be larger than RAM. The directory appears atomically: everything is written and
    fsynced in a hidden temporary sibling that is renamed to ``path`` at the end, and removed if
    anything fails, so ``path`` either holds a complete dataset or does not exist.
    """
    if isinstance(dataset, IterableDataset) or not isinstance(dataset, Sized):
        raise ValueError(
            f"write_memmap: dataset must be map-style (__len__ and __getitem__), "
            f"got {type(dataset).__name__}"
        )
    n = len(dataset)
    if n == 0:
        raise ValueError("write_memmap: dataset is empty; there is no record to infer fields from")
    target = Path(path)
    if target.exists():
        raise FileExistsError(f"write_memmap: path {str(target)!r} already exists")
    target.parent.mkdir(parents=True, exist_ok=True)
    # A hidden sibling on the same filesystem, so that the final rename is atomic.
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        manifest = _write_records(
            dataset, n, staging, f"writing {target.name}" if progress else None
        )
        with open(staging / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(staging)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _fsync_dir(target.parent)
    return target


def _write_records(
    dataset: Dataset, n: int, directory: Path, progress: str | None
) -> dict[str, Any]:
    """Stream the records into one writer per field; return the manifest. ``progress``: a label."""
    structure, names, values = _flatten(dataset[0], 0)
    writers = [
        _FieldWriter(directory, k, name, value, n)
        for k, (name, value) in enumerate(zip(names, values, strict=True))
    ]
    try:
        indices = rich.progress.track(
            range(n), description=progress or "", total=n, disable=progress is None
        )
        for i in indices:
            if i > 0:
                item_structure, item_names, values = _flatten(dataset[i], i)
                if item_structure != structure or item_names != names:
                    raise ValueError(
                        f"write_memmap: record {i} is a {item_structure} of {item_names}; "
                        f"record 0 set the structure to a {structure} of {names}"
                    )
            for writer, value in zip(writers, values, strict=True):
                writer.append(i, value)
        fields = [writer.finish() for writer in writers]
    finally:
        for writer in writers:
            writer.close()
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "structure": structure,
        "num_records": n,
        "fields": [f.to_json() for f in fields],
    }


def _read_manifest(directory: Path) -> tuple[str, int, list[_Field]]:
    """Parse and validate ``manifest.json``; return (structure, record count, fields)."""
    if not directory.is_dir():
        raise FileNotFoundError(f"MemmapDataset: path {str(directory)!r} is not a directory")
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        raise FileNotFoundError(
            f"MemmapDataset: {str(directory)!r} has no {MANIFEST}; it is not a dataset written by "
            "write_memmap (or its write did not finish)"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("format") != FORMAT_NAME:
            raise MemmapFormatError(
                f"MemmapDataset: {str(manifest_path)!r} has format {manifest.get('format')!r}, "
                f"expected {FORMAT_NAME!r}"
            )
        if manifest.get("version") != FORMAT_VERSION:
            raise MemmapFormatError(
                f"MemmapDataset: {str(manifest_path)!r} has format version "
                f"{manifest.get('version')!r}; this torchturbo reads version {FORMAT_VERSION}"
            )
        structure, n = manifest["structure"], int(manifest["num_records"])
        if structure not in STRUCTURES:
            raise MemmapFormatError(
                f"MemmapDataset: structure {structure!r} is not one of {STRUCTURES}"
            )
        fields = [_parse_field(f) for f in manifest["fields"]]
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as error:
        raise MemmapFormatError(
            f"MemmapDataset: {str(manifest_path)!r} is malformed ({error!r})"
        ) from error
    return structure, n, fields


def _parse_field(entry: dict[str, Any]) -> _Field:
    dtype = getattr(torch, entry["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise MemmapFormatError(f"MemmapDataset: unknown dtype {entry['dtype']!r}")
    return _Field(
        name=entry["name"],
        dtype=dtype,
        record_ndim=int(entry["record_ndim"]),
        trailing_shape=tuple(int(d) for d in entry["trailing_shape"]),
        storage_dtype=np.dtype(entry["storage_dtype"]),
        rows=int(entry["rows"]),
        variable=bool(entry["variable"]),
        data_file=entry["data_file"],
        offsets_file=entry["offsets_file"],
    )


def _check_sizes(directory: Path, n: int, fields: list[_Field]) -> None:
    """Compare every file's size to the manifest: a truncated copy fails here, not mid-epoch."""
    for f in fields:
        expected = {f.data_file: f.rows * f.row_bytes, f.offsets_file: (n + 1) * 8}
        for name, size in expected.items():
            file = directory / name
            if not file.is_file():
                raise MemmapFormatError(f"MemmapDataset: field {f.name!r} file {file} is missing")
            actual = file.stat().st_size
            if actual != size:
                raise MemmapFormatError(
                    f"MemmapDataset: field {f.name!r} file {file} has {actual} bytes, the "
                    f"manifest expects {size} (truncated or partially copied?)"
                )


class MemmapDataset(Dataset):
    """A directory written by :func:`write_memmap`, read back with its structure and dtypes.

    Nothing is mapped in ``__init__`` (it only reads the manifest and checks file sizes): each
    process maps the files on its first ``__getitem__``, and a pickled or forked copy maps its own.
    DataLoader workers therefore never share a mapping or a file offset with the parent.

    Items are *copies* of the mapped slices. A zero-copy tensor would need a writable mapping
    (torch refuses, with a warning, to wrap a read-only array), and with a private copy-on-write
    mapping an in-place transform of one item (``img.sub_(mean)``) would change what every later
    read of that record returns in this process. The copy is one memcpy of the record from page
    cache, small next to the batch collation that follows.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.structure, self._n, self._fields = _read_manifest(self.path)
        _check_sizes(self.path, self._n, self._fields)
        self._maps: list[tuple[np.ndarray, np.ndarray]] | None = None
        self._owner_pid: int | None = None

    def __len__(self) -> int:
        return self._n

    @property
    def fields(self) -> list[str]:
        """Field names: tuple positions as "0", "1", ... or the dict keys, in record order."""
        return [f.name for f in self._fields]

    @property
    def lengths(self) -> list[int]:
        """Per-record length along dim 0 of the first variable-length field (for bucketing).

        Without a variable-length field, the (constant) dim-0 length of the first field that has
        a dim 0. Read from the offsets file on each call; nothing stays mapped.
        """
        candidates = [f for f in self._fields if f.variable] or [
            f for f in self._fields if f.record_ndim > 0
        ]
        if not candidates:
            raise ValueError(
                f"MemmapDataset.lengths: every field of {str(self.path)!r} is 0-d; "
                "there is no dim 0 to measure"
            )
        offsets = np.fromfile(self.path / candidates[0].offsets_file, dtype=np.int64)
        return np.diff(offsets).tolist()

    def __getitem__(self, index: int) -> Any:
        i = operator.index(index)
        if not -self._n <= i < self._n:
            raise IndexError(f"MemmapDataset index {index} out of range for {self._n} records")
        i %= self._n
        tensors = [self._read(f, data, offsets, i) for f, (data, offsets) in self._mapped()]
        if self.structure == "tensor":
            return tensors[0]
        if self.structure == "tuple":
            return tuple(tensors)
        return dict(zip(self.fields, tensors, strict=True))

    def __getstate__(self) -> dict[str, Any]:
        # A mapping is an OS resource of this process: a pickled copy maps the files itself.
        return {**self.__dict__, "_maps": None, "_owner_pid": None}

    def _mapped(self) -> zip[tuple[_Field, tuple[np.ndarray, np.ndarray]]]:
        # The pid check covers a fork after the parent already read an item: the child inherits
        # the attribute but opens its own mapping rather than using the parent's.
        if self._maps is None or self._owner_pid != os.getpid():
            _check_sizes(self.path, self._n, self._fields)
            self._maps = [self._map(f) for f in self._fields]
            self._owner_pid = os.getpid()
        return zip(self._fields, self._maps, strict=True)

    def _map(self, f: _Field) -> tuple[np.ndarray, np.ndarray]:
        offsets = np.memmap(self.path / f.offsets_file, np.int64, "r", shape=(self._n + 1,))
        shape = (f.rows, *f.trailing_shape)
        if f.rows == 0:  # mmap cannot map an empty file; every record of this field is empty
            return np.empty(shape, f.storage_dtype), offsets
        return np.memmap(self.path / f.data_file, f.storage_dtype, "r", shape=shape), offsets

    @staticmethod
    def _read(f: _Field, data: np.ndarray, offsets: np.ndarray, i: int) -> torch.Tensor:
        start, end = int(offsets[i]), int(offsets[i + 1])
        rows = data[start:end]
        if f.record_ndim == 0:
            rows = rows.reshape(())
        return torch.from_numpy(np.array(rows)).view(f.dtype)
