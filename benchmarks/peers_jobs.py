"""Whole jobs, each in a fresh process: the Hugging Face Trainer's ways against torchturbo's.

``peers.py`` times warm epochs in one process; a user's job starts cold: imports, the model
built, the first steps compiling when compile is on. This script measures that job. For each
setup (a ``LlamaForCausalLM`` from a small config: 2 layers, 64 wide, vocabulary 1,024, SDPA, on
1,536 documents of the text workload's long-tailed lengths; the BERT tagger of ``peers.py``, 2
layers, 64 wide) and each way, a fresh ``python peers_jobs.py --child ...`` trains ``--steps``
optimizer steps with ``Trainer.train()`` and reports, from ``on_train_begin`` to the last step's
end (the device synchronized): the job's seconds, its first step (one-time costs), the median of
its later steps and its real (non-padding) tokens. The ways:

1. ``defaults``: only batch size, learning rate, steps; padded random batches;
2. ``group_by_length``: the Trainer's documented length grouping
   (``train_sampling_strategy="group_by_length"``);
3. ``flattening``: the Trainer's padding-free ``DataCollatorWithFlattening`` (causal LM only);
4. ``flattening+compile``: the same with ``torch_compile=True``, with ``--compile``;
5. ``torchturbo``: ``tune`` on ``recipe_from_trainer`` of the defaults' Trainer, whose
   ``max_steps`` is the job's length, then ``TurboTrainer`` with ``training_arguments`` and the
   written turbo.toml, exactly as docs/integrations.md says (its compile cache included).

Each job's *predicted* time is its first step + (steps - 1) x its later steps' mean; for the
torchturbo way the tuner's own prediction (results.json ``job``) is printed beside it. A long
job (``--long``, default 3,000 steps) is predicted from the short job's measured one-time cost
and warm steps, not measured, unless ``--measure-long`` is given: the short job validates the
prediction (predicted against measured).

    python benchmarks/peers_jobs.py --steps 96 --json benchmarks/results/peers_jobs.json
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
from transformers import (
    DataCollatorForLanguageModeling,
    DataCollatorForTokenClassification,
    DataCollatorWithFlattening,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.utils import logging as hf_logging

sys.path.insert(0, str(Path(__file__).parent))
import peers

from torchturbo.config import TurboConfig
from torchturbo.integrations.transformers import (
    TurboTrainer,
    recipe_from_trainer,
    training_arguments,
)
from torchturbo.measure.timing import sync
from torchturbo.output.results_file import write_results
from torchturbo.tune.report import write_report
from torchturbo.tune.search import TuneOptions, tune
from torchturbo.workloads.text import VOCAB_SIZE, make_sequences

BATCH_SIZE = 16
WAYS = ("defaults", "group_by_length", "flattening", "flattening+compile", "torchturbo")


def documents(count: int, seed: int = 0) -> list[dict[str, list[int]]]:
    """Long-tailed lengths (the text workload's: median 32 tokens, a tail to 512) of token ids
    with a learnable next-token rule (the tagging labels become the next tokens' ids)."""
    tokens, _, lengths = make_sequences(count, 16, seed)
    samples, start = [], 0
    for length in lengths.tolist():
        samples.append({"input_ids": tokens[start : start + length].tolist()})
        start += length
    return samples


def llama(hidden: int, layers: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


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
        dataset: Any = documents(1536)
        model_init: Any = lambda: llama(64, 2)  # noqa: E731
        collator: Any = DataCollatorForLanguageModeling(peers.tokenizer(), mlm=False)
        if way.startswith("flattening"):
            collator = DataCollatorWithFlattening()
    else:
        dataset = peers.make_data(1536, 0).train
        model_init = lambda: peers.model_init(64, 2)  # noqa: E731
        collator = DataCollatorForTokenClassification(peers.tokenizer())
    if way == "group_by_length":
        arguments["train_sampling_strategy"] = "group_by_length"
    if way == "flattening+compile":
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
    trainer, clock = trainer_for(args.setup, args.child, args.steps, args.out, config)
    trainer.train()
    steps = [b - a for a, b in zip([clock.begin, *clock.ends], clock.ends, strict=False)]
    print(
        "JOB "
        + json.dumps(
            {
                "job_s": clock.ends[-1] - clock.begin,
                "first_step_s": steps[0],
                "later_step_s": statistics.median(steps[1:]) if len(steps) > 1 else None,
                "steps": len(steps),
            }
        )
    )


def run_child(setup: str, way: str, steps: int, out: Path, config: Path | None) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", way, "--setup", setup]
    command += ["--steps", str(steps), "--out", str(out / f"{setup}-{way}")]
    if config is not None:
        command += ["--config", str(config)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    line = next((x for x in done.stdout.splitlines() if x.startswith("JOB ")), None)
    if done.returncode or line is None:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr else "no output"}
    return json.loads(line.removeprefix("JOB "))


def tuned(setup: str, steps: int, budget: float, out: Path) -> tuple[Path, dict[str, Any]]:
    """tune on recipe_from_trainer of the defaults' Trainer (its max_steps is the horizon);
    turbo.toml and its compile cache written where ``tune`` writes them."""
    folder = out / f"{setup}-tune-{steps}"
    trainer, _ = trainer_for(setup, "defaults", steps, folder / "trainer", None)
    options = TuneOptions(
        time_budget_s=budget, device="cpu", compile_cache_dir=str(folder / "compile-cache")
    )
    config, result = tune(recipe_from_trainer(trainer, name=f"peers-{setup}"), options)
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
    """Every way's short job measured (and predicted); the long job predicted from it (and
    measured with ``--measure-long``). torchturbo is tuned for each horizon: its config for
    the long job is measured on a short job and predicted from that."""
    ways = [w for w in args.ways if setup == "llama" or not w.startswith("flattening")]
    if not args.compile and "flattening+compile" in ways:
        ways.remove("flattening+compile")
    short_config, short_tune = tuned(setup, args.steps, args.tune_budget, args.out)
    long_config, long_tune = tuned(setup, args.long, args.tune_budget, args.out)
    rows: dict[str, Any] = {
        "tuned": {str(args.steps): short_tune["adopted"], str(args.long): long_tune["adopted"]},
        "tuner_job": {str(args.steps): short_tune["job"], str(args.long): long_tune["job"]},
        "short": {},
        "long": {},
    }
    for way in ways:
        config = short_config if way == "torchturbo" else None
        job = run_child(setup, way, args.steps, args.out, config)
        job["predicted_s"] = predicted(job, args.steps)
        rows["short"][way] = job
        print(f"{setup} {args.steps} steps, {way}: {job}", flush=True)
        base = job
        if way == "torchturbo":
            base = run_child(setup, way, args.steps, args.out / "long", long_config)
        long_job: dict[str, Any] = {"predicted_s": predicted(base, args.long)}
        if args.measure_long:
            config = long_config if way == "torchturbo" else None
            long_job |= run_child(setup, way, args.long, args.out / "long", config)
        rows["long"][way] = long_job
        print(f"{setup} {args.long} steps, {way}: {long_job}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setups", nargs="+", choices=("llama", "bert"), default=["llama"])
    parser.add_argument("--steps", type=int, default=96, help="the short job (96 steps)")
    parser.add_argument("--long", type=int, default=3000, help="the long job, predicted (3000)")
    parser.add_argument("--measure-long", action="store_true", help="measure the long job too")
    parser.add_argument("--compile", action="store_true", help="include flattening+compile")
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS), help="(all)")
    parser.add_argument("--tune-budget", type=float, default=240.0, help="seconds per tune")
    parser.add_argument("--out", type=Path, default=Path("peers-jobs-out"))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    parser.add_argument("--setup", default="llama", help=argparse.SUPPRESS)
    parser.add_argument("--config", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    hf_logging.set_verbosity_error()
    if args.child:
        child(args)
        return
    payload: dict[str, Any] = {
        "torch": torch.__version__,
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
