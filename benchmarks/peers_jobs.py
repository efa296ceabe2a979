"""Whole jobs, each in a fresh process: the trainers' own ways against torchturbo's.

``peers.py`` times warm epochs in one process; a user's job starts cold: imports, the model
built, the first steps compiling when compile is on. This script measures that job. For each
setup (``llama``: a ``LlamaForCausalLM`` from a small config, 2 layers, 64 wide, vocabulary
1,024, SDPA, on 1,536 documents of the text workload's long-tailed lengths; ``bert``: the BERT
tagger of ``peers.py``, 2 layers, 64 wide, an encoder; ``cnn``: the ``vision`` workload's
torchvision-shaped ResNet on 32 px images) and each way, a fresh ``python peers_jobs.py --child
...`` trains ``--steps`` optimizer steps and reports, from the start of training to the last
step's end (the device synchronized): the job's seconds, its first step (one-time costs) and the
median of its later steps. ``--trainer hf`` (default) trains with ``Trainer.train()``; the ways:

1. ``defaults``: only batch size, learning rate, steps; padded random batches;
2. ``group_by_length``: the Trainer's documented length grouping
   (``train_sampling_strategy="group_by_length"``; text only);
3. ``flattening``: the Trainer's padding-free ``DataCollatorWithFlattening`` (causal LM only);
4. ``compile`` and ``flattening+compile``: the same with ``torch_compile=True``, with
   ``--compile``;
5. ``torchturbo``: ``tune`` on ``recipe_from_trainer`` of the defaults' Trainer, whose
   ``max_steps`` is the job's length, then ``TurboTrainer`` with ``training_arguments`` and the
   written turbo.toml, exactly as docs/integrations.md says (its compile cache included).

``--trainer lightning`` fits the same setups with Lightning (``jobs_lightning.py``): its
defaults, ``torch.compile(module)`` with ``--compile``, and torchturbo through
``recipe_from_lightning``, ``trainer_kwargs`` and ``TurboLightningCallback``.

With ``--rounds N`` every short job runs N times, the ways interleaved (A B C, C B A, ...) so
that a busy spell of a shared machine hits every way alike; a job's figure is its median.

Each job's *predicted* time is its first step + (steps - 1) x its later steps' mean; for the
torchturbo way the tuner's own prediction (results.json ``job``) is printed beside it. A long
job (``--long``, default 3,000 steps) is predicted from the short job's measured one-time cost
and warm steps, not measured, unless ``--measure-long`` is given: the short job validates the
prediction (predicted against measured).

    python benchmarks/peers_jobs.py --steps 96 --json benchmarks/results/peers_jobs.json
    python benchmarks/peers_jobs.py --trainer lightning --setups llama bert cnn --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models from configs only: never reach the Hub

import torch
from torch import nn
from transformers import (
    DataCollatorForLanguageModeling,
    DataCollatorForTokenClassification,
    DataCollatorWithFlattening,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    default_data_collator,
)
from transformers.utils import logging as hf_logging

sys.path.insert(0, str(Path(__file__).parent))
import jobs_lightning
import peers

from torchturbo.config import TurboConfig
from torchturbo.integrations.transformers import (
    TurboTrainer,
    recipe_from_trainer,
    training_arguments,
)
from torchturbo.measure.timing import sync
from torchturbo.output.results_file import write_results
from torchturbo.tune.report.write import write_report
from torchturbo.tune.search.run import TuneOptions, tune
from torchturbo.workloads.vision import ResNet, make_images

BATCH_SIZE = 16
WAYS = ("defaults", "group_by_length", "flattening", "compile", "flattening+compile", "torchturbo")
SETUPS = ("llama", "bert", "cnn")


class ImageClassifier(nn.Module):
    """The ResNet as the Trainer wants a model: keyword inputs, a dict with the loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = ResNet(10, "batch")

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        logits = self.net(pixel_values)
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


def images() -> list[dict[str, Any]]:
    pixels, labels = make_images(1536, jobs_lightning.IMAGE_SIZE, 10, seed=0)
    return [{"pixel_values": p, "labels": int(y)} for p, y in zip(pixels, labels, strict=True)]


def ways_for(setup: str, trainer: str, compile: bool) -> list[str]:
    """The ways that apply to a setup and a trainer (compile ones only with ``--compile``)."""
    if trainer == "lightning":
        ways = list(jobs_lightning.WAYS)
    else:
        ways = ["defaults", "compile", "torchturbo"]
        if setup != "cnn":
            ways.insert(1, "group_by_length")
        if setup == "llama":
            ways[2:2] = ["flattening", "flattening+compile"]
    return [w for w in ways if compile or "compile" not in w]


class Clock(TrainerCallback):
    """Train begin and every step's end, the device synchronized; real tokens per batch."""

    def __init__(self) -> None:
        self.begin = 0.0
        self.ends: list[float] = []

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.begin = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        sync(args.device)
        self.ends.append(time.perf_counter())


