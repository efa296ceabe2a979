"""Anonymous memory of one DataLoader epoch over a memory-mapped dataset of a few GiB.

Writes a synthetic image dataset (uint8 3x64x64 + int64 label) of ``--size-gb`` GiB with
``write_memmap``, then reads one full shuffled epoch of ``MemmapDataset`` through a DataLoader with
``--workers`` worker processes, while a thread samples the anonymous resident memory of the main
process plus its loader workers (children found with psutil). Mapped pages are page cache, so the
anonymous memory should grow by a few batches, not by the dataset.

Baseline: the workers are forked and then held in ``worker_init_fn`` until the baseline is read,
so the headline ``anon_rss_growth_bytes`` (peak of the sum during the epoch minus that baseline)
is what reading the data costs. Starting the workers is reported apart
(``open_and_worker_start_*``): it does not grow with the dataset, and a forked worker's
``RssAnon`` counts every anonymous page it shares copy-on-write with the parent, so that figure
counts the parent's heap once more per worker. ``Pss_Anon`` (``/proc/<pid>/smaps_rollup``) splits
shared pages between their sharers; its sum is the anonymous memory really in use, also reported.

``--control`` runs the same epoch over the same files read whole into RAM (``numpy.fromfile``):
what the memory map saves. It runs after the memmap variant, with its own baseline.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch
from torch.utils.data import DataLoader, Dataset

from torchturbo.data.memmap import MemmapDataset, write_memmap
from torchturbo.output.results_file import write_results

IMAGE_SHAPE = (3, 64, 64)
GiB = 1 << 30


class SyntheticImages(Dataset):
    """``n`` (image, label) records cycled from a small random bank: cheap to generate at 2 GiB."""

    def __init__(self, n: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.images = torch.randint(
            0, 256, (97, *IMAGE_SHAPE), dtype=torch.uint8, generator=generator
        )
        self.labels = torch.arange(10, dtype=torch.int64)
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i % len(self.images)], self.labels[i % len(self.labels)]


class InMemory(Dataset):
    """The control: the same files read whole into anonymous memory."""

    def __init__(self, path: Path) -> None:
        self.images = np.fromfile(path / "field0.bin", dtype=np.uint8).reshape(-1, *IMAGE_SHAPE)
        self.labels = np.fromfile(path / "field1.bin", dtype=np.int64)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.from_numpy(self.images[i].copy()), torch.tensor(self.labels[i])


def _status_kib(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(key))


def _rollup_kib(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as rollup:
        return next(int(line.split()[1]) for line in rollup if line.startswith(key))


def _sum_over_tree(read: Callable[[int], int]) -> tuple[int, int]:
    """``read`` summed over this process and its children (in bytes), and the number of children."""
    me = psutil.Process()
    total, children = read(me.pid), 0
    for child in me.children(recursive=True):
        try:
            total += read(child.pid)
            children += 1
        except (FileNotFoundError, ProcessLookupError, StopIteration):
            continue  # a worker that exited between the listing and the read
    return total * 1024, children


def _memory() -> dict[str, int]:
    """RssAnon, Pss_Anon and RssFile summed over this process and its workers, and worker count."""
    rss, children = _sum_over_tree(lambda pid: _status_kib(pid, "RssAnon:"))
    pss, _ = _sum_over_tree(lambda pid: _rollup_kib(pid, "Pss_Anon:"))
    file_rss, _ = _sum_over_tree(lambda pid: _status_kib(pid, "RssFile:"))
    return {"rss_anon": rss, "pss_anon": pss, "rss_file": file_rss, "children": children}


def _sample(stop: threading.Event, interval: float, peaks: dict[str, int]) -> None:
    while not stop.is_set():
        for key, value in _memory().items():
            peaks[key] = max(peaks[key], value)
        stop.wait(interval)


def _wait_for_gate(gate: Any, worker_id: int) -> None:
    """worker_init_fn: hold each worker before its first fetch until the baseline is taken."""
    gate.wait()


def _wait_for_workers(workers: int, interval: float) -> dict[str, int]:
    """Memory once ``workers`` children exist and their anonymous memory has settled."""
    previous = _memory()
    while True:
        time.sleep(max(interval, 0.05))
        current = _memory()
        if current["children"] >= workers and current["rss_anon"] == previous["rss_anon"]:
            return current
        previous = current


def measure_epoch(
    make_dataset: Callable[[], Dataset], workers: int, batch_size: int, interval: float
) -> dict[str, Any]:
    """Open the dataset and read one shuffled epoch; return memory growth and timing.

    Three points: ``before`` (no dataset, no workers), ``ready`` (dataset opened, workers forked
    and held in ``worker_init_fn`` before their first fetch) and the peak during the epoch.
    Growth from ``ready`` is what reading the data costs; ``ready - before`` is the one-time cost
    of opening the dataset and starting workers, which does not grow with the dataset.
    """
    before = _memory()
    gate = torch.multiprocessing.get_context().Event()
    dataset = make_dataset()
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        num_workers=workers,
        generator=torch.Generator().manual_seed(0),
        worker_init_fn=functools.partial(_wait_for_gate, gate) if workers else None,
    )
    batches = iter(loader)
    ready = _wait_for_workers(workers, interval)
    peaks = dict(ready)
    stop = threading.Event()
    sampler = threading.Thread(target=_sample, args=(stop, interval, peaks), daemon=True)
    sampler.start()
    start = time.perf_counter()
    gate.set()
    samples, label_sum = 0, 0
    for images, labels in batches:
        samples += images.shape[0]
        label_sum += int(labels.sum())
    seconds = time.perf_counter() - start
    stop.set()
    sampler.join()
    del batches, loader, dataset
    return {
        "anon_rss_growth_bytes": peaks["rss_anon"] - ready["rss_anon"],
        "anon_pss_growth_bytes": peaks["pss_anon"] - ready["pss_anon"],
        "file_rss_growth_bytes": peaks["rss_file"] - ready["rss_file"],
        "open_and_worker_start_anon_rss_bytes": ready["rss_anon"] - before["rss_anon"],
        "open_and_worker_start_anon_pss_bytes": ready["pss_anon"] - before["pss_anon"],
        "workers_seen": peaks["children"],
        "epoch_seconds": seconds,
        "samples": samples,
        "label_sum": label_sum,
    }


def _total_pss(measured: dict[str, Any]) -> int:
    return measured["open_and_worker_start_anon_pss_bytes"] + measured["anon_pss_growth_bytes"]


def _check_disk(directory: Path, needed: int) -> None:
    usage = shutil.disk_usage(directory)
    print(f"disk {directory}: {usage.free / GiB:.1f} GiB free, need {needed / GiB:.2f} GiB")
    if usage.free < needed * 1.2 + GiB:  # leave headroom for the shared machine
        raise SystemExit(f"not enough free disk space in {directory} for {needed / GiB:.2f} GiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the results to this JSON file")
    parser.add_argument("--size-gb", type=float, default=2.0, help="dataset size in GiB")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--dir", type=Path, help="where to write the dataset (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the dataset files afterwards")
    parser.add_argument("--control", action="store_true", help="also run the in-RAM control")
    parser.add_argument("--interval", type=float, default=0.02, help="sampling period, seconds")
    parser.add_argument("--quick", action="store_true", help="a 0.05 GiB dataset: a few seconds")
    args = parser.parse_args()
    if args.workers < 0 or args.size_gb <= 0:
        parser.error("--workers must be >= 0 and --size-gb > 0")
    size_gb = 0.05 if args.quick else args.size_gb
    record_bytes = int(np.prod(IMAGE_SHAPE)) + 8
    n = -(-int(size_gb * GiB) // record_bytes)

    parent = args.dir or Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    _check_disk(parent, n * record_bytes)
    workdir = Path(tempfile.mkdtemp(prefix="torchturbo-memmap-bench-", dir=parent))
    try:
        start = time.perf_counter()
        path = write_memmap(SyntheticImages(n), workdir / "images", progress=not args.quick)
        write_seconds = time.perf_counter() - start
        dataset_bytes = sum(f.stat().st_size for f in path.iterdir())
        memmap = measure_epoch(
            lambda: MemmapDataset(path), args.workers, args.batch_size, args.interval
        )
        result: dict[str, Any] = {
            "dataset_bytes": dataset_bytes,
            "anon_rss_growth_bytes": memmap["anon_rss_growth_bytes"],
            "anon_rss_growth_fraction": memmap["anon_rss_growth_bytes"] / dataset_bytes,
            "anon_pss_growth_bytes": memmap["anon_pss_growth_bytes"],
            "file_rss_growth_bytes": memmap["file_rss_growth_bytes"],
            "open_and_worker_start_anon_rss_bytes": memmap["open_and_worker_start_anon_rss_bytes"],
            "open_and_worker_start_anon_pss_bytes": memmap["open_and_worker_start_anon_pss_bytes"],
            "epoch_seconds": memmap["epoch_seconds"],
            "samples": memmap["samples"],
            "workers": args.workers,
            "workers_seen": memmap["workers_seen"],
            "batch_size": args.batch_size,
            "write_seconds": write_seconds,
            "write_gib_per_s": dataset_bytes / GiB / write_seconds,
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        }
        if memmap["samples"] != n:
            raise SystemExit(f"epoch read {memmap['samples']} samples, expected {n}")
        if args.control:
            control = measure_epoch(
                lambda: InMemory(path), args.workers, args.batch_size, args.interval
            )
            if control["label_sum"] != memmap["label_sum"]:
                raise SystemExit("the in-RAM control read different labels than the memmap")
            result["control_in_ram"] = control
            # Opening is part of the control's cost (it reads the files into RAM), so compare
            # the anonymous memory in use from before opening to the epoch's peak.
            result["control_to_memmap_pss_ratio"] = _total_pss(control) / max(_total_pss(memmap), 1)
    finally:
        if args.keep:
            print(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(result, indent=2))
    if args.json:
        write_results(args.json, result)


if __name__ == "__main__":
    main()
