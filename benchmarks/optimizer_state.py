"""Smaller optimizer states against torch's AdamW: their bytes, their step, their loss.

The model is a small Hugging Face ``LlamaForCausalLM`` built from a config (no download) on
learnable tokens (each sequence counts up from a random start, so the loss falls); each
variant is the same weights and batches with ``[optimizer] state`` set, rebuilt from
``torch.optim.AdamW`` as the engine rebuilds it. For each: the state's bytes after the first
step (``state_bytes``, through torchao's quantised tensors) beside what the planner predicts
(``planned_state_bytes``), the first step (torchao compiles its step per parameter shape), the
optimizer step alone timed interleaved with the others (warm-up, ``--repeats`` rounds, medians,
spread), and the loss over ``--steps`` steps against fp32 AdamW's (the mean relative
difference per step, and the last loss).

    python benchmarks/optimizer_state.py --steps 40 --json benchmarks/results/optimizer_state.json
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchturbo.output.results_file import write_results
from torchturbo.techniques.optimizer_state import (
    planned_state_bytes,
    rebuild_with_state,
    state_bytes,
    state_unavailable,
)

VARIANTS = ("as_built", "bf16", "8bit", "4bit", "fp8")


def _llama(args: argparse.Namespace) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def batches(args: argparse.Namespace, count: int) -> list[torch.Tensor]:
    """Token rows that count up by one from a random start: a pattern the model learns."""
    generator = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(count):
        start = torch.randint(args.vocab, (args.batch, 1), generator=generator)
        rows.append((start + torch.arange(args.tokens)) % args.vocab)
    return rows


class Variant:
    """One model and its optimizer with one state, stepping through the same batches."""

    def __init__(self, args: argparse.Namespace, state: str) -> None:
        self.model = _llama(args)
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=args.lr)
        self.optimizer = optimizer if state == "as_built" else rebuild_with_state(optimizer, state)
        self.losses: list[float] = []
        self.optimizer_s: list[float] = []

    def step(self, ids: torch.Tensor) -> None:
        loss = self.model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        begin = time.perf_counter()
        self.optimizer.step()
        self.optimizer_s.append(time.perf_counter() - begin)
        self.optimizer.zero_grad(set_to_none=True)
        self.losses.append(loss.item())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--steps", type=int, default=40, help="steps whose losses are compared")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    data = batches(args, args.steps)
    variants: dict[str, Variant] = {}
    first: dict[str, float] = {}
    skipped: dict[str, str] = {}
    for state in VARIANTS:
        why = state_unavailable(state)
        if why:
            skipped[state] = why
            continue
        variants[state] = Variant(args, state)
        begin = time.perf_counter()
        variants[state].step(data[0])  # torchao compiles its step here, per parameter shape
        first[state] = time.perf_counter() - begin
        print(f"{state}: first step {first[state]:.1f} s", file=sys.stderr, flush=True)
    for index in range(1, args.steps):  # interleaved, a different variant first each step
        names = list(variants)
        start = index % len(names)
        for name in names[start:] + names[:start]:
            variants[name].step(data[index])
    reference = variants["as_built"].losses
    parameters = list(variants["as_built"].model.parameters())
    rows = []
    for state, variant in variants.items():
        measured = state_bytes(variant.optimizer)
        timed = variant.optimizer_s[1:]
        rows.append(
            {
                "state": state,
                "state_bytes": measured,
                "planned_bytes": planned_state_bytes(parameters, state),
                "x_fp32_state": measured / state_bytes(variants["as_built"].optimizer),
                "first_step_s": first[state],
                "optimizer_step_ms": 1e3 * statistics.median(timed),
                "optimizer_step_spread": (max(timed) - min(timed)) / statistics.median(timed),
                "loss_first": variant.losses[0],
                "loss_last": variant.losses[-1],
                "mean_relative_loss_difference": statistics.fmean(
                    abs(a - b) / abs(b) for a, b in zip(variant.losses, reference, strict=True)
                ),
                "max_relative_loss_difference": max(
                    abs(a - b) / abs(b) for a, b in zip(variant.losses, reference, strict=True)
                ),
            }
        )
    base_ms = rows[0]["optimizer_step_ms"]
    print(
        f"{'state':<9} {'MiB':>7} {'planned':>7} {'x fp32':>6} {'first s':>7} {'opt ms':>7} "
        f"{'x speed':>7} {'loss last':>9} {'mean dloss':>10} {'max dloss':>9}"
    )
    for row in rows:
        print(
            f"{row['state']:<9} {row['state_bytes'] / 2**20:7.2f} "
            f"{row['planned_bytes'] / 2**20:7.2f} {row['x_fp32_state']:6.3f} "
            f"{row['first_step_s']:7.1f} {row['optimizer_step_ms']:7.1f} "
            f"{base_ms / row['optimizer_step_ms']:7.2f} {row['loss_last']:9.4f} "
            f"{row['mean_relative_loss_difference']:10.2%} "
            f"{row['max_relative_loss_difference']:9.2%}"
        )
    for state, why in skipped.items():
        print(f"{state}: not run: {why}")
    if args.json is not None:
        record: dict[str, Any] = {
            "args": {k: v for k, v in vars(args).items() if k != "json"},
            "torch": torch.__version__,
            "machine": platform.processor() or platform.machine(),
            "load": os.getloadavg(),
            "parameters": sum(p.numel() for p in parameters),
            "rows": rows,
            "skipped": skipped,
        }
        write_results(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
