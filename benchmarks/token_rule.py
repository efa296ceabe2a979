"""What a dynamic batch plan keeps of the user's job: real tokens per step and steps per epoch.

A plan counts (computes, no training) the batches an epoch of long-tailed lengths makes for the
user's batch size: random rows of ``batch_size`` (the user's batches), length buckets and packed
rows under the budget the batch plan chooses (``data/batch_plan.py``: the user's batches per
epoch), and under the rule before it (a budget of batch size x mean length *padded* tokens). A
``max_steps`` job of fewer real tokens per step trains less data in the same steps.

    python benchmarks/token_rule.py --json benchmarks/results/token_rule.json
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import torch

from torchturbo.config import TurboConfig
from torchturbo.data.batch_plan import BatchSource, real_tokens
from torchturbo.data.bucketing import BucketBatchSampler
from torchturbo.data.packing import PackingBatchSampler
from torchturbo.output.results_file import write_results
from torchturbo.techniques import registry


def lengths(count: int, median: float, sigma: float, low: int, high: int) -> list[int]:
    """Lognormal lengths clamped to [low, high] (the tuner-at-scale benchmark's documents)."""
    generator = torch.Generator().manual_seed(0)
    drawn = (median * torch.empty(count).normal_(0, sigma, generator=generator).exp()).round()
    return drawn.clamp(low, high).long().tolist()


def row(name: str, batches: list[list[int]], sizes: list[int]) -> dict[str, Any]:
    tokens = real_tokens(batches, sizes)
    return {
        "plan": name,
        "batches_per_epoch": len(batches),
        "real_tokens_per_step": sum(tokens) / len(batches),
    }


def measure(sizes: list[int], batch_size: int) -> list[dict[str, Any]]:
    users = math.ceil(len(sizes) / batch_size)
    rows = [
        {
            "plan": f"the user's random rows of {batch_size}",
            "batches_per_epoch": users,
            "real_tokens_per_step": sum(sizes) / users,
        }
    ]
    padded = max(round(batch_size * sum(sizes) / len(sizes)), max(sizes))
    rows.append(
        row(
            f"buckets, the old rule ({padded} padded tokens)",
            BucketBatchSampler(sizes, max_tokens=padded, seed=0).global_batches(),
            sizes,
        )
    )
    rows.append(
        row(
            f"packing, the old rule ({padded} tokens)",
            PackingBatchSampler(sizes, max_tokens=padded, seed=0).global_batches(),
            sizes,
        )
    )
    dataset = [{"input_ids": torch.ones(n, dtype=torch.long)} for n in sizes]
    source = BatchSource(dataset, sizes, batch_size, model=lambda: Identity())
    for name, plan in (("buckets", "buckets"), ("packing", "packed")):
        config = TurboConfig(device="cpu").replace(data__batches=plan)
        plan = registry.batch_plan(config, source)
        rows.append(
            row(
                f"{name}, the batch plan ({plan.max_tokens} tokens)",
                plan.sampler.global_batches(),
                sizes,
            )
        )
    return rows


class Identity(torch.nn.Module):
    """A model that reads no positions and mixes no tokens: it passes the isolation check."""

    def forward(self, input_ids: torch.Tensor, position_ids: Any = None) -> torch.Tensor:
        return torch.nn.functional.one_hot(input_ids, 2).float() * self.scale

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=800)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sizes = lengths(args.samples, 64, 0.9, 16, 512)
    rows = measure(sizes, args.batch_size)
    users = rows[0]
    print(
        f"{args.samples} documents, lognormal lengths (median 64, 16-512), batch {args.batch_size}"
    )
    print(f"{'plan':<48} {'batches':>8} {'real tokens/step':>17} {'x the user':>11}")
    for r in rows:
        share = r["real_tokens_per_step"] / users["real_tokens_per_step"]
        r["tokens_per_step_over_users"] = share
        print(
            f"{r['plan']:<48} {r['batches_per_epoch']:>8} {r['real_tokens_per_step']:>17.1f} "
            f"{share:>10.3f}x"
        )
    if args.json:
        write_results(
            args.json, {"samples": args.samples, "batch_size": args.batch_size, "rows": rows}
        )


if __name__ == "__main__":
    main()
