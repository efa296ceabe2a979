"""Length buckets against packing on a tiny Llama with long-tailed lengths, and the tuner's pick.

1. ``compare_configs`` (what ``torchturbo bench`` runs): random padded batches, length buckets
   and packed rows of the same token budget, fresh copies of the same model, timed interleaved
   in one process; real tokens/s (the label tokens the loss averages over), ratios to the
   random batches, the padding computed, and the loss.
2. The tuner on the same recipe with only the two batching stages: which it adopted, and each
   candidate's measured ratio against the best it was measured against.

    python benchmarks/packing.py --json out.json
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import LlamaConfig, LlamaForCausalLM

from torchturbo.config import TurboConfig
from torchturbo.data.collate import IGNORE_INDEX
from torchturbo.output.results_file import write_results
from torchturbo.output.tables import print_rows
from torchturbo.recipe import Recipe
from torchturbo.trials.variants import compare_configs
from torchturbo.tune.search.run import TuneOptions, tune

VOCAB = 512


def tiny_llama() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        use_cache=False,  # the Trainer's default; with a cache transformers skips the packed mask
    )
    return LlamaForCausalLM(config)


def lm_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """The model's own shifted loss, and the label tokens it averages over."""
    return model(**batch).loss, int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def recipe(samples: int, median: int, batch_size: int) -> Recipe:
    """Token sequences whose next token is a function of the current one (learnable), with
    lognormal lengths (median ``median``, a long tail up to 16x)."""
    generator = torch.Generator().manual_seed(0)
    lengths = (median * torch.empty(samples).normal_(0, 1.0, generator=generator).exp()).long()
    lengths = lengths.clamp(4, 16 * median).tolist()
    dataset = []
    for n in lengths:
        ids = torch.empty(n, dtype=torch.long)
        ids[0] = torch.randint(0, VOCAB, (1,), generator=generator)
        for i in range(1, n):
            ids[i] = (ids[i - 1] * 7 + 3) % VOCAB
        dataset.append({"input_ids": ids, "labels": ids.clone()})
    return Recipe(
        name="tiny-llama-long-tailed",
        model=tiny_llama,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        loss_fn=lm_loss,
        dataset=dataset,
        batch_size=batch_size,
        lengths=lengths,
        count_unit="tokens",
        pad_values={"labels": IGNORE_INDEX},
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=512, help="documents (default 512)")
    parser.add_argument("--median", type=int, default=32, help="median length (default 32)")
    parser.add_argument("--batch-size", type=int, default=8, help="rows per random batch")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--tune-budget", type=float, default=120.0, help="tuner seconds")
    parser.add_argument(
        "--threads", type=int, default=1, help="intra-op threads (default 1: see below)"
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    # On a shared machine, OpenMP threads competing with other jobs for a core make steps many
    # times slower at random (docs/techniques/dynamic_batching.md): one thread keeps ratios.
    torch.set_num_threads(args.threads)
    job = recipe(args.samples, args.median, args.batch_size)
    base = TurboConfig(device="cpu")
    configs = {
        "random batches": base,
        "length buckets": base.replace(data__batches="buckets"),
        "packing": base.replace(data__batches="packed"),
    }
    rows = compare_configs(job, configs, baseline="random batches", repeats=args.repeats)
    print_rows("batching on a tiny Llama (real tokens/s)", rows)
    by_name = {r.variant: r for r in rows}
    ratio = by_name["packing"].throughput / by_name["length buckets"].throughput
    print(f"packing / length buckets, real tokens/s: {ratio:.2f}x")
    options = TuneOptions(
        time_budget_s=args.tune_budget, only=("dynamic_batching", "packing"), device="cpu"
    )
    chosen, result = tune(job, options)
    print(f"tuner adopted: {', '.join(result.adopted) or 'nothing'}")
    for outcome in result.candidates:
        speed = outcome.comparison.speed.ratio if outcome.comparison else None
        shown = "" if speed is None else f" {speed:.2f}x"
        print(f"  {outcome.name}: {outcome.verdict}{shown} ({outcome.reason[:100]})")
    if args.json:
        write_results(
            args.json,
            {
                "rows": [r.to_dict() for r in rows],
                "packing_over_buckets": ratio,
                "tuner_adopted": list(result.adopted),
                "tuner_config_data": chosen.to_dict().get("data", {}),
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
