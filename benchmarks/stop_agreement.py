"""What agreeing to stop costs under torchrun: ``Turbo.step`` with and without the stop flag's
all-reduce (``Turbo.agree_to_stop``) after every optimizer step.

``train`` asks every rank at every step boundary whether any rank got a stop signal (one
one-element all-reduce), so that all ranks stop after the same step. Both variants step the same
DDP engine on the same batches, interleaved (``measure_interleaved``: rounds alternate which
variant runs first); rank 0 reports the ratio of medians, the per-round ratio's spread (the
noise), and the all-reduce's own time. In one process ``agree_to_stop`` reads a flag and
communicates nothing; ``benchmarks/overhead.py`` measures the engine there.

    torchrun --standalone --nproc-per-node 2 benchmarks/stop_agreement.py \\
        --json benchmarks/results/stop_agreement-vision.json
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
from pathlib import Path

import torch

from torchturbo.config import TurboConfig
from torchturbo.distributed import current_env, is_main_process, launched
from torchturbo.engine import Turbo
from torchturbo.measure.timing import measure_interleaved, paired_noise
from torchturbo.output.results_file import write_results
from torchturbo.reliability.preemption import StopRequest
from torchturbo.trials.trial import fixed_batches
from torchturbo.workloads import WORKLOADS, get_workload


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="vision")
    parser.add_argument("--repeats", type=int, default=15, help="interleaved rounds (default 15)")
    parser.add_argument("--steps", type=int, default=4, help="steps per round (default 4)")
    parser.add_argument("--json", type=Path, help="write the results here (rank 0)")
    args = parser.parse_args()
    with launched("cpu"):
        if not current_env().is_distributed:
            parser.error("run it under torchrun --nproc-per-node 2 (or more)")
        recipe = get_workload(args.workload)
        config = TurboConfig(device="cpu")
        turbo = Turbo(config)
        model, optimizer = recipe.build()
        turbo.setup(model, optimizer)
        batch = itertools.cycle(fixed_batches(recipe, 8)).__next__
        request = StopRequest()

        def step() -> None:
            turbo.step(recipe.loss_fn, batch())

        def step_and_agree() -> None:
            turbo.step(recipe.loss_fn, batch())
            if turbo.agree_to_stop(request):
                raise RuntimeError("no rank asked to stop")

        timings = measure_interleaved(
            {"step": step, "step_and_agree": step_and_agree},
            device="cpu",
            warmup=2,
            repeats=args.repeats,
            steps_per_repeat=args.steps,
        )
        alone = []
        for _ in range(200):
            begin = time.perf_counter()
            turbo.agree_to_stop(request)
            alone.append(time.perf_counter() - begin)
        if not is_main_process():
            return 0
        with_flag, without = timings["step_and_agree"], timings["step"]
        ratios = [a / b for a, b in zip(with_flag.samples, without.samples, strict=True)]
        result = {
            "workload": recipe.name,
            "processes": current_env().world_size,
            "backend": current_env().backend,
            "step_s": without.median,
            "step_and_agree_s": with_flag.median,
            "overhead": with_flag.median / without.median - 1,
            "overhead_per_round_median": statistics.median(ratios) - 1,
            "noise": paired_noise(with_flag, without),
            "agree_alone_s": statistics.median(alone),
            "rounds": args.repeats,
            "steps_per_round": args.steps,
            "threads": torch.get_num_threads(),
            "load_average": os.getloadavg()[0],
            "torch": torch.__version__,
        }
        print(
            f"{recipe.name} on {result['processes']} gloo ranks: step {1e3 * without.median:.2f} "
            f"ms, with the stop agreement {1e3 * with_flag.median:.2f} ms: overhead "
            f"{100 * result['overhead']:+.2f}% (per-round median "
            f"{100 * result['overhead_per_round_median']:+.2f}%, noise "
            f"{100 * result['noise']:.1f}%); the all-reduce alone "
            f"{1e6 * result['agree_alone_s']:.0f} us"
        )
        if args.json:
            write_results(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
