"""What the non-finite guard costs per training step: guard on vs off, with clipping on.

With clipping on the guard reads one flag per optimizer step and takes one more norm over the
gradients after clipping (what the optimizer applies); without the guard (``nonfinite_patience =
0``) neither happens. Both variants train the same built-in workload from the same weights on the
same batches, interleaved in one process; ratio is guarded step time over unguarded (> 1: the
guard's cost). The norm is also timed alone, as it is far below a busy machine's step noise.

    python benchmarks/guard.py --workload vision --json benchmarks/results/guard-vision.json
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch

from torchturbo import Turbo, TurboConfig
from torchturbo.measure import measure_interleaved, noise_band
from torchturbo.output.results_file import write_results
from torchturbo.trials.trial import fixed_batches
from torchturbo.workloads import WORKLOADS, get_workload


def variant(recipe, batches: list, patience: int, max_norm: float):
    """One training step of a fresh engine with the guard's ``patience`` (0 = off)."""
    config = TurboConfig(device="cpu").replace(
        clipping__max_norm=max_norm, reliability__nonfinite_patience=patience
    )
    turbo = Turbo(config)
    model, optimizer = recipe.build()
    turbo.setup(model, optimizer)
    cycle = itertools.cycle(batches)
    return lambda: turbo.step(recipe.loss_fn, next(cycle))


def _norm_timing(recipe, batch, repeats: int):
    """The guard's extra work with clipping on: one total norm over the model's gradients."""
    model, _ = recipe.build()
    output = recipe.loss_fn(model, batch)
    (output[0] if isinstance(output, tuple) else output).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = lambda: torch.nn.utils.get_total_norm(grads, error_if_nonfinite=False)  # noqa: E731
    return measure_interleaved(
        {"norm": norm}, device="cpu", warmup=3, repeats=repeats, steps_per_repeat=20
    )["norm"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="vision")
    parser.add_argument("--max-norm", type=float, default=1.0, help="clipping (default 1.0)")
    parser.add_argument("--repeats", type=int, default=9, help="interleaved rounds (default 9)")
    parser.add_argument("--steps", type=int, default=3, help="steps per round (default 3)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    recipe = get_workload(args.workload)
    batches = fixed_batches(recipe, 4)
    norm = _norm_timing(recipe, batches[0], args.repeats)
    timings = measure_interleaved(
        {
            "guard off": variant(recipe, batches, 0, args.max_norm),
            "guard on": variant(recipe, batches, 3, args.max_norm),
        },
        device="cpu",
        warmup=2,
        repeats=args.repeats,
        steps_per_repeat=args.steps,
    )
    off, on = timings["guard off"], timings["guard on"]
    params = sum(p.numel() for p in recipe.build()[0].parameters())
    print(f"{args.workload}: {params:,} parameters, clipping max_norm = {args.max_norm}")
    for name, timing in timings.items():
        print(f"{name:9} {timing.median * 1e3:8.1f} ms/step  spread {timing.spread:5.1%}")
    cost = on.median / off.median
    print(f"guard on / off: {cost:.3f}x (noise band {noise_band(timings):.1%})")
    print(
        f"the extra norm alone: {norm.median * 1e3:.2f} ms (spread {norm.spread:.1%}), "
        f"{norm.median / off.median:.2%} of a step"
    )
    if args.json:
        write_results(
            args.json,
            {
                "workload": args.workload,
                "parameters": params,
                "max_norm": args.max_norm,
                "guard_off_step_s": off.median,
                "guard_on_step_s": on.median,
                "guard_cost_ratio": cost,
                "extra_norm_s": norm.median,
                "extra_norm_fraction_of_step": norm.median / off.median,
                "noise_band": noise_band(timings),
                "samples": {name: t.samples for name, t in timings.items()},
                "threads": torch.get_num_threads(),
            },
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
