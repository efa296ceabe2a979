"""What the engine costs: ``Turbo.step`` against a hand-written loop doing the same techniques.

Both variants train the same initial weights on the same batches in the same order, with bf16
autocast (fp32 where the device has no bf16 autocast), channels_last, gradient accumulation over
2 micro-batches and norm clipping; the hand-written loop is what a user would write without
torchturbo. They are timed interleaved (``measure_interleaved``: warm-up, device sync, rounds
that alternate which variant runs first) and compared by the ratio of medians; the per-round
ratio's spread is the noise. Because both compute the same thing, their parameters must agree at
the end (``max_param_diff``): a check that the comparison is like for like.

Each step's CPU time (``time.process_time``, all threads of this process) is recorded beside the
wall clock: on a machine shared with other work, wall time waits for the CPU and its noise can
hide a few percent, while CPU time counts only the work each variant did.

    python benchmarks/overhead.py --json benchmarks/results/overhead-vision.json
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchturbo.config import TurboConfig
from torchturbo.engine import Turbo
from torchturbo.measure.timing import measure_interleaved, paired_noise
from torchturbo.output.results_file import write_results
from torchturbo.recipe import Recipe
from torchturbo.trials.trial import fixed_batches
from torchturbo.workloads import WORKLOADS, get_workload

ACCUMULATION = 2
MAX_NORM = 1.0


def config_for(device: torch.device) -> TurboConfig:
    dtype = "bf16" if torch.amp.is_autocast_available(device.type) else "fp32"
    return TurboConfig(device=device.type).replace(
        precision__dtype=dtype,
        memory_format__channels_last=True,
        accumulation__steps=ACCUMULATION,
        clipping__max_norm=MAX_NORM,
    )


def turbo_step(recipe: Recipe, config: TurboConfig, batches: list[Any]) -> tuple[Callable, Any]:
    turbo = Turbo(config)
    model, optimizer = recipe.build()
    model, _, _ = turbo.setup(model, optimizer)
    batch = itertools.cycle(batches).__next__
    return lambda: turbo.step(recipe.loss_fn, batch()), model


def plain_step(recipe: Recipe, config: TurboConfig, batches: list[Any]) -> tuple[Callable, Any]:
    """The loop a user writes by hand: autocast, NHWC weights and images, loss / accumulation,
    clip, step. Batches of equal size make ``loss / ACCUMULATION`` the window's exact mean."""
    device = torch.device(config.device)
    model, optimizer = recipe.build()
    model = model.to(device).to(memory_format=torch.channels_last)
    dtype = torch.bfloat16 if config.precision.dtype == "bf16" else None
    batch = itertools.cycle(batches).__next__
    micro = itertools.count(1)

    def to_device(tensor: torch.Tensor) -> torch.Tensor:
        nhwc = tensor.dim() == 4 and tensor.is_floating_point()
        return tensor.to(
            device, memory_format=torch.channels_last if nhwc else torch.preserve_format
        )

    def step() -> None:
        inputs = tuple(to_device(t) for t in batch())
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = recipe.loss_fn(model, inputs)
        loss = loss[0] if isinstance(loss, tuple) else loss
        (loss.float() / ACCUMULATION).backward()
        if next(micro) % ACCUMULATION == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return step, model


class CpuTimed:
    """``step`` counting the process CPU seconds its calls used."""

    def __init__(self, step: Callable[[], Any]) -> None:
        self.step = step
        self.seconds = 0.0
        self.calls = 0

    def __call__(self) -> None:
        begin = time.process_time()
        self.step()
        self.seconds += time.process_time() - begin
        self.calls += 1


def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    pairs = zip(a.parameters(), b.parameters(), strict=True)
    return max(float((x - y).detach().abs().max()) for x, y in pairs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="vision")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=15, help="interleaved rounds (default 15)")
    parser.add_argument("--steps", type=int, default=4, help="steps per round (default 4)")
    parser.add_argument("--quick", action="store_true", help="tiny run for smoke tests")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    if args.steps % ACCUMULATION:
        parser.error(f"--steps must be a multiple of {ACCUMULATION} (whole windows per round)")
    overrides = {"batch_size": 4, "num_samples": 16} if args.quick else {}
    recipe = get_workload(args.workload, **overrides)
    device = torch.device(args.device)
    config = config_for(device)
    batches = fixed_batches(recipe, 2 if args.quick else 8, seed=recipe.seed)
    repeats, warmup = (2, 2) if args.quick else (args.repeats, 2 * ACCUMULATION)
    turbo_fn, turbo_model = turbo_step(recipe, config, batches)
    plain_fn, plain_model = plain_step(recipe, config, batches)
    turbo, plain = CpuTimed(turbo_fn), CpuTimed(plain_fn)
    load_before = os.getloadavg()[0]
    # Warm up here rather than in measure_interleaved, so that CPU time counts timed steps only.
    for _ in range(warmup):
        turbo.step()
        plain.step()
    print(f"timing {recipe.name} on {device} ({repeats} rounds)", file=sys.stderr)
    timings = measure_interleaved(
        {"turbo": turbo, "plain": plain},
        device=device,
        warmup=0,
        repeats=repeats,
        steps_per_repeat=args.steps,
    )
    ratios = [
        t / p for t, p in zip(timings["turbo"].samples, timings["plain"].samples, strict=True)
    ]
    result = {
        "turbo_step_s": timings["turbo"].median,
        "plain_step_s": timings["plain"].median,
        "overhead": timings["turbo"].median / timings["plain"].median - 1,
        "overhead_per_round_median": statistics.median(ratios) - 1,
        "noise": paired_noise(timings["turbo"], timings["plain"]),
        "turbo_spread": timings["turbo"].spread,
        "plain_spread": timings["plain"].spread,
        "turbo_cpu_step_s": turbo.seconds / turbo.calls,
        "plain_cpu_step_s": plain.seconds / plain.calls,
        "overhead_cpu": turbo.seconds / plain.seconds - 1,
        "max_param_diff": max_param_diff(turbo_model, plain_model),
        "workload": recipe.name,
        "device": str(device),
        "config": config.to_dict(),
        "rounds": repeats,
        "threads": torch.get_num_threads(),
        # The machine's 1-minute load average before and after: other work shares the cores.
        "load_average": [load_before, os.getloadavg()[0]],
        "steps_per_round": args.steps,
        "torch": torch.__version__,
    }
    print(
        f"{recipe.name}: Turbo.step {1e3 * result['turbo_step_s']:.2f} ms, hand-written "
        f"{1e3 * result['plain_step_s']:.2f} ms: overhead {100 * result['overhead']:+.1f}% "
        f"(per-round median {100 * result['overhead_per_round_median']:+.1f}%, noise "
        f"{100 * result['noise']:.1f}%); CPU time {100 * result['overhead_cpu']:+.1f}%; "
        f"parameters agree to {result['max_param_diff']:.1e}"
    )
    if args.json:
        write_results(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
