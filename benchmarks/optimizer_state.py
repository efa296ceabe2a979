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

``--plan-budget-mib M`` instead runs the tuner's memory planner on the same model and data under
``--memory-budget M MiB`` and then trains the config it writes in a fresh trial, whose footprint
(``Trial.memory_footprint``: on CPU the bytes saved for backward, weights, gradients and the
optimizer state as stored) is measured against the budget.
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


def _loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = (batch["labels"][:, 1:] != -100).sum()  # what the mean is over
    return model(**batch, use_cache=False).loss, tokens


def recipe(args: argparse.Namespace) -> Any:
    from torchturbo.recipe import Recipe

    rows = batches(args, 16)
    samples = [{"input_ids": row, "labels": row} for batch in rows for row in batch]
    return Recipe(
        name=f"llama-{args.layers}x{args.hidden}",
        model=lambda: _llama(args),
        optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr),
        loss_fn=_loss,
        dataset=samples,  # type: ignore[arg-type]
        batch_size=args.batch,
        count_unit="tokens",
    )


def plan_for_budget(args: argparse.Namespace) -> dict[str, Any]:
    """The memory planner under ``args.plan_budget_mib``, then the written config trained."""
    from torchturbo.trials.trial import Trial, fixed_batches
    from torchturbo.tune.search.run import TuneOptions, tune

    budget = int(args.plan_budget_mib * 2**20)
    options = TuneOptions(
        time_budget_s=args.tune_budget, memory_budget=budget, only=("memory",), device="cpu"
    )
    say = lambda stage, name, left: print(f"{stage}: {name} ({left:.0f} s left)", file=sys.stderr)  # noqa: E731
    config, result = tune(recipe(args), options, on_progress=say)
    estimate = result.memory_estimate
    rows = []
    for outcome in result.candidates:
        parity = outcome.parity
        rows.append(
            {
                "name": outcome.name,
                "verdict": outcome.verdict,
                "memory_bytes": outcome.memory_bytes,
                "loss_difference": None if parity is None else parity.relative_diff,
                "one_time_s": outcome.one_time_s,
                "reason": outcome.reason,
            }
        )
        print(f"{outcome.name}: {outcome.verdict}: {outcome.reason}")
    trial = Trial(recipe(args), config, fixed_batches(recipe(args), 4))
    try:
        for _ in range(3):
            trial.step()
        footprint, kind = trial.memory_footprint()
    finally:
        trial.close()
    fits = footprint is not None and footprint <= budget
    print(
        f"written: [optimizer] state = {config.optimizer.state!r}; trained: {footprint} bytes "
        f"({kind}) against a budget of {budget}: {'fits' if fits else 'over'}"
    )
    return {
        "budget_bytes": budget,
        "estimate": {
            k: estimate.get(k)
            for k in (
                "weights_bytes",
                "gradients_bytes",
                "optimizer_bytes",
                "activation_bytes",
                "total_bytes",
                "measured_bytes",
            )
        },
        "candidates": rows,
        "adopted": list(result.adopted),
        "written_state": config.optimizer.state,
        "written_footprint_bytes": footprint,
        "fits": fits,
    }


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
    parser.add_argument("--plan-budget-mib", type=float, help="tune memory under this budget")
    parser.add_argument("--tune-budget", type=float, default=1200.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.plan_budget_mib is not None:
        record = {
            "args": {k: v for k, v in vars(args).items() if k != "json"},
            "torch": torch.__version__,
            "load": os.getloadavg(),
            "plan": plan_for_budget(args),
        }
        if args.json is not None:
            write_results(args.json, record)
        return 0
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