def trainer_for(
    setup: str, way: str, steps: int, out: Path, config: TurboConfig | None
) -> tuple[Trainer, Clock]:
    clock = Clock()
    arguments: dict[str, Any] = {
        "output_dir": str(out),
        "per_device_train_batch_size": BATCH_SIZE,
        "learning_rate": 1e-3,
        "max_steps": steps,
        "seed": 0,
        "save_strategy": "no",
        "logging_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "use_cpu": True,
    }
    if setup == "llama":
        dataset: Any = peers.documents(1536)
        model_init: Any = lambda: peers.llama(64, 2)  # noqa: E731
        collator: Any = DataCollatorForLanguageModeling(peers.tokenizer(), mlm=False)
        if way.startswith("flattening"):
            collator = DataCollatorWithFlattening()
    elif setup == "cnn":
        dataset = images()
        model_init = ImageClassifier
        collator = default_data_collator
    else:
        dataset = peers.make_data(1536, 0).train
        model_init = lambda: peers.model_init(64, 2)  # noqa: E731
        collator = DataCollatorForTokenClassification(peers.tokenizer())
    if way == "group_by_length":
        arguments["train_sampling_strategy"] = "group_by_length"
    if way.endswith("compile"):
        arguments["torch_compile"] = True
    common = {
        "model_init": model_init,
        "train_dataset": dataset,
        "data_collator": collator,
        "callbacks": [clock],
    }
    if way == "torchturbo" and config is not None:
        args = TrainingArguments(**(arguments | training_arguments(config).kwargs))
        return TurboTrainer(args=args, turbo_config=config, **common), clock
    return Trainer(args=TrainingArguments(**arguments), **common), clock


def child(args: argparse.Namespace) -> None:
    """One job in this (fresh) process; prints its figures as one JSON line."""
    config = TurboConfig.load(args.config) if args.config else None
    if args.trainer == "lightning":
        begin, ends = jobs_lightning.fit_job(args.setup, args.child, args.steps, config)
    else:
        trainer, clock = trainer_for(args.setup, args.child, args.steps, args.out, config)
        trainer.train()
        begin, ends = clock.begin, clock.ends
    steps = [b - a for a, b in zip([begin, *ends], ends, strict=False)]
    print(
        "JOB "
        + json.dumps(
            {
                "job_s": ends[-1] - begin,
                "first_step_s": steps[0],
                "later_step_s": statistics.median(steps[1:]) if len(steps) > 1 else None,
                "steps": len(steps),
            }
        )
    )


def run_child(
    trainer: str, setup: str, way: str, steps: int, out: Path, config: Path | None
) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", way, "--setup", setup, "--trainer", trainer]
    command += ["--threads", str(torch.get_num_threads())]
    command += ["--steps", str(steps), "--out", str(out / f"{trainer}-{setup}-{way}")]
    if config is not None:
        command += ["--config", str(config)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    line = next((x for x in done.stdout.splitlines() if x.startswith("JOB ")), None)
    if done.returncode or line is None:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr else "no output"}
    return json.loads(line.removeprefix("JOB "))


def tuned(
    trainer: str, setup: str, steps: int, budget: float, out: Path
) -> tuple[Path, dict[str, Any]]:
    """tune on the recipe of the defaults' trainer (its max_steps is the horizon); turbo.toml
    and its compile cache written where ``tune`` writes them."""
    folder = out / f"{trainer}-{setup}-tune-{steps}"
    if trainer == "lightning":
        recipe = jobs_lightning.recipe_for(setup, steps)
    else:
        hf, _ = trainer_for(setup, "defaults", steps, folder / "trainer", None)
        recipe = recipe_from_trainer(hf, name=f"peers-{setup}")
    options = TuneOptions(
        time_budget_s=budget, device="cpu", compile_cache_dir=str(folder / "compile-cache")
    )
    config, result = tune(recipe, options)
    if config.compile.cache_dir:
        config = config.replace(compile__cache_dir="compile-cache")
    results = result.to_dict()
    write_report(folder, results, config.to_toml())
    return folder / "turbo.toml", results


def predicted(job: dict[str, Any], steps: int) -> float | None:
    """First step + (steps - 1) x the later steps' mean: a job of ``steps`` from a measured one.
    The mean, not the median: length-grouped batches make step times long-tailed (a few batches
    of long rows), and a job pays every step."""
    if job.get("later_step_s") is None:
        return None
    mean = (job["job_s"] - job["first_step_s"]) / (job["steps"] - 1)
    return job["first_step_s"] + (steps - 1) * mean


