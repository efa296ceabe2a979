"""Per-sample CPU augmentation in DataLoader workers vs batch augmentation on the device.

Variants, measured side by side in one run (warm-up, interleaved repeats, medians, spread):

* ``cpu_workers_N``: the classic pipeline. A map-style dataset augments one uint8 image at a time
  (torchvision-style RandomResizedCrop by slicing + bilinear resize, flip, colour jitter,
  normalize) in N DataLoader workers; the float32 batch is then copied to the device.
* ``device_torch`` / ``device_kornia``: the loader only stacks uint8 images; the batch is copied
  to the device (pinned memory + non_blocking on CUDA) and augmented there by
  :class:`torchturbo.data.augment.BatchAugment` / an equivalent kornia pipeline.
* ``kernel_torch`` / ``kernel_kornia``: the device augmentation alone, on a resident batch.

images/s counts every image that reaches the device augmented; ratios are over the best
``cpu_workers_N`` median of the same image size.

    python benchmarks/augment.py --json out/augment.json [--device cpu|cuda] [--quick]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from torchturbo.data.augment import BatchAugment
from torchturbo.output.results_file import write_results

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
SCALE = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)
JITTER = 0.4
HFLIP_P = 0.5
LUMA = (0.2989, 0.587, 0.114)


class SyntheticImages(Dataset):
    """``n`` random uint8 RGB images of ``size`` x ``size`` with integer labels."""

    def __init__(self, n: int, size: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.images = torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=gen)
        self.labels = torch.randint(0, 10, (n,), generator=gen)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index], self.labels[index]


class PerSampleAugmented(Dataset):
    """The classic CPU pipeline: augment one uint8 image per ``__getitem__``, in the workers.

    Random numbers come from torch's global generator, which DataLoader seeds per worker.
    """

    def __init__(self, base: SyntheticImages, out_size: int) -> None:
        self.base = base
        self.out_size = out_size

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image, label = self.base[index]
        return augment_one(image, self.out_size), label


def augment_one(image: torch.Tensor, out_size: int) -> torch.Tensor:
    """RandomResizedCrop + horizontal flip + ColorJitter + Normalize on one uint8 [C, H, W]."""
    top, left, h, w = _crop_box(image.shape[1], image.shape[2])
    crop = image[None, :, top : top + h, left : left + w].float().div_(255)
    out = F.interpolate(crop, size=(out_size, out_size), mode="bilinear", align_corners=False)[0]
    if _rand() < HFLIP_P:
        out = out.flip(-1)
    low, high = 1 - JITTER, 1 + JITTER
    out.mul_(low + _rand() * (high - low)).clamp_(0, 1)
    contrast = low + _rand() * (high - low)
    out.mul_(contrast).add_((1 - contrast) * _gray(out).mean()).clamp_(0, 1)
    saturation = low + _rand() * (high - low)
    out.mul_(saturation).add_((1 - saturation) * _gray(out)).clamp_(0, 1)
    mean = torch.tensor(MEAN).view(3, 1, 1)
    std = torch.tensor(STD).view(3, 1, 1)
    return out.sub_(mean).div_(std)


def _rand() -> float:
    return float(torch.rand(()))


def _gray(image: torch.Tensor) -> torch.Tensor:
    return LUMA[0] * image[0] + LUMA[1] * image[1] + LUMA[2] * image[2]


def _crop_box(height: int, width: int) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params, one image at a time."""
    area = height * width
    log_low, log_high = torch.log(torch.tensor(RATIO)).tolist()
    for _ in range(10):
        target = area * (SCALE[0] + _rand() * (SCALE[1] - SCALE[0]))
        aspect = float(torch.exp(torch.tensor(log_low + _rand() * (log_high - log_low))))
        w = round((target * aspect) ** 0.5)
        h = round((target / aspect) ** 0.5)
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, ()))
            left = int(torch.randint(0, width - w + 1, ()))
            return top, left, h, w
    return 0, 0, height, width  # square images: the centre fallback is the whole image


def batch_augment(size: int) -> BatchAugment:
    return BatchAugment(
        resized_crop=(size, size),
        scale=SCALE,
        ratio=RATIO,
        hflip_p=HFLIP_P,
        brightness=JITTER,
        contrast=JITTER,
        saturation=JITTER,
        mean=MEAN,
        std=STD,
    )


