"""Time to resume into the middle of a 10,000-batch epoch: skipping by index against draining.

A checkpoint is saved after one step, then its loader position is moved to batch ``--at`` of
the epoch (5,000 of 10,000 by default; ``state.json`` and its checksum are edited as a user
would, the random state of the epoch's start stays valid). Resuming is timed from
``Turbo.load`` to the first batch after the position, in a fresh engine, for:

- ``map-style``: a map-style dataset (what ``Turbo.setup`` builds a DataLoader around), whose
  trained batches are skipped by index;
- ``stream``: the same samples as a stream without ``state_dict()``, which can only be drained
  (its trained batches fetched, collated and discarded again). Before batches were skipped by
  index, a map-style dataset was drained like this too.

Each sample costs what ``--sample-us`` says (a busy loop standing for decoding or augmenting),
so that the drained time can be read against the cost of one batch. Variants alternate,
``--repeats`` times; medians and spreads are printed and written.

    python benchmarks/resume_skip.py --json benchmarks/results/resume_skip.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset

BATCH = 8


class Samples(Dataset):
    """``count`` samples of 16 features, each costing ``sample_us`` microseconds to make."""

    def __init__(self, count: int, sample_us: float) -> None:
        self.count, self.sample_s = count, sample_us / 1e6

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        until = time.perf_counter() + self.sample_s
        while time.perf_counter() < until:
            pass
        return torch.full((16,), index / self.count), torch.tensor(index % 2)


class Stream(IterableDataset):
    """The same samples in order, as a stream that cannot save its position."""

    def __init__(self, samples: Samples) -> None:
        self.samples = samples

    def __iter__(self):
        return (self.samples[i] for i in range(len(self.samples)))


def _engine(data: Any) -> tuple[Any, Any]:
    from torchturbo import Turbo, TurboConfig

    torch.manual_seed(0)
    model = nn.Linear(16, 2)
    turbo = Turbo(TurboConfig(device="cpu"))
    _, _, loader = turbo.setup(
        model, torch.optim.SGD(model.parameters(), lr=0.1), data, batch_size=BATCH, seed=0
    )
    return turbo, loader


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def _checkpoint_at(data: Any, directory: Path, at: int) -> None:
    turbo, loader = _engine(data)
    turbo.step(_loss, next(iter(loader)))
    path = turbo.save(directory)
    state = json.loads((path / "state.json").read_text())
    state["loader"] = [0, at]
    (path / "state.json").write_text(json.dumps(state))
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["state.json"] = hashlib.sha256((path / "state.json").read_bytes()).hexdigest()
    (path / "manifest.json").write_text(json.dumps(manifest))


def _resume_seconds(data: Any, directory: Path) -> float:
    turbo, loader = _engine(data)
    begin = time.perf_counter()
    turbo.load(directory)
    next(iter(loader))
    return time.perf_counter() - begin


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=10_000, help="batches per epoch")
    parser.add_argument("--at", type=int, default=5_000, help="batch of the epoch to resume at")
    parser.add_argument("--sample-us", type=float, default=20.0, help="cost of one sample")
    parser.add_argument("--repeats", type=int, default=3, help="resumes per variant")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    samples = Samples(args.batches * BATCH, args.sample_us)
    variants = {"map-style": samples, "stream": Stream(samples)}
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as root:
        directories = {name: Path(root) / name.replace("-", "_") for name in variants}
        for name, data in variants.items():
            _checkpoint_at(data, directories[name], args.at)
        for _ in range(args.repeats):
            for name, data in variants.items():
                seconds[name].append(_resume_seconds(data, directories[name]))
    batch_s = []
    for index in range(20):
        begin = time.perf_counter()
        torch.utils.data.default_collate([samples[index * BATCH + i] for i in range(BATCH)])
        batch_s.append(time.perf_counter() - begin)
    result: dict[str, Any] = {
        "batches_per_epoch": args.batches,
        "resumed_at_batch": args.at,
        "batch_size": BATCH,
        "sample_us": args.sample_us,
        "one_batch_s": statistics.median(batch_s),
        "torch": torch.__version__,
    }
    for name, measured in seconds.items():
        result[name] = {
            "resume_s": statistics.median(measured),
            "resume_s_range": [min(measured), max(measured)],
            "runs": measured,
        }
        print(
            f"{name}: resume at batch {args.at} of {args.batches} in "
            f"{statistics.median(measured):.3f} s ({min(measured):.3f}-{max(measured):.3f})"
        )
    ratio = result["stream"]["resume_s"] / result["map-style"]["resume_s"]
    result["drain_over_skip"] = ratio
    print(f"draining takes {ratio:.0f}x as long as skipping by index")
    if args.json:
        from torchturbo.output.results_file import write_results

        write_results(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
