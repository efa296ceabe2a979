"""Bytes and time of DDP gradient communication per comm hook, on N processes (gloo on CPU;
NCCL with ``--device cuda``, one GPU per process).

Each hook (``none``, ``fp16``, ``powersgd`` rank 4; ``bf16`` too when the backend is NCCL) trains
its own copy of a built-in workload (``--workload``, default text) as a ``trials.trial.Trial``
under DDP: the same initial weights and, on each rank, the same seeded batches for every hook. Per
hook: bytes all-reduced per step and the wall time with a bucket reduction in flight (counted by
torchturbo.distributed.comm, means over the later half of the steps, when PowerSGD is past its 2
plain warm-up steps), step time, and the loss at the start and over the last pass through the rank's
batches. Steps of the variants are interleaved (measure.timing.measure_interleaved: warm-up,
rotating order, medians, spread).

Scaling efficiency 1 -> N processes: the ``single`` variant trains the same per-process batches
with the plain engine on rank 0 alone (the other ranks skip it), so
``single_step_ms / none_step_ms`` is the weak-scaling efficiency (1.0 = communication is free).

Loopback between processes on one machine is not a network: bytes saved are real, time saved is
not representative of Ethernet between machines (where compression pays) or NVLink (where it may
not). Run without torchrun; the script launches itself under ``torch.distributed.run``.

    python benchmarks/comm_hooks.py --json out/comm_hooks.json [--quick] [--nproc 2]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import platform
import signal
import statistics
import subprocess
import sys
from typing import Any

import torch
import torch.distributed as dist

from torchturbo.config import TurboConfig
from torchturbo.distributed import DistEnv, Strategy, init_distributed, shutdown
from torchturbo.engine import Turbo
from torchturbo.measure.timing import measure_interleaved
from torchturbo.output.results_file import write_results
from torchturbo.trials.trial import Trial, fixed_batches
from torchturbo.workloads import WORKLOADS, get_workload

HOOKS = ("none", "fp16", "powersgd")
#: Distinct batches each rank cycles through; the last loss is averaged over one such pass.
NUM_BATCHES = 8
NOTE = (
    "processes on one machine talk over loopback, not a network: bytes are exact, time is not "
    "what a real link (Ethernet, InfiniBand, NVLink) would show"
)


NCCL_NOTE = (
    "GPUs of one machine talk over NVLink or PCIe: bytes are exact, time is that link's, not a "
    "network's (compression pays more between machines)"
)


def hook_config(hook: str, device: str = "cpu") -> TurboConfig:
    return TurboConfig(device=device).replace(
        distributed__comm_hook=hook, distributed__powersgd_rank=4, distributed__powersgd_warmup=2
    )


def single_process_step(recipe: Any, batches: list[Any], device: str) -> Any:
    """One step of the plain engine (no DDP) on ``batches``: the 1-process reference."""
    turbo = Turbo(TurboConfig(device=device))
    model, optimizer = recipe.build()
    # This rank alone, inside the torchrun job: not the DDP strategy the launch would choose.
    alone = Strategy(turbo.config, turbo.device, DistEnv())
    model, optimizer, _ = turbo.setup(model, optimizer, strategy=alone)
    next_batch = itertools.cycle(batches).__next__
    return lambda: turbo.step(recipe.loss_fn, next_batch())


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # one core per process: the processes share the machine
    env = init_distributed(args.device)  # cuda: NCCL, one GPU per process
    hooks = HOOKS + (("bf16",) if env.backend == "nccl" else ())
    recipe = get_workload(args.workload)
    batches = fixed_batches(recipe, NUM_BATCHES)  # seeded by rank: each rank has its own data
    trials = {hook: Trial(recipe, hook_config(hook, args.device), batches) for hook in hooks}
    steps = {hook: trial.step for hook, trial in trials.items()}
    # Rank 0 alone trains without DDP; the other ranks skip it and wait in the next collective.
    single = single_process_step(recipe, batches, args.device) if env.rank == 0 else None
    steps["single"] = single or (lambda: None)
    timings = measure_interleaved(
        steps, device=args.device, warmup=3, repeats=args.repeats, steps_per_repeat=args.steps
    )
    results: dict[str, Any] = {}
    for hook, trial in trials.items():
        comm_bytes, comm_seconds = trial.comm_per_step() or (0, None)
        losses = trial.loss_curve()
        results[hook] = {
            "bytes_per_step": comm_bytes,
            "comm_ms_per_step": None if comm_seconds is None else 1e3 * comm_seconds,
            "step_ms": 1e3 * timings[hook].median,
            "step_ms_spread": timings[hook].spread,
            "steps": len(losses),
            "loss_first": losses[0],
            "loss_last": statistics.fmean(losses[-NUM_BATCHES:]),
        }
    if env.rank == 0:
        params = sum(p.numel() for p in recipe.model().parameters())
        write_report(args, results, timings["single"].median, params)
    # Release the DDP models (their reducers and hooks hold the process group) and wait for every
    # rank before tearing the group down: destroying it under live DDP objects can hang on exit.
    trials.clear()
    gc.collect()
    dist.barrier()
    shutdown()


def write_report(
    args: argparse.Namespace, results: dict[str, Any], single_s: float, params: int
) -> None:
    plain = results["none"]
    for row in results.values():
        row["bytes_ratio"] = row["bytes_per_step"] / plain["bytes_per_step"]
        row["step_time_ratio"] = row["step_ms"] / plain["step_ms"]
    single_ms = 1e3 * single_s
    report = {
        "hooks": results,
        "single_process_step_ms": single_ms,
        "scaling_efficiency": single_ms / plain["step_ms"],
        "nproc": dist.get_world_size(),
        "backend": dist.get_backend(),
        "params": params,
        "workload": args.workload,
        "loss_last_is": f"mean loss over the last {NUM_BATCHES} steps (one pass over the batches)",
        "steps_per_repeat": args.steps,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "note": NOTE if args.device == "cpu" else NCCL_NOTE,
    }
    print_table(report)
    if args.json:
        write_results(args.json, report)


def print_table(report: dict[str, Any]) -> None:
    print(
        f"{report['workload']}: {report['nproc']} processes, {report['backend']}, "
        f"{report['params']:,} parameters, {report['hooks']['none']['steps']} steps per hook"
    )
    print(
        f"{'hook':<10}{'bytes/step':>12}{'x none':>8}{'comm ms':>9}{'step ms':>9}{'spread':>8}"
        f"{'loss first -> last':>20}"
    )
    for hook, row in report["hooks"].items():
        comm_ms = row["comm_ms_per_step"]
        print(
            f"{hook:<10}{row['bytes_per_step']:>12,}{row['bytes_ratio']:>8.3f}"
            f"{'n/a' if comm_ms is None else f'{comm_ms:.2f}':>9}"
            f"{row['step_ms']:>9.2f}{row['step_ms_spread']:>8.2f}"
            f"{row['loss_first']:>11.4f} -> {row['loss_last']:.4f}"
        )
    print(
        f"single process: {report['single_process_step_ms']:.2f} ms/step; scaling efficiency "
        f"1 -> {report['nproc']}: {report['scaling_efficiency']:.2f}"
    )
    print(f"note: {report['note']}")


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", str(args.nproc), __file__, "--worker", *argv]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    # A new session, so that on timeout torchrun and all its workers are killed together.
    process = subprocess.Popen(command, env=env, start_new_session=True)
    try:
        return process.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        print(f"comm_hooks: the {args.nproc}-process run took more than {args.timeout}s")
        return 1


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here (rank 0)")
    parser.add_argument("--quick", action="store_true", help="few steps (a smoke test)")
    parser.add_argument("--nproc", type=int, default=2, help="processes (default 2)")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="cuda: NCCL, a GPU per process"
    )
    parser.add_argument(
        "--workload", choices=sorted(WORKLOADS), default="text", help="default: text"
    )
    parser.add_argument("--steps", type=int, default=3, help="steps per timed repeat")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before giving up")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.repeats = 2, 3
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.worker:
        worker(args)
        return 0
    return launch(args, argv)


if __name__ == "__main__":
    sys.exit(main())
