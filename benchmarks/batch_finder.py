"""The batch finder's choice against the whole grid of micro-batch sizes, on one workload.

Measures the step footprint (``Trial.memory_footprint``, as the tuner reads it) of the workload's
batch cut into every micro-batch size it can run as (a batch of 16: 16, 8, 6, 4, 3, 2, 1), then
runs the finder (``tune.batch.probe.find_batch``) at budgets of 1/2, 1/3 and 1/5 of the whole
batch's footprint, and prints, for each budget, the largest size of the grid that fits, the
finder's choice, and how many sizes the finder measured.

    python benchmarks/batch_finder.py --workload segmentation --json \
        benchmarks/results/batch_finder-segmentation.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from torchturbo import TurboConfig
from torchturbo.output.tables import format_bytes
from torchturbo.tune.batch.choice import micro_sizes
from torchturbo.tune.batch.probe import find_batch, step_footprint
from torchturbo.workloads import get_workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="segmentation")
    parser.add_argument("--size", default="small", choices=("small", "large"))
    parser.add_argument("--fractions", default="2,3,5", help="budgets: 1/N of the full batch's")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    recipe = get_workload(args.workload, args.size)
    config = TurboConfig(device="cpu")
    grid = {}
    for size in reversed(micro_sizes(recipe.batch_size)):
        grid[size] = step_footprint(recipe, config, size)
        print(f"micro-batch {size:4d}: {format_bytes(grid[size]):>10}", flush=True)
    full = grid[recipe.batch_size]
    assert full is not None
    runs = []
    for fraction in (int(n) for n in args.fractions.split(",")):
        budget = full // fraction
        fitting = [s for s, used in grid.items() if used is not None and used <= budget]
        begin = time.perf_counter()
        chosen = find_batch(recipe, budget, config=config)
        seconds = time.perf_counter() - begin
        runs.append(
            {
                "fraction": fraction,
                "budget_bytes": budget,
                "grid_best": max(fitting, default=0),
                "chosen": chosen.micro_batch,
                "micro_batches": chosen.micro_batches,
                "measured_sizes": [p.size for p in chosen.probes],
                "finder_s": seconds,
                "summary": chosen.summary(),
            }
        )
        print(
            f"1/{fraction} = {format_bytes(budget)}: grid's largest fit {max(fitting, default=0)}"
            f", finder {chosen.micro_batch} x {chosen.micro_batches} after measuring "
            f"{len(chosen.probes)} sizes {[p.size for p in chosen.probes]} in {seconds:.1f} s",
            flush=True,
        )
    record = {"workload": recipe.name, "batch_size": recipe.batch_size, "grid": grid, "runs": runs}
    if args.json:
        args.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
