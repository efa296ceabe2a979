"""torch.compile's activation memory budget: a compiled step's footprint and time at budgets
1.0 (torch's default), 0.5 and 0.0, side by side.

The model is a small ``LlamaForCausalLM`` built from a config (no download) on random tokens;
each variant is the same compiled model with ``[compile] activation_memory_budget`` set, and
``compare_configs`` times them interleaved (warm-up, repeats, medians, spread) and measures
each one's footprint as the tuner does (``Trial.memory_footprint``: on CPU the bytes saved for
backward plus weights, gradients and optimizer state). Ratios are against budget 1.0.

    python benchmarks/compile_budget.py --repeats 5 --json benchmarks/results/compile_budget.json
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchturbo.config import TurboConfig
from torchturbo.output.results_file import write_results
from torchturbo.recipe import Recipe
from torchturbo.trials.variants import compare_configs

BUDGETS = (1.0, 0.5, 0.0)


def _llama(layers: int, hidden: int, vocab: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    return LlamaForCausalLM(config)


def _loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = (batch["labels"][:, 1:] != -100).sum()  # what the mean is over
    return model(**batch).loss, tokens


def recipe(args: argparse.Namespace) -> Recipe:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(args.vocab, (64, args.tokens), generator=generator)
    samples = [{"input_ids": row, "labels": row} for row in ids]
    return Recipe(
        name="llama",
        model=lambda: _llama(args.layers, args.hidden, args.vocab),
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        loss_fn=_loss,
        dataset=samples,  # type: ignore[arg-type]
        batch_size=args.batch,
        count_unit="tokens",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--json", type=Path, help="write every row here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    base = TurboConfig(device="cpu").replace(compile__mode="default")
    configs = {
        f"budget {b:.1f}": base.replace(compile__activation_memory_budget=b) for b in BUDGETS
    }
    rows = compare_configs(
        recipe(args),
        configs,
        baseline="budget 1.0",
        repeats=args.repeats,
        steps_per_repeat=2,
        on_progress=lambda message: print(message, file=sys.stderr, flush=True),
    )
    reference = next(r for r in rows if r.variant == "budget 1.0")
    print(f"{'variant':<11} {'footprint MiB':>13} {'x mem':>6} {'step ms':>8} {'spread':>7} "
          f"{'x speed':>7} {'first s':>7}")  # fmt: skip
    for row in rows:
        memory = row.peak_memory_bytes
        shown = f"{memory / 2**20:13.2f}" if memory is not None else f"{'n/a':>13}"
        share = (
            f"{memory / reference.peak_memory_bytes:6.3f}"
            if memory is not None and reference.peak_memory_bytes
            else f"{'n/a':>6}"
        )
        print(
            f"{row.variant:<11} {shown} {share} {row.step_ms_median:8.1f} "
            f"{row.step_ms_spread:6.0%} {row.ratio:7.3f} {row.first_step_s:7.1f}"
        )
    if args.json is not None:
        record: dict[str, Any] = {
            "args": vars(args) | {"json": str(args.json)},
            "torch": torch.__version__,
            "machine": platform.processor() or platform.machine(),
            "rows": [row.to_dict() for row in rows],
        }
        write_results(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
