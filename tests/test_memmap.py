"""write_memmap / MemmapDataset: exact round-trips, worker processes, lazy mapping, atomic writes,
and clear errors for damaged directories."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from torchturbo.data.memmap import MemmapDataset, MemmapFormatError, write_memmap

REPO = Path(__file__).resolve().parents[1]


class Records(Dataset):
    """A map-style dataset over a list of records, optionally failing at one index."""

    def __init__(self, records: list, fail_at: int | None = None) -> None:
        self.records, self.fail_at = records, fail_at

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int):
        if i == self.fail_at:
            raise RuntimeError(f"source failed at record {i}")
        return self.records[i]


class ReportsOwner(Dataset):
    """Each item says whether the mapping that served it was opened by the reading process."""

    def __init__(self, inner: MemmapDataset) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):
        item = self.inner[i]
        return item, torch.tensor(self.inner._owner_pid == os.getpid())


def images(n: int = 12) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    pixels = torch.randint(0, 256, (n, 3, 8, 8), dtype=torch.uint8, generator=generator)
    return [(pixels[i], torch.tensor(i % 5)) for i in range(n)]


def token_records(n: int = 20) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(2)
    lengths = [0, *torch.randint(1, 30, (n - 1,), generator=generator).tolist()]
    return [
        {
            # Token ids above 2**31 prove int64 survives; length 0 proves empty records do.
            "tokens": torch.randint(0, 2**40, (length,), generator=generator),
            "labels": torch.randint(0, 50_000, (length,), generator=generator),
        }
        for length in lengths
    ]


def assert_same(read, written) -> None:
    """Same structure, dtypes, shapes and bits (bitwise, so NaN and -0.0 count too)."""
    assert type(read) is type(written)
    if isinstance(written, torch.Tensor):
        read, written = {"0": read}, {"0": written}
    elif isinstance(written, tuple):
        read, written = dict(enumerate(read)), dict(enumerate(written))
    assert list(read) == list(written)
    for key, expected in written.items():
        actual = read[key]
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, key
        width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        to_bits = width[expected.dtype.itemsize]
        assert torch.equal(actual.view(to_bits), expected.view(to_bits)), key


def test_fixed_size_tuple_round_trip(tmp_path):
    records = images()
    dataset = MemmapDataset(write_memmap(Records(records), tmp_path / "ds"))
    assert len(dataset) == len(records)
    for i, record in enumerate(records):
        assert_same(dataset[i], record)
    assert_same(dataset[-1], records[-1])
    # Negative control: records differ, so a reader that returned the wrong record would fail.
    assert not torch.equal(dataset[0][0], records[1][0])
    assert dataset.lengths == [3] * len(records)  # no variable field: dim 0 of the first field


def test_variable_length_dict_round_trip_and_lengths(tmp_path):
    records = token_records()
    dataset = MemmapDataset(write_memmap(Records(records), tmp_path / "ds"))
    assert dataset.fields == ["tokens", "labels"]
    for i, record in enumerate(records):
        assert_same(dataset[i], record)
    assert dataset.lengths == [len(r["tokens"]) for r in records]
    assert dataset[0]["tokens"].shape == (0,)
    assert dataset[1]["tokens"].max() > 2**31


def test_bool_float_and_scalar_fields_are_bit_exact(tmp_path):
    specials = torch.tensor([float("nan"), -0.0, float("inf"), 1e-45, 3.0])
    records = [
        {
            "mask": torch.rand(4, 2) > 0.5,
            "f32": specials * (i + 1),
            "f64": torch.randn(2, 3, dtype=torch.float64),
            "bf16": torch.randn(i + 1, 2).bfloat16(),  # numpy has no bfloat16
            "f16": torch.randn(3).half(),
            "score": torch.tensor(0.1 * i),  # 0-d scalar per record
            "none": torch.zeros(0, 2, dtype=torch.int32),  # every record empty: zero-byte file
        }
        for i in range(6)
    ]
    dataset = MemmapDataset(write_memmap(Records(records), tmp_path / "ds"))
    for i, record in enumerate(records):
        assert_same(dataset[i], record)
    assert dataset.lengths == [i + 1 for i in range(6)]  # bf16 is the first variable field
    # Negative control: a float32 round-trip of bfloat16 would keep values but not the dtype.
    assert dataset[0]["bf16"].dtype == torch.bfloat16 and dataset[0]["score"].shape == ()


def test_plain_tensor_records(tmp_path):
    records = [torch.arange(i, i + 4, dtype=torch.int16) for i in range(5)]
    dataset = MemmapDataset(write_memmap(Records(records), tmp_path / "ds"))
    for i, record in enumerate(records):
        assert_same(dataset[i], record)
    with pytest.raises(IndexError, match="out of range"):
        dataset[5]


def test_items_are_copies_so_in_place_transforms_do_not_leak(tmp_path):
    dataset = MemmapDataset(write_memmap(Records(images()), tmp_path / "ds"))
    first = dataset[0][0]
    expected = first.clone()
    first.zero_()  # an in-place augmentation
    assert torch.equal(dataset[0][0], expected)


@pytest.mark.timeout(60)
def test_dataloader_workers_read_the_same_data_each_from_its_own_mapping(tmp_path):
    records = token_records(16)
    dataset = MemmapDataset(write_memmap(Records(records), tmp_path / "ds"))
    dataset[0]  # the parent maps first: forked workers inherit that and must map again
    loader = DataLoader(
        ReportsOwner(dataset), batch_size=None, num_workers=2, multiprocessing_context="fork"
    )
    served = list(loader)
    assert len(served) == len(records)
    for (item, own_mapping), record in zip(served, records, strict=True):
        assert_same(item, record)
        assert own_mapping, "a worker read through the mapping its parent opened"
    assert dataset._owner_pid == os.getpid()


def test_nothing_is_mapped_until_first_access_and_pickling_drops_the_mapping(tmp_path):
    records = images(4)
    dataset = MemmapDataset(write_memmap(Records(records), tmp_path / "ds"))
    assert dataset._maps is None
    assert pickle.loads(pickle.dumps(dataset))._maps is None
    dataset[1]
    assert dataset._maps is not None  # control: the attribute does track the mapping
    copy = pickle.loads(pickle.dumps(dataset))
    assert copy._maps is None
    assert_same(copy[1], records[1])


def test_a_failing_source_leaves_nothing_behind(tmp_path):
    target = tmp_path / "ds"
    with pytest.raises(RuntimeError, match="record 7"):
        write_memmap(Records(images(), fail_at=7), target)
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []  # the staging directory is gone too
    write_memmap(Records(images()), target)  # control: the same call without the failure works
    assert (target / "manifest.json").is_file()


def test_inconsistent_records_are_rejected_by_index(tmp_path):
    records = token_records(5)
    records[3] = {"tokens": records[3]["tokens"].int(), "labels": records[3]["labels"]}
    with pytest.raises(ValueError, match=r"record 3 field 'tokens' is torch.int32"):
        write_memmap(Records(records), tmp_path / "ds")
    shapes = [torch.zeros(2, 3), torch.zeros(5, 3), torch.zeros(2, 4)]
    with pytest.raises(ValueError, match=r"record 2 field '0' has shape \(2, 4\)"):
        write_memmap(Records(shapes), tmp_path / "ds")
    keys = [{"a": torch.zeros(1)}, {"b": torch.zeros(1)}]
    with pytest.raises(ValueError, match=r"record 1 is a dict of \['b'\]"):
        write_memmap(Records(keys), tmp_path / "ds")
    with pytest.raises(ValueError, match="record 0 is a list"):
        write_memmap(Records([[torch.zeros(1)]]), tmp_path / "ds")
    with pytest.raises(ValueError, match="field '1' is a int"):
        write_memmap(Records([(torch.zeros(1), 3)]), tmp_path / "ds")
    with pytest.raises(ValueError, match="empty"):
        write_memmap(Records([]), tmp_path / "ds")
    assert list(tmp_path.iterdir()) == []


def test_refuses_to_overwrite(tmp_path):
    target = write_memmap(Records(images(2)), tmp_path / "ds")
    with pytest.raises(FileExistsError, match="already exists"):
        write_memmap(Records(images(3)), target)
    assert len(MemmapDataset(target)) == 2


def test_missing_path_and_missing_manifest(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        MemmapDataset(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no manifest\.json"):
        MemmapDataset(tmp_path / "empty")


def test_unknown_version_and_malformed_manifest(tmp_path):
    target = write_memmap(Records(images(2)), tmp_path / "ds")
    manifest = target / "manifest.json"
    original = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**original, "version": 99}))
    with pytest.raises(MemmapFormatError, match="version 99"):
        MemmapDataset(target)
    manifest.write_text("{not json")
    with pytest.raises(MemmapFormatError, match="malformed"):
        MemmapDataset(target)
    manifest.write_text(json.dumps(original))
    assert len(MemmapDataset(target)) == 2  # control: the restored manifest opens


def test_truncated_files_fail_at_open(tmp_path):
    target = write_memmap(Records(token_records(6)), tmp_path / "ds")
    data = target / "field1.bin"
    with data.open("r+b") as f:
        f.truncate(data.stat().st_size - 8)
    with pytest.raises(MemmapFormatError, match=r"field 'labels' .*truncated"):
        MemmapDataset(target)


def test_truncation_after_construction_fails_at_first_access(tmp_path):
    target = write_memmap(Records(images(4)), tmp_path / "ds")
    dataset = MemmapDataset(target)
    (target / "field0.offsets").write_bytes(b"")
    with pytest.raises(MemmapFormatError, match="field '0'"):
        dataset[0]


def test_progress_bar_does_not_change_the_data(tmp_path):
    records = images(3)
    dataset = MemmapDataset(write_memmap(Records(records), tmp_path / "ds", progress=True))
    assert_same(dataset[2], records[2])


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_benchmark_quick_writes_its_json(tmp_path):
    out = tmp_path / "memmap.json"
    subprocess.run(
        [sys.executable, "benchmarks/memmap.py", "--quick", "--json", str(out), "--dir", tmp_path],
        cwd=REPO,
        check=True,
        capture_output=True,
        timeout=110,
    )
    result = json.loads(out.read_text())
    assert result["dataset_bytes"] >= 0.05 * 2**30
    assert result["samples"] > 0 and "anon_rss_growth_bytes" in result
    assert [p.name for p in tmp_path.iterdir()] == ["memmap.json"]  # the dataset was removed
