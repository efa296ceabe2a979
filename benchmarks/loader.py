"""DataLoader settings: what ``tune_loader`` picks against an exhaustive grid, and what it buys.

The dataset is an ImageNet-style pipeline on synthetic photos: JPEG bytes held in memory (a list of
Python ``bytes``, as a real dataset of files or blobs would be), decoded per sample with Pillow,
random-resized-cropped to the vision workload's image size, flipped at random, converted to a
normalized float tensor. The per-sample CPU cost is real decoding, not a sleep.

One run measures, side by side:

1. ``tune_loader`` with its defaults over the default grid (the tuner as a user would run it);
2. the same grid exhaustively, with more batches and more repeats, interleaved round by round
   (each round in a rotated order, a fresh loader per measurement, start-up excluded): the
   reference the tuned choice is judged against (target: within 10% of the grid's best);
3. ``tune_loader`` on the workload's own dataset, tensors already in memory (no per-sample cost);
4. the compute step of the built-in ``vision`` workload alone (forward + backward + optimizer on
   one of these batches), which gives the input-bound / compute-bound verdict;
5. whole training steps fed by the loader (no workers, the tuned setting, the grid's best), because
   on a CPU workers and compute share the cores and the loader measured alone is optimistic.

    python benchmarks/loader.py --json benchmarks/results/loader.json [--quick] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import platform
import random
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import Dataset

from torchturbo.base.device import to_device
from torchturbo.config import DataConfig
from torchturbo.data.loader import build_loader
from torchturbo.measure.timing import Timing, measure_interleaved, sync
from torchturbo.output.results_file import write_results
from torchturbo.tune.loader.grid import default_candidates, describe, tune_loader, usable_cpus
from torchturbo.workloads import get_workload

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
CROP_SCALE = (0.25, 1.0)  # fraction of the source side kept by the random crop


class JpegImages(Dataset):
    """``n`` synthetic photos stored as JPEG bytes, decoded and augmented one sample at a time."""

    def __init__(self, n: int, source_size: int, image_size: int, num_classes: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        # Smooth colour fields plus mild noise: JPEG sizes and decode times like real photos
        # (pure noise would be unrealistically large and slow to decode).
        coarse = torch.rand(n, 3, 8, 8, generator=gen)
        smooth = F.interpolate(coarse, size=(source_size, source_size), mode="bicubic")
        noise = torch.randn(n, 3, source_size, source_size, generator=gen) * 8
        pixels = (smooth.clamp(0, 1) * 255 + noise).clamp(0, 255).to(torch.uint8)
        self.blobs = [_encode_jpeg(image) for image in pixels]
        self.labels = torch.randint(num_classes, (n,), generator=gen).tolist()
        self.image_size = image_size

    def __len__(self) -> int:
        return len(self.blobs)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = Image.open(io.BytesIO(self.blobs[index])).convert("RGB")
        # random.* is seeded per worker by the DataLoader, so crops differ across workers.
        side = int(image.width * random.uniform(*CROP_SCALE))
        left = random.randint(0, image.width - side)
        top = random.randint(0, image.height - side)
        out = self.image_size
        image = image.resize((out, out), Image.BILINEAR, box=(left, top, left + side, top + side))
        if random.random() < 0.5:
            image = image.transpose(Image.FLIP_LEFT_RIGHT)
        hwc = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(out, out, 3)
        chw = hwc.permute(2, 0, 1).float().div_(255)
        return (chw - MEAN) / STD, self.labels[index]


def _encode_jpeg(image_chw: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image_chw.permute(1, 2, 0).numpy()).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def measure_grid(
    dataset: Dataset,
    batch_size: int,
    candidates: list[DataConfig],
    device: torch.device,
    *,
    batches: int,
    warmup_batches: int,
    repeats: int,
) -> dict[DataConfig, Timing]:
    """Seconds per batch of every candidate: fresh loader per round, rotated order, medians.

    Deliberately independent of tune_loader's own measuring code, so that a flaw there would show
    up as a disagreement here.
    """
    samples: dict[DataConfig, list[float]] = {c: [] for c in candidates}
    for round_index in range(repeats):
        shift = round_index % len(candidates)
        for config in candidates[shift:] + candidates[:shift]:
            loader = build_loader(
                dataset, batch_size=batch_size, config=config, device=device, drop_last=True
            )
            batches_iter = _forever(loader)
            # n workers deliver batches in bursts of n: start and stop the clock between bursts.
            burst = max(1, config.num_workers)
            for _ in range(_round_up(max(1, warmup_batches), burst)):
                to_device(next(batches_iter), device, non_blocking=config.non_blocking)
            sync(device)
            start = time.perf_counter()
            timed = _round_up(batches, burst)
            for _ in range(timed):
                to_device(next(batches_iter), device, non_blocking=config.non_blocking)
            sync(device)
            samples[config].append((time.perf_counter() - start) / timed)
            batches_iter.close()
            del loader, batches_iter  # workers exit before the next candidate starts
    return {c: Timing(s) for c, s in samples.items()}


def _round_up(count: int, multiple: int) -> int:
    return -(-count // multiple) * multiple


def _forever(loader: Any) -> Any:
    while True:
        yield from loader


def make_step(recipe: Any, device: torch.device) -> Any:
    """One training step of the recipe (zero_grad, loss, backward, optimizer step)."""
    model, optimizer = recipe.build()
    model.to(device)

    def step(batch: Any) -> None:
        optimizer.zero_grad(set_to_none=True)
        out = recipe.loss_fn(model, batch)
        loss = out[0] if isinstance(out, tuple) else out
        loss.backward()
        optimizer.step()

    return step


def measure_training(
    dataset: Dataset,
    batch_size: int,
    variants: dict[str, tuple[DataConfig, int]],
    step: Any,
    device: torch.device,
    *,
    warmup: int,
    steps: int,
    repeats: int,
) -> dict[str, Timing]:
    """Seconds per training step when the loader feeds it: loading and compute together.

    A variant is a loader setting and the number of torch threads compute runs with.
    """
    default_threads = torch.get_num_threads()
    names = list(variants)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            config, threads = variants[name]
            torch.set_num_threads(threads)
            loader = build_loader(
                dataset, batch_size=batch_size, config=config, device=device, drop_last=True
            )
            batches_iter = _forever(loader)
            for _ in range(warmup):  # worker start-up and first-step allocations
                step(to_device(next(batches_iter), device, non_blocking=config.non_blocking))
            sync(device)
            start = time.perf_counter()
            for _ in range(steps):
                step(to_device(next(batches_iter), device, non_blocking=config.non_blocking))
            sync(device)
            samples[name].append((time.perf_counter() - start) / steps)
            batches_iter.close()
            del loader, batches_iter
            torch.set_num_threads(default_threads)
    return {name: Timing(s) for name, s in samples.items()}


def training_variants(
    configs: list[DataConfig], device: torch.device
) -> dict[str, tuple[DataConfig, int]]:
    """Each setting with torch's default threads; on CPU, worker settings also with the compute
    threads reduced by the number of workers, so that workers and compute do not share a core."""
    threads = torch.get_num_threads()
    variants = {f"{describe(c)}, threads={threads}": (c, threads) for c in configs}
    if device.type == "cpu":
        for config in configs:
            fewer = max(1, threads - config.num_workers)
            if config.num_workers and fewer != threads:
                variants[f"{describe(config)}, threads={fewer}"] = (config, fewer)
    return variants


def measure(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    quick = args.quick
    load_before = os.getloadavg()[0]
    recipe = get_workload("vision", **({"num_samples": 256} if quick else {}))
    image_size = int(recipe.dataset[0][0].shape[-1])
    num_classes = int(recipe.extras.get("num_classes", 10))
    batch_size = 8 if quick else recipe.batch_size
    dataset = JpegImages(
        n=128 if quick else 2048,
        source_size=96 if quick else 256,
        image_size=image_size,
        num_classes=num_classes,
        seed=0,
    )
    candidates = default_candidates(device)

    step = make_step(recipe, device)
    fixed_batch = to_device(
        next(
            iter(build_loader(dataset, batch_size=batch_size, config=DataConfig(), device=device))
        ),
        device,
        non_blocking=False,
    )
    compute = measure_interleaved(
        {"step": lambda: step(fixed_batch)},
        device=device,
        warmup=1 if quick else 3,
        repeats=1 if quick else 5,
        steps_per_repeat=1 if quick else 2,
    )["step"]

    start = time.perf_counter()
    tuning = tune_loader(
        dataset,
        batch_size,
        device=device,
        candidates=candidates,
        step_seconds=compute.median,
        **({"batches": 4, "warmup_batches": 1, "repeats": 1} if quick else {}),
    )
    tune_s = time.perf_counter() - start
    # The workload's own dataset: tensors already in memory, nothing to decode per sample.
    in_memory = tune_loader(
        recipe.dataset,
        batch_size,
        device=device,
        candidates=candidates,
        **({"batches": 4, "warmup_batches": 1, "repeats": 1} if quick else {}),
    )

    grid = measure_grid(
        dataset,
        batch_size,
        candidates,
        device,
        batches=4 if quick else 40,
        warmup_batches=1 if quick else 5,
        repeats=1 if quick else 5,
    )
    best = min(grid, key=lambda c: grid[c].median)
    chosen = tuning.chosen
    fed = list(dict.fromkeys([DataConfig(pin_memory=device.type == "cuda"), chosen, best]))
    training = measure_training(
        dataset,
        batch_size,
        training_variants(fed, device),
        step,
        device,
        warmup=1 if quick else 2,
        steps=1 if quick else 10,
        repeats=1 if quick else 3,
    )
    return {
        "chosen": {
            "config": dataclasses.asdict(chosen),
            "batches_per_s": 1 / grid[chosen].median,  # as the grid measured it: a fair ratio
            "tuner_batches_per_s": tuning.chosen_trial.batches_per_s,
        },
        "grid_best": {"config": dataclasses.asdict(best), "batches_per_s": 1 / grid[best].median},
        "chosen_vs_best": grid[best].median / grid[chosen].median,
        "verdict": "input-bound" if tuning.input_bound else "compute-bound",
        "reason": tuning.reason,
        "tune_seconds": tune_s,
        "step_seconds": compute.median,
        "step_spread": compute.spread,
        "grid": [
            {
                "config": dataclasses.asdict(c),
                "label": describe(c),
                "batches_per_s": 1 / t.median,
                "spread": t.spread,
                "tuner": _trial_dict(tuning, c),
            }
            for c, t in grid.items()
        ],
        "training": [
            {"label": label, "step_seconds": t.median, "spread": t.spread}
            for label, t in training.items()
        ],
        "in_memory": {
            "chosen": dataclasses.asdict(in_memory.chosen),
            "reason": in_memory.reason,
            "batches_per_s": {describe(t.config): t.batches_per_s for t in in_memory.results},
        },
        "setup": {
            "quick": quick,
            "device": str(device),
            "batch_size": batch_size,
            "samples": len(dataset),
            "image_size": image_size,
            "usable_cpus": usable_cpus(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            # 1-minute load average before and after: other processes on the machine.
            "load_average": [load_before, os.getloadavg()[0]],
        },
    }


def _trial_dict(tuning: Any, config: DataConfig) -> dict[str, Any]:
    trial = next(t for t in tuning.results if t.config == config)
    return {
        "batches_per_s": trial.batches_per_s,
        "startup_s": trial.startup_s,
        "worker_rss_bytes": trial.worker_rss_bytes,
        "projected_bytes": trial.projected_bytes,
        "verdict": trial.verdict,
        "reason": trial.reason,
    }


def report(result: dict[str, Any]) -> None:
    setup = result["setup"]
    print(
        f"DataLoader tuning on {setup['device']} ({setup['usable_cpus']} usable cores), "
        f"batch {setup['batch_size']}, {setup['samples']} JPEG samples -> "
        f"{setup['image_size']} px, torch {setup['torch']}, load average "
        f"{setup['load_average'][0]:.1f} -> {setup['load_average'][1]:.1f}"
    )
    best = result["grid_best"]["batches_per_s"]
    print(
        f"{'setting':34}{'grid b/s':>10}{'spread':>8}{'vs best':>9}{'tuner b/s':>11}"
        f"{'start s':>9}{'worker MiB':>12}{'proj MiB':>10}  tuner verdict"
    )
    for row in result["grid"]:
        tuner = row["tuner"]
        rate = tuner["batches_per_s"]
        worker = tuner["worker_rss_bytes"]
        start = tuner["startup_s"]
        print(
            f"{row['label']:34}{row['batches_per_s']:>10.1f}{row['spread']:>8.1%}"
            f"{row['batches_per_s'] / best:>9.2f}{rate or float('nan'):>11.1f}"
            f"{start or float('nan'):>9.3f}{(worker or 0) / 2**20:>12.1f}"
            f"{(tuner['projected_bytes'] or 0) / 2**20:>10.0f}  {tuner['verdict']}"
        )
    print(f"tuner ({result['tune_seconds']:.1f} s): {result['reason']}")
    print(
        f"chosen / grid best: {result['chosen_vs_best']:.2f}x "
        f"(target >= 0.90); compute step alone {result['step_seconds'] * 1e3:.1f} ms "
        f"(spread {result['step_spread']:.1%}): {result['verdict']}"
    )
    rates = result["in_memory"]["batches_per_s"]
    print("in-memory tensors (the workload's own dataset), tuner batches/s:")
    print("  " + ", ".join(f"{label}: {rate:.0f}" for label, rate in rates.items()))
    print(f"  {result['in_memory']['reason']}")
    print("training step fed by the loader (loading + compute on the same machine):")
    for row in result["training"]:
        print(
            f"  {row['label']:45}{row['step_seconds'] * 1e3:>8.1f} ms  spread {row['spread']:.1%}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the results to this JSON file")
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes and one repeat: a smoke run, not figures"
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="default: cuda when available",
    )
    args = parser.parse_args()
    result = measure(args)
    report(result)
    if args.json:
        write_results(args.json, result)


if __name__ == "__main__":
    main()
