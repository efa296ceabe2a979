"""Padding and real tokens/s: naive random batches against length-bucketed batches (text workload).

Fair by construction: each timed pass is one epoch over the same samples (the ``text`` workload's
dataset, ``--samples`` of them) under the same budget of *padded* tokens per batch
(``--max-tokens``: the same bound on activation memory per step). The naive variant packs the
samples in random order until the budget is full (a token budget without bucketing); the bucketed
variant uses ``BucketBatchSampler``. The real tokens of a pass are identical, so the only
difference is how much of each batch is padding, hence how many steps, and which shapes, a pass
takes.

Each variant trains its own fresh model (same initial weights) with the recipe's optimizer and
``loss_fn``: fp32, forward + backward + optimizer step, batches collated before timing. After
one untimed pass each, timed passes alternate between the variants (A B, B A, ...) through
``measure_interleaved``; real tokens/s = real tokens of the epoch / median pass time.

    python benchmarks/bucketing.py --json out/bucketing.json
"""

from __future__ import annotations

import argparse
import platform
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from torchturbo.base.device import to_device
from torchturbo.data.bucketing import BucketBatchSampler, pack_batches, padding_fraction
from torchturbo.data.collate import pad_collate
from torchturbo.measure.timing import measure_interleaved
from torchturbo.output.results_file import write_results
from torchturbo.recipe import Recipe
from torchturbo.workloads import get_workload

VARIANTS = ("naive", "bucketed")


def plan(
    lengths: Sequence[int], max_tokens: int, multiple: int, seed: int
) -> dict[str, list[list[int]]]:
    """Batches (positions into ``lengths``) of one epoch, for each variant."""
    order = np.random.default_rng(seed).permutation(len(lengths)).tolist()
    naive = pack_batches(order, lengths, max_tokens=max_tokens, pad_to_multiple=multiple)
    sampler = BucketBatchSampler(
        lengths, max_tokens=max_tokens, pad_to_multiple=multiple, seed=seed
    )
    return {"naive": naive, "bucketed": sampler.global_batches()}


def train_pass(recipe: Recipe, batches: list[Any], device: str) -> Callable[[], None]:
    """A callable that trains one pass over ``batches`` on a fresh model of the recipe."""
    model, optimizer = recipe.build()
    model.to(device).train()
    batches = [to_device(b, torch.device(device), non_blocking=False) for b in batches]

    def run() -> None:
        for batch in batches:
            out = recipe.loss_fn(model, batch)
            loss = out[0] if isinstance(out, tuple) else out
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return run


def measure(args: argparse.Namespace) -> dict[str, Any]:
    recipe = get_workload("text", num_samples=args.samples)
    lengths = [int(n) for n in recipe.lengths]
    epoch = plan(lengths, args.max_tokens, args.pad_to_multiple, seed=0)
    collate = partial(pad_collate, pad_to_multiple=args.pad_to_multiple)
    collated = {
        name: [collate([recipe.dataset[i] for i in batch]) for batch in batches]
        for name, batches in epoch.items()
    }
    real_tokens = sum(lengths)

    timings = measure_interleaved(
        {name: train_pass(recipe, collated[name], args.device) for name in VARIANTS},
        device=args.device,
        warmup=1,  # one untimed pass each: first-call costs of every batch shape
        repeats=args.repeats,
        steps_per_repeat=1,
    )
    result: dict[str, Any] = {}
    for name in VARIANTS:
        steps = len(epoch[name])
        result[name] = {
            "padding_fraction": padding_fraction(epoch[name], lengths, args.pad_to_multiple),
            "tokens_per_s": real_tokens / timings[name].median,
            "steps_per_epoch": steps,
            "real_tokens_per_step": real_tokens / steps,
            "epoch_seconds_median": timings[name].median,
            "epoch_seconds_spread": timings[name].spread,
        }
    result["ratio"] = result["bucketed"]["tokens_per_s"] / result["naive"]["tokens_per_s"]
    result["setup"] = {
        "workload": recipe.name,
        "samples": len(lengths),
        "real_tokens": real_tokens,
        "max_tokens": args.max_tokens,
        "pad_to_multiple": args.pad_to_multiple,
        "repeats": args.repeats,
        "device": args.device,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
    }
    return result


def print_table(result: dict[str, Any]) -> None:
    setup = result["setup"]
    print(
        f"dynamic batching on {setup['workload']}: {setup['samples']} samples, "
        f"max_tokens={setup['max_tokens']}, torch {setup['torch']}, {setup['threads']} threads"
    )
    header = f"{'variant':<10}{'padding':>9}{'steps':>7}{'real tok/step':>15}"
    print(header + f"{'epoch s (spread)':>20}{'real tok/s':>12}")
    for name in VARIANTS:
        row = result[name]
        timing = f"{row['epoch_seconds_median']:.2f} ({row['epoch_seconds_spread']:.0%})"
        print(
            f"{name:<10}{row['padding_fraction']:>9.1%}{row['steps_per_epoch']:>7}"
            f"{row['real_tokens_per_step']:>15.0f}{timing:>20}{row['tokens_per_s']:>12.0f}"
        )
    print(f"bucketed / naive real tokens/s: {result['ratio']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the results to this JSON file")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on a shared 2-core machine, 2 OpenMP threads competing "
        "with another process for a core ran the same step 20x slower, drowning the ratio)",
    )
    parser.add_argument("--quick", action="store_true", help="a few seconds: smoke test")
    parser.add_argument(
        "--max-tokens", type=int, help="padded tokens per batch (default 4096; --quick: 1024)"
    )
    parser.add_argument(
        "--pad-to-multiple", type=int, default=1, help="round padded lengths up to this multiple"
    )
    parser.add_argument(
        "--samples", type=int, default=4096, help="samples of the text dataset (its default: 4096)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="interleaved timed epochs each")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    args = parser.parse_args()
    args.max_tokens = args.max_tokens or (1024 if args.quick else 4096)
    if args.quick:
        args.samples, args.repeats = 64, 2
    if min(args.max_tokens, args.pad_to_multiple, args.samples, args.repeats, args.threads) < 1:
        parser.error(
            "--max-tokens, --pad-to-multiple, --samples, --repeats and --threads must be >= 1"
        )
    torch.set_num_threads(args.threads)
    result = measure(args)
    print_table(result)
    if args.json:
        write_results(args.json, result)


if __name__ == "__main__":
    main()
