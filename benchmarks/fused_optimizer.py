"""The optimizer step as built, with foreach=True and with fused=True, on the built-in workloads'
parameter sets, timed interleaved.

For each workload (its model's parameters) and optimizer (Adam, AdamW, SGD with momentum), three
copies of the parameters carry the same gradients and each gets its own optimizer: as built (the
constructor's defaults, which on a CPU update one tensor at a time) and rebuilt by
``torchturbo.techniques.optimizer.rebuild_optimizer`` with foreach or fused. Only
``optimizer.step()`` is timed (forward and backward are the same for all three), interleaved by
``measure_interleaved`` (warm-up, rotating order, device sync, medians, spread); ratio is as-built
ms over the variant's ms (> 1: faster). To say what that buys in training, the share of a whole fp32
training step (``trials.trial.Trial``) that the as-built optimizer step takes is printed beside.

    python benchmarks/fused_optimizer.py --json out.json [--device cuda] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import functools
from pathlib import Path
from typing import Any

import torch

from torchturbo.config import TurboConfig
from torchturbo.measure.timing import measure_interleaved, noise_band, ratio
from torchturbo.output.results_file import write_results
from torchturbo.techniques.optimizer import IMPLEMENTATIONS, rebuild_optimizer
from torchturbo.trials.trial import Trial, fixed_batches
from torchturbo.workloads import WORKLOADS, get_workload

OPTIMIZERS = {
    "Adam": functools.partial(torch.optim.Adam, lr=1e-3),
    "AdamW": functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.01),
    "SGD": functools.partial(torch.optim.SGD, lr=1e-2, momentum=0.9),
}
VARIANTS = ("as_built", *IMPLEMENTATIONS)


def optimizer_steps(model: torch.nn.Module, build: Any, device: str) -> dict[str, Any]:
    """One optimizer per variant over its own copy of ``model``'s parameters, same gradients."""
    generator = torch.Generator().manual_seed(0)
    steps = {}
    for variant in VARIANTS:
        params = [p.detach().clone().to(device).requires_grad_() for p in model.parameters()]
        for p in params:
            p.grad = (torch.randn(p.shape, generator=generator) * 1e-3).to(device)
        optimizer = build(params)
        if variant != "as_built":
            optimizer, reason = rebuild_optimizer(optimizer, variant)
            if reason is not None:
                raise RuntimeError(f"{variant}: {reason}")
        steps[variant] = optimizer.step
        generator.manual_seed(0)  # the next copy gets the same gradients
    return steps


def training_step_ms(name: str, device: str, quick: bool) -> float:
    """Median ms of one fp32 eager training step of the workload (forward, backward, optimizer)."""
    recipe = get_workload(name, **({"batch_size": 4, "num_samples": 16} if quick else {}))
    trial = Trial(recipe, TurboConfig(device=device), fixed_batches(recipe, 2))
    try:
        (timing,) = measure_interleaved(
            {"step": trial.step}, device=device, warmup=1, repeats=2 if quick else 3
        ).values()
    finally:
        trial.close()
    return timing.median * 1e3


def bench_workload(name: str, device: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    model = get_workload(name, num_samples=16).model()
    params = sum(p.numel() for p in model.parameters())
    tensors = sum(1 for _ in model.parameters())
    step_ms = training_step_ms(name, device, args.quick)
    rows = []
    for optimizer_name, build in OPTIMIZERS.items():
        timings = measure_interleaved(
            optimizer_steps(copy.deepcopy(model), build, device),
            device=device,
            warmup=args.warmup,
            repeats=args.repeats,
            steps_per_repeat=args.steps,
        )
        base = timings["as_built"]
        rows.append(
            {
                "workload": name,
                "params": params,
                "tensors": tensors,
                "optimizer": optimizer_name,
                **{f"{v}_ms": timings[v].median * 1e3 for v in VARIANTS},
                **{f"{v}_spread": timings[v].spread for v in VARIANTS},
                **{f"{v}_ratio": ratio(timings[v], base) for v in IMPLEMENTATIONS},
                "noise_band": noise_band(timings),
                "training_step_ms": step_ms,
                "as_built_share_of_step": base.median * 1e3 / step_ms,
            }
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated")
    parser.add_argument("--repeats", type=int, default=9, help="interleaved rounds (default 9)")
    parser.add_argument("--steps", type=int, default=20, help="steps per timed block (default 20)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--quick", action="store_true", help="tiny run for smoke tests")
    args = parser.parse_args()
    args.warmup = 1 if args.quick else 3
    if args.quick:
        args.repeats, args.steps = 2, 1
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(
        f"optimizer step on {args.device}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; ratio = as-built ms / variant ms"
    )
    print(
        f"{'workload':12} {'optimizer':6} {'params':>7} {'built ms':>9} "
        f"{'foreach':>8} {'fused':>8} {'noise':>6} {'share':>6}"
    )
    results = []
    for name in args.workloads.split(","):
        for row in bench_workload(name, args.device, args):
            results.append(row)
            print(
                f"{name:12} {row['optimizer']:6} {row['params'] / 1e6:6.2f}M "
                f"{row['as_built_ms']:9.2f} {row['foreach_ratio']:7.2f}x "
                f"{row['fused_ratio']:7.2f}x {row['noise_band']:6.1%} "
                f"{row['as_built_share_of_step']:6.1%}"
            )
    print("share: the as-built optimizer step's part of one fp32 eager training step")
    if args.json:
        payload = {
            "device": args.device,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "results": results,
        }
        write_results(args.json, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
