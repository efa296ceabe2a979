"""Bytes and time of DDP gradient communication per comm hook, on N processes (gloo on CPU).

Each hook (``none``, ``fp16``, ``powersgd`` rank 4; ``bf16`` too when the backend is NCCL) trains
its own copy of the same model (same initial weights, same data stream) under DDP with a
counting hook (torchturbo.distributed.comm): bytes all-reduced per step, wall time with a bucket
reduction in flight per step, step time, and the loss after the run. Steps of the variants are
interleaved (measure.timing.measure_interleaved: warm-up, rotating order, medians, spread).

Scaling efficiency 1 -> N processes: the ``single`` variant runs the same per-process batch
without DDP on rank 0 alone (the other ranks skip it), so ``single_step_ms / none_step_ms`` is
the weak-scaling efficiency (1.0 = communication is free).

Loopback between processes on one machine is not a network: bytes saved are real, time saved is
not representative of Ethernet between machines (where compression pays) or NVLink (where it may
not). Run without torchrun; the script launches itself under ``torch.distributed.run``.

    python benchmarks/comm_hooks.py --json out/comm_hooks.json [--quick] [--nproc 2]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchturbo.config import DistributedConfig
from torchturbo.distributed import CommStats, init_distributed, shutdown, wrap_ddp
from torchturbo.measure.timing import measure_interleaved

HOOKS = ("none", "fp16", "powersgd")
NOTE = (
    "processes on one machine talk over loopback, not a network: bytes are exact, time is not "
    "what a real link (Ethernet, InfiniBand, NVLink) would show"
)


def build_model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 16))


class Variant:
    """One model, optimizer and data stream; ``step`` trains one batch."""

    def __init__(self, model: nn.Module, batch: int, width: int) -> None:
        self.model = model
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
        self.generator = torch.Generator().manual_seed(1 + dist.get_rank())
        self.teacher = torch.randn(width, 16, generator=torch.Generator().manual_seed(2)) / 8
        self.batch, self.width = batch, width
        self.loss = torch.tensor(float("nan"))

    def step(self) -> None:
        x = torch.randn(self.batch, self.width, generator=self.generator)
        loss = ((self.model(x) - torch.tanh(x @ self.teacher)) ** 2).mean()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.loss = loss.detach()


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # one core per process: the processes share the machine
    env = init_distributed("cpu")
    hooks = HOOKS + (("bf16",) if env.backend == "nccl" else ())
    variants: dict[str, Variant] = {}
    stats: dict[str, CommStats] = {}
    for hook in hooks:
        stats[hook] = CommStats()
        config = DistributedConfig(comm_hook=hook, powersgd_rank=4, powersgd_warmup=2)
        model = wrap_ddp(
            build_model(args.width, args.depth), config, torch.device("cpu"), stats=stats[hook]
        )
        variants[hook] = Variant(model, args.batch, args.width)
    single = Variant(build_model(args.width, args.depth), args.batch, args.width)
    steps = {name: variant.step for name, variant in variants.items()}
    # Rank 0 alone trains without DDP; the other ranks skip it and wait in the next collective.
    steps["single"] = single.step if env.rank == 0 else lambda: None
    timings = measure_interleaved(
        steps, device="cpu", warmup=3, repeats=args.repeats, steps_per_repeat=args.steps
    )
    results: dict[str, Any] = {}
    params = sum(p.numel() for p in single.model.parameters())
    for hook in hooks:  # steady-state communication (PowerSGD is past its warm-up here)
        stats[hook].reset()
        for _ in range(args.steps):
            variants[hook].step()
        per_step = {k: v / args.steps for k, v in stats[hook].as_dict().items()}
        results[hook] = {
            "bytes_per_step": round(per_step["bytes"]),
            "comm_ms_per_step": 1e3 * per_step["seconds"],
            "step_ms": 1e3 * timings[hook].median,
            "step_ms_spread": timings[hook].spread,
            "loss_last": float(variants[hook].loss),
        }
    if env.rank == 0:
        write_report(args, results, timings["single"].median, params)
    # Release the DDP models (their reducers and hooks hold the process group) and wait for every
    # rank before tearing the group down: destroying it under live DDP objects can hang on exit.
    variants.clear()
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
        "model": f"MLP {args.depth} x Linear({args.width}, {args.width}) + head",
        "batch_per_process": args.batch,
        "steps_per_repeat": args.steps,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "note": NOTE,
    }
    print_table(report)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))


def print_table(report: dict[str, Any]) -> None:
    print(f"{report['nproc']} processes, {report['backend']}, {report['params']:,} parameters")
    print(
        f"{'hook':<10}{'bytes/step':>12}{'x none':>8}{'comm ms':>9}{'step ms':>9}{'spread':>8}"
        f"{'loss':>8}"
    )
    for hook, row in report["hooks"].items():
        print(
            f"{hook:<10}{row['bytes_per_step']:>12,}{row['bytes_ratio']:>8.3f}"
            f"{row['comm_ms_per_step']:>9.2f}{row['step_ms']:>9.2f}{row['step_ms_spread']:>8.2f}"
            f"{row['loss_last']:>8.4f}"
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
    parser.add_argument("--quick", action="store_true", help="a small model and few steps")
    parser.add_argument("--nproc", type=int, default=2, help="processes (default 2)")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64, help="samples per process per step")
    parser.add_argument("--steps", type=int, default=5, help="steps per timed repeat")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before giving up")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.width, args.depth, args.steps, args.repeats = 256, 2, 3, 3
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