def kornia_augment(size: int, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """The same pipeline in kornia (which draws from the global RNG: it takes no generator)."""
    import kornia.augmentation as K

    pipeline = torch.nn.Sequential(
        K.RandomResizedCrop((size, size), scale=SCALE, ratio=RATIO),
        K.RandomHorizontalFlip(p=HFLIP_P),
        K.ColorJitter(brightness=JITTER, contrast=JITTER, saturation=JITTER, p=1.0),
        K.Normalize(mean=torch.tensor(MEAN, device=device), std=torch.tensor(STD, device=device)),
    ).to(device)
    return lambda images: pipeline(images.float().div_(255))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def loader_epoch(
    loader: DataLoader, device: torch.device, augment: Callable[[torch.Tensor], torch.Tensor]
) -> Callable[[], int]:
    """One pass over ``loader``: copy each batch to the device and augment it there."""

    def run() -> int:
        count = 0
        for images, labels in loader:
            images = augment(images.to(device, non_blocking=True))
            labels = labels.to(device, non_blocking=True)
            count += images.shape[0]
        return count

    return run


def kernel_epoch(
    images: torch.Tensor, batches: int, augment: Callable[[torch.Tensor], torch.Tensor]
) -> Callable[[], int]:
    def run() -> int:
        for _ in range(batches):
            augment(images)
        return batches * images.shape[0]

    return run


def images_per_second(run: Callable[[], int], device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    count = run()
    sync(device)  # device work is asynchronous: the clock is read only after it finished
    return count / (time.perf_counter() - start)


def build_variants(
    size: int, batch: int, batches: int, workers: list[int], args: argparse.Namespace
) -> dict[str, tuple[str, Callable[[], int]]]:
    device = torch.device(args.device)
    pin = device.type == "cuda"
    base = SyntheticImages(batch * batches, size, args.seed)
    per_sample = PerSampleAugmented(base, size)
    variants: dict[str, tuple[str, Callable[[], int]]] = {}
    for n in workers:
        loader = DataLoader(
            per_sample,
            batch_size=batch,
            shuffle=True,
            num_workers=n,
            pin_memory=pin,
            persistent_workers=n > 0,
        )
        variants[f"cpu_workers_{n}"] = ("per_sample_cpu", loader_epoch(loader, device, _same))
    raw = DataLoader(base, batch_size=batch, shuffle=True, pin_memory=pin)
    resident = base.images[:batch].to(device)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    ours = batch_augment(size)
    augments = {"torch": lambda images: ours(images, generator)}
    if not args.no_kornia:
        augments["kornia"] = kornia_augment(size, device)
    for name, augment in augments.items():
        variants[f"device_{name}"] = ("device_batch", loader_epoch(raw, device, augment))
        variants[f"kernel_{name}"] = ("device_kernel", kernel_epoch(resident, batches, augment))
    return variants


def _same(images: torch.Tensor) -> torch.Tensor:
    return images


def measure_case(
    size: int, batch: int, batches: int, workers: list[int], args: argparse.Namespace
) -> list[dict]:
    device = torch.device(args.device)
    variants = build_variants(size, batch, batches, workers, args)
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _, run in variants.values():
        images_per_second(run, device)  # warm-up: worker start-up, allocator, kernel caches
    for _ in range(args.repeats):
        for name, (_, run) in variants.items():  # interleaved: A B C A B C ...
            samples[name].append(images_per_second(run, device))
    best_cpu = max(
        statistics.median(samples[name])
        for name, (kind, _) in variants.items()
        if kind == "per_sample_cpu"
    )
    rows = []
    for name, (kind, _) in variants.items():
        values = samples[name]
        median = statistics.median(values)
        rows.append(
            {
                "image_size": size,
                "batch_size": batch,
                "variant": name,
                "kind": kind,
                "images_per_s": median,
                "images_per_s_min": min(values),
                "images_per_s_max": max(values),
                "spread_pct": 100 * (max(values) - min(values)) / median,
                "samples": values,
                "ratio_vs_best_cpu": median / best_cpu,
            }
        )
    return rows


def print_table(rows: list[dict]) -> None:
    header = ("size", "batch", "variant", "images/s", "spread", "x best cpu")
    print("{:>5} {:>5}  {:<16} {:>10} {:>8} {:>10}".format(*header))
    for row in rows:
        print(
            f"{row['image_size']:>5} {row['batch_size']:>5}  {row['variant']:<16} "
            f"{row['images_per_s']:>10.0f} {row['spread_pct']:>7.0f}% "
            f"{row['ratio_vs_best_cpu']:>10.2f}"
        )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True, help="where to write the results")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, finishes in seconds")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats per variant")
    parser.add_argument("--batches", type=int, default=4, help="batches per measurement")
    parser.add_argument(
        "--threads", type=int, default=torch.get_num_threads(), help="intra-op threads (main)"
    )
    parser.add_argument("--no-kornia", action="store_true", help="skip the kornia variants")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    if min(args.repeats, args.batches, args.threads) < 1:
        parser.error("--repeats, --batches and --threads must be >= 1")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    if not args.no_kornia:
        try:
            import kornia  # noqa: F401
        except ImportError:
            print("kornia is not installed: skipping the kornia variants")
            args.no_kornia = True
    if args.quick:
        args.repeats, args.batches = 2, 2
        cases, workers = [(32, 32)], [0, 1]
    else:
        cases, workers = [(64, 128), (224, 64)], [0, 1, 2]
    rows = [
        row
        for size, batch in cases
        for row in measure_case(size, batch, args.batches, workers, args)
    ]
    print_table(rows)
    result = {
        "benchmark": "augment",
        "device": args.device,
        "device_name": torch.cuda.get_device_name()
        if args.device == "cuda"
        else platform.processor(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "threads": args.threads,
        "repeats": args.repeats,
        "batches": args.batches,
        "quick": args.quick,
        "results": rows,
    }
    write_results(args.json, result)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