def measure_setup(setup: str, args: argparse.Namespace) -> dict[str, Any]:
    """Every way's short job measured (``--rounds`` times, interleaved) and predicted; the long
    job predicted from it (and measured once with ``--measure-long``). torchturbo is tuned for
    each horizon: its config for the long job is measured on a short job and predicted from
    that (the ``torchturbo@long`` row)."""
    ways = [w for w in ways_for(setup, args.trainer, args.compile) if w in args.ways]
    short_config, short_tune = tuned(args.trainer, setup, args.steps, args.tune_budget, args.out)
    long_config, long_tune = tuned(args.trainer, setup, args.long, args.tune_budget, args.out)
    configs = {"torchturbo": short_config, "torchturbo@long": long_config}
    if "torchturbo" in ways:
        ways.append("torchturbo@long")
    runs: dict[str, list[dict[str, Any]]] = {way: [] for way in ways}
    for round_index in range(args.rounds):
        for way in ways if round_index % 2 == 0 else ways[::-1]:
            job = run_child(
                args.trainer,
                setup,
                way.split("@")[0],
                args.steps,
                args.out,
                configs.get(way),
            )
            runs[way].append(job)
            print(f"{args.trainer} {setup} {args.steps} steps, {way}: {job}", flush=True)
    rows: dict[str, Any] = {
        "trainer": args.trainer,
        "tuned": {str(args.steps): short_tune["adopted"], str(args.long): long_tune["adopted"]},
        "tuner_job": {str(args.steps): short_tune["job"], str(args.long): long_tune["job"]},
        "short": {},
        "long": {},
        "runs": runs,
    }
    for way, jobs in runs.items():
        job = median_job(jobs)
        long_job: dict[str, Any] = {"predicted_s": predicted(job, args.long)}
        if way != "torchturbo@long":
            rows["short"][way] = job | {"predicted_s": predicted(job, args.steps)}
        if args.measure_long and way != "torchturbo":
            long_job |= run_child(
                args.trainer,
                setup,
                way.split("@")[0],
                args.long,
                args.out / "long",
                configs.get(way),
            )
        if way != "torchturbo":
            rows["long"][way.split("@")[0]] = long_job
    print_jobs(f"{args.trainer} {setup}", rows, args.steps, args.long)
    return rows


def median_job(jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run whose job time is the median of ``jobs`` (the lower one of an even count), with
    every run's job time beside it; an error when every run failed."""
    done = sorted((j for j in jobs if "job_s" in j), key=lambda j: j["job_s"])
    if not done:
        return jobs[0]
    return done[(len(done) - 1) // 2] | {"job_s_all": [j["job_s"] for j in done]}


def print_jobs(title: str, rows: dict[str, Any], short: int, long: int) -> None:
    """A table of the jobs: measured and predicted seconds, and torchturbo's ratios."""
    print(f"\n{title}: whole jobs, fresh processes (seconds)")
    print(f"{'way':<20} {short:>6} steps {'predicted':>10} {long:>6} steps")
    for way, job in rows["short"].items():
        long_job = rows["long"].get(way, {})
        long_s = long_job.get("job_s", long_job.get("predicted_s"))
        kind = "" if "job_s" in long_job else " (predicted)"
        print(
            f"{way:<20} {_seconds(job.get('job_s')):>12} {_seconds(job.get('predicted_s')):>10} "
            f"{_seconds(long_s):>12}{kind}"
        )
    for horizon in ("short", "long"):
        figures = {
            way: job.get("job_s", job.get("predicted_s")) for way, job in rows[horizon].items()
        }
        ours = figures.pop("torchturbo", None)
        peers_best = min(
            ((s, w) for w, s in figures.items() if s is not None and w != "defaults"),
            default=None,
        )
        if ours is None or figures.get("defaults") is None:
            continue
        line = f"{horizon} job: torchturbo {figures['defaults'] / ours:.2f}x the defaults"
        if peers_best is not None:
            line += f", {peers_best[0] / ours:.2f}x the best other way ({peers_best[1]})"
        print(line)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainer", choices=("hf", "lightning"), default="hf")
    parser.add_argument("--setups", nargs="+", choices=SETUPS, default=["llama"])
    parser.add_argument("--rounds", type=int, default=1, help="runs of each short job (1)")
    parser.add_argument("--steps", type=int, default=96, help="the short job (96 steps)")
    parser.add_argument("--long", type=int, default=3000, help="the long job, predicted (3000)")
    parser.add_argument("--measure-long", action="store_true", help="measure the long job too")
    parser.add_argument("--compile", action="store_true", help="include the compile ways")
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS), help="(all)")
    parser.add_argument("--tune-budget", type=float, default=240.0, help="seconds per tune")
    parser.add_argument("--out", type=Path, default=Path("peers-jobs-out"))
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of the tuner and of every job (default 1: on a shared 2-core "
        "machine two OpenMP threads wait on each other whenever one is descheduled; a BERT "
        "step took 3.2 s instead of 0.2 s at load 5)",
    )
    parser.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    parser.add_argument("--setup", default="llama", help=argparse.SUPPRESS)
    parser.add_argument("--config", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if min(args.steps, args.long, args.rounds, args.threads) < 1:
        parser.error("--steps, --long, --rounds and --threads must be >= 1")
    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    if args.child:
        child(args)
        return
    payload: dict[str, Any] = {
        "torch": torch.__version__,
        "trainer": args.trainer,
        "threads": args.threads,
        "load_average_before": os.getloadavg(),
        "setups": {},
    }
    for setup in args.setups:
        payload["setups"][setup] = measure_setup(setup, args)
    payload["load_average_after"] = os.getloadavg()
    if args.json:
        write_results(args.json, payload)


if __name__ == "__main__":
    main()
