"""What ``[data] max_shapes`` costs and buys: batch shapes per epoch, the padding they add, the
real tokens per step, and, with ``--time``, CUDA graphs over the bounded shapes side by side.

For the ``text`` workload (long-tailed lengths) and a Llama's documents (tests/recipes), each plan
of one epoch, built as every host builds it (``registry.batch_plan``): length buckets and packed
rows as the data gives them, and padded to a few shapes (``max_shapes`` 4, 8, 16 for buckets, 1
for packed rows). Printed per plan: batches per epoch, distinct batch shapes (each a CUDA graph to
record, or a compile with ``dynamic=False``), padded positions over real tokens (what the padding
costs in computed positions) and real tokens per step (kept at the user's by the plan's budget).

``--time`` (for a GPU) then trains the text workload side by side (``compare_configs``:
interleaved rounds, medians) in bf16 on: buckets eager, buckets compiled with dynamic shapes,
and buckets padded to 16 shapes compiled with CUDA graphs (``reduce-overhead``), and prints the
ratios and each first step (compiling and recording included). On a CPU reduce-overhead has no
CUDA graphs to use.

    python benchmarks/shapes.py --json benchmarks/results/shapes.json
    python benchmarks/shapes.py --device cuda --time --json shapes-gpu.json
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "recipes"))

import hf_causal_lm

from torchturbo.config import TurboConfig
from torchturbo.measure.machine import summary
from torchturbo.output.results_file import write_results
from torchturbo.recipe import Recipe
from torchturbo.techniques import registry
from torchturbo.trials.trial import recipe_source
from torchturbo.trials.variants import compare_configs
from torchturbo.workloads import get_workload

SEQUENCE_KEYS = ("tokens", "input_ids")


def llama_recipe() -> Recipe:
    """The Trainer recipe of tests/recipes/hf_causal_lm.py (a tiny Llama on documents)."""
    return hf_causal_lm.recipe()


def plan_figures(recipe: Recipe, config: TurboConfig) -> dict[str, Any]:
    """One epoch of ``config``'s plan on ``recipe``: its batches, shapes and padding."""
    plan = registry.batch_plan(config, recipe_source(recipe))
    lengths = recipe.lengths
    assert lengths is not None
    batches = [list(batch) for batch in plan.sampler]
    shapes: Counter = Counter()
    positions = 0
    for batch in batches:
        collated = plan.collate([recipe.dataset[i] for i in batch])
        key = next(k for k in SEQUENCE_KEYS if k in collated)
        shape = tuple(collated[key].shape)
        shapes[shape] += 1
        positions += shape[0] * shape[1]
    real = sum(int(lengths[i]) for batch in batches for i in batch)
    return {
        "batches": len(batches),
        "shapes": len(shapes),
        "positions_over_real_tokens": positions / real,
        "real_tokens_per_step": real / len(batches),
        "max_tokens": plan.max_tokens,
    }


def plans(device: str) -> dict[str, dict[str, TurboConfig]]:
    base = TurboConfig(device=device)
    buckets = base.replace(data__batches="buckets")
    packed = base.replace(data__batches="packed")
    return {
        "text": {
            "buckets": buckets,
            **{f"buckets, {n} shapes": buckets.replace(data__max_shapes=n) for n in (4, 8, 16)},
        },
        "llama": {
            "buckets": buckets,
            "buckets, 8 shapes": buckets.replace(data__max_shapes=8),
            "packed": packed,
            "packed, 1 shape": packed.replace(data__max_shapes=1),
        },
    }


def timed(device: str) -> list[dict[str, Any]]:
    """bf16 text on buckets: eager, compiled (dynamic), CUDA graphs over 16 shapes (the tuner's
    candidate: one dynamic compile, a graph recorded per shape)."""
    recipe = get_workload("text", "auto", device=device)
    bf16 = TurboConfig(device=device).replace(precision__dtype="bf16", data__batches="buckets")
    configs = {
        "buckets eager": bf16,
        "buckets compiled (dynamic)": bf16.replace(compile__mode="default", compile__dynamic=True),
        "16 shapes, CUDA graphs": bf16.replace(
            data__max_shapes=16, compile__mode="reduce-overhead", compile__dynamic=True
        ),
    }
    rows = compare_configs(recipe, configs, baseline="buckets eager", repeats=5)
    return [row.to_dict() for row in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--time", action="store_true", help="time CUDA graphs (for a GPU)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    recipes = {"text": get_workload("text"), "llama": llama_recipe()}
    results: dict[str, Any] = {"machine": summary(), "torch": torch.__version__, "plans": {}}
    for name, configs in plans(args.device).items():
        print(f"\n{name}: {len(recipes[name].dataset)} samples, batch {recipes[name].batch_size}")
        print(
            f"{'plan':<20} {'batches':>8} {'shapes':>7} {'positions/real':>15} {'tokens/step':>12}"
        )
        for label, config in configs.items():
            row = plan_figures(recipes[name], config)
            results["plans"][f"{name}: {label}"] = row
            print(
                f"{label:<20} {row['batches']:>8} {row['shapes']:>7} "
                f"{row['positions_over_real_tokens']:>15.2f} {row['real_tokens_per_step']:>12.0f}"
            )
    if args.time:
        results["timed"] = timed(args.device)
        for row in results["timed"]:
            print(
                f"{row['variant']:<28} {row['ratio']:.2f}x {row['step_ms_median']:8.1f} ms a step, "
                f"first {row['first_step_s']:.1f} s"
            )
    if args.json:
        write_results(args.json, results)


if __name__ == "__main__":
    main()
