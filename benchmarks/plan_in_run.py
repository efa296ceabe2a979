"""The batch plan measured inside the run, on a job whose padding the facts expect modest gains of.

The built-in text workload's model (``--size`` as ``torchturbo train`` sizes it) on sequences of
lengths drawn uniformly from ``--lengths LOW HIGH`` (48-96 by default: random batches of 16 pad
about a fifth, length buckets almost nothing, so the facts expect ~1.25x, under the 1.5x above
which they decide alone). Whole ``torchturbo.train`` jobs of ``--steps`` optimizer steps, each
in a fresh process with a cold compile cache of its own, ``--repeats`` times in interleaved
order:

* **in-run**: ``[tune] in_run = true`` alone: the plan is measured on chunks of the epoch;
* **in-run, facts only**: the same with the plan left as the facts chose it (the in-run tuner's
  ``PLAN_MEASURED_BELOW`` set to 0, as before the plan was measured);
* **bf16 rows**: ``[precision] dtype = "bf16"`` on your rows, the trainer's obvious setting
  without ``group_by_length``;
* **bf16 buckets**: ``bf16`` with ``[data] batches = "buckets"`` from the first step.

Each job counts the real tokens its training steps took (the loss's count, outside the in-run
parity checks) and is timed from the start of ``train()`` to its end; printed: seconds, real
tokens, tokens/s (median over repeats, with the spread) and what in-run said of the plan.

    python benchmarks/plan_in_run.py --json benchmarks/results/plan_in_run.json
    python benchmarks/plan_in_run.py --steps 40 --size small --ways in-run   # a smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
import tuner_scale

from torchturbo.config import TurboConfig
from torchturbo.data.collate import pad_collate
from torchturbo.engine import in_run
from torchturbo.measure.machine import summary
from torchturbo.output.results_file import write_results
from torchturbo.recipe import Recipe
from torchturbo.runs.train import train
from torchturbo.workloads import get_workload
from torchturbo.workloads.text import PAD_ID, TokenSequences, make_sequences

WAYS = ("in-run", "in-run, facts only", "bf16 rows", "bf16 buckets")


def recipe(size: str, low: int, high: int, samples: int, pad_to: int = 1) -> Recipe:
    """The text workload at ``size`` on ``samples`` sequences of lengths ``low..high``: its
    tokens and per-token labels, cut at these lengths; its collate pads every batch to a
    multiple of ``pad_to`` (``high``: one fixed length, as a tokenizer's ``max_length``)."""
    base = get_workload("text", size, device="cpu", num_samples=samples)
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(low, high + 1, (samples,), generator=generator)
    tokens, labels, _ = make_sequences(samples, base.extras["num_classes"], 0)
    total = int(lengths.sum())
    repeats = -(-total // len(tokens))
    dataset = TokenSequences(
        tokens.repeat(repeats)[:total], labels.repeat(repeats)[:total], lengths
    )
    return dataclasses.replace(
        base,
        name=f"{base.name}, lengths {low}-{high}",
        dataset=dataset,
        lengths=lengths.tolist(),
        collate=functools.partial(pad_collate, pad_id=PAD_ID, pad_to_multiple=pad_to),
    )


def config_of(way: str) -> TurboConfig:
    config = TurboConfig(device="cpu")
    if way.startswith("in-run"):
        return config.replace(tune__in_run=True)
    config = config.replace(precision__dtype="bf16")
    return config.replace(data__batches="buckets") if way == "bf16 buckets" else config


def child(way: str, args: argparse.Namespace) -> dict[str, Any]:
    """One job in this process: its seconds, the real tokens it trained, what in-run said."""
    if way == "in-run, facts only":
        in_run.PLAN_MEASURED_BELOW = 0.0
    job = recipe(args.size, *args.lengths, args.samples, args.pad_to)
    trained = [0]
    loss_fn = job.loss_fn

    def counted(model: Any, batch: Any) -> Any:
        loss, count = loss_fn(model, batch)
        if torch.is_grad_enabled():  # a training step, not a parity check
            trained[0] += int(count)
        return loss, count

    events: list[str] = []
    job = dataclasses.replace(job, loss_fn=counted)
    begin = time.perf_counter()
    result = train(
        job,
        config_of(way),
        steps=args.steps[0],
        tuned_dir=args.out / "tuned",
        on_event=events.append,
    )
    seconds = time.perf_counter() - begin
    return {
        "train_s": seconds,
        "tokens": trained[0],
        "steps": result.optimizer_steps,
        "first_step_s": result.first_step_s,
        "later_step_s": result.later_step_s,
        "said": [e for e in events if e.startswith("in-run:")],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="large", help="the text workload's size")
    parser.add_argument("--lengths", nargs=2, type=int, default=[48, 96], metavar=("LOW", "HIGH"))
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument(
        "--pad-to",
        type=int,
        default=1,
        help="the collate pads to a multiple of this (the upper length: a fixed shape, where "
        "length buckets save nothing though the lengths' padding says they would)",
    )
    parser.add_argument("--steps", nargs="+", type=int, default=[600])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    parser.add_argument("--out", type=Path, default=Path("plan-in-run-out"))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--setup", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("JOB " + json.dumps(child(args.child, args)))
        return
    payload: dict[str, Any] = {
        "machine": summary(),
        "torch": torch.__version__,
        "size": args.size,
        "lengths": args.lengths,
        "pad_to": args.pad_to,
        "jobs": {},
    }
    print(f"{'steps':>5} {'way':<20} {'seconds':>8} {'tokens':>9} {'tokens/s':>9}  spread")
    for steps in args.steps:
        runs: dict[str, list[dict[str, Any]]] = {way: [] for way in args.ways}
        for repeat in range(args.repeats):
            order = args.ways if repeat % 2 == 0 else list(reversed(args.ways))
            for way in order:
                folder = args.out / f"{steps}-{way.replace(' ', '_').replace(',', '')}-{repeat}"
                extra = ["--size", args.size, "--samples", str(args.samples), "--lengths"]
                extra += [*map(str, args.lengths), "--pad-to", str(args.pad_to)]
                job, _ = tuner_scale.child_job(
                    __file__, way, "text", steps, folder, None, extra=extra
                )
                runs[way].append(job)
        for way, jobs in runs.items():
            done = [j for j in jobs if "error" not in j]
            if not done:
                print(f"{steps:>5} {way:<20} {jobs[0]['error']}")
                continue
            rates = [j["tokens"] / j["train_s"] for j in done]
            median = statistics.median(rates)
            seconds = statistics.median(j["train_s"] for j in done)
            tokens = statistics.median(j["tokens"] for j in done)
            print(
                f"{steps:>5} {way:<20} {seconds:8.1f} {tokens:9,.0f} {median:9.1f}  "
                f"{min(rates):.1f}-{max(rates):.1f}"
            )
            for said in done[-1]["said"]:
                if "length buckets" in said:
                    print(f"{'':<27}{said}")
            payload["jobs"][f"{steps} {way}"] = {"runs": jobs, "tokens_per_s": median}
        if args.json:
            write_results(args.json, payload)


if __name__ == "__main__":
    main()
