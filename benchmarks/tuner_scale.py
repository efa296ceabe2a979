"""The tuner at the scale people train: whole Trainer jobs of a 45M-parameter decoder (and an
encoder) with a 32k vocabulary, each from a fresh process, against the tuner's pick.

For each setup, a Hugging Face ``Trainer`` job of ``--steps`` optimizer steps (batch 8, its own
``max_steps``) on 800 documents of long-tailed length (16-512 tokens), timed from the start of
``train()`` to its last step (first steps and any compile included), counting the real tokens it
trained (labels that are not -100, shifted as the causal LM's loss shifts them):

1. **the trainer's own ways**: ``defaults`` (fp32, random batches), ``group_by_length``, and
   where this CPU runs bf16 natively ``bf16+group_by_length`` (elsewhere it is listed, not run:
   an emulated bf16 step takes tens of times longer), and for the decoder the padding-free
   ``DataCollatorWithFlattening``;
2. **the grid**: every combination of precision (fp32, and bf16 where native) x batching (random
   rows, length buckets, packing for the decoder) x ``torch.compile`` (off, on) x the chunked
   loss (decoder: off, on), each through ``TurboTrainer`` and ``training_arguments`` as
   docs/integrations.md says;
3. **the tuner** (measured first, so that a run stopped part way has it): ``torchturbo tune`` on
   ``recipe_from_trainer`` of the defaults' Trainer, at its default budget (``--tune-budget``, 5
   min), in a fresh process, then the job it wrote (``turbo.toml`` and its compile cache)
   trained the documented way.

``--setups lightning`` trains the decoder through Lightning instead: its defaults (a shuffled
DataLoader of 8 rows, fp32) and, where bf16 is native, ``precision="bf16-mixed"``,
``recipe_from_lightning(module, datamodule, trainer=...)`` tuned the same way, and the tuned job
with ``trainer_kwargs`` and ``TurboLightningCallback``.

``--device cuda`` runs every job, and the tune, on the GPU; ``--model-size`` (45m, 166m, 400m)
and ``--batch-size`` size them for it. On a GPU the trainer's own ways are those a GPU user
sets: ``bf16=True`` with ``group_by_length``, with the padding-free
``DataCollatorWithFlattening`` (decoder), and with ``torch_compile=True`` or
``use_liger_kernel=True`` (where liger-kernel is installed) on top; fp32 defaults stay the
reference.

It prints, per setup, every job's train seconds, real tokens and real tokens per second, then
the tuned job against the grid's best and against the trainer's best own way, and the tuner's
measured step (its results.json) against the tuned job's median later step: what the tuner
measured should be what the job runs.

    python benchmarks/tuner_scale.py --json benchmarks/results/tuner_scale.json
    python benchmarks/tuner_scale.py --setups decoder --steps 20 --skip-grid   # a smoke run
    python benchmarks/tuner_scale.py --again out.json --repeats 2 --json out.json  # medians
    python benchmarks/tuner_scale.py --device cuda --model-size 166m --batch-size 16 \
        --setups decoder --steps 300 --skip-grid --tune-budget 90s --json gpu.json
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models from configs only: never reach the Hub

import lightning.pytorch as pl
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import (
    BertConfig,
    BertForTokenClassification,
    DataCollatorForLanguageModeling,
    DataCollatorForTokenClassification,
    DataCollatorWithFlattening,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.utils import logging as hf_logging

from torchturbo.base.device import to_device
from torchturbo.config import TurboConfig
from torchturbo.integrations.lightning import (
    TurboLightningCallback,
    recipe_from_lightning,
    trainer_kwargs,
)
from torchturbo.integrations.transformers import (
    TurboTrainer,
    recipe_from_trainer,
    training_arguments,
)
from torchturbo.measure.flops import count_step_flops
from torchturbo.measure.machine import summary
from torchturbo.measure.native import emulated
from torchturbo.measure.peak import measured_peak_flops
from torchturbo.measure.timing import sync
from torchturbo.output.results_file import write_results
from torchturbo.output.units import parse_duration
from torchturbo.recipe import Recipe

VOCAB = 32_000
BATCH_SIZE = 8
DOCUMENTS = 800
SETUPS = ("decoder", "encoder", "lightning")
CLASSES = 16
#: Model sizes by their decoder's parameters: (hidden, layers). The 45M decoder and 36M encoder
#: are the CPU's; 166m is the first H200 run's decoder (hidden 1024, 8 layers).
MODEL_SIZES = {"45m": (512, 4), "166m": (1024, 8), "400m": (1536, 12)}


def scale() -> tuple[str, str, int]:
    """(device, model size, batch size) of this run: set by ``main`` in the environment, so
    that the tune's and the jobs' fresh processes build the same models on the same device."""
    return (
        os.environ.get("TUNER_SCALE_DEVICE", "cpu"),
        os.environ.get("TUNER_SCALE_MODEL", "45m"),
        int(os.environ.get("TUNER_SCALE_BATCH", str(BATCH_SIZE))),
    )


def documents(setup: str, count: int = DOCUMENTS, seed: int = 0) -> list[dict[str, Any]]:
    """Lognormal lengths (median 64, clamped to 16-512) of token ids a model can learn: half the
    tokens follow from the one before by a fixed rule, the rest are drawn Zipf-like; the
    encoder's labels are a function of each token and the one before it."""
    generator = torch.Generator().manual_seed(seed)
    lengths = (64 * torch.empty(count).normal_(0, 0.9, generator=generator).exp()).round()
    lengths = lengths.clamp(16, 512).long().tolist()
    frequency = 1.0 / (torch.arange(VOCAB - 1, dtype=torch.float64) + 20)
    samples = []
    for length in lengths:
        drawn = torch.multinomial(frequency, length, replacement=True, generator=generator) + 1
        follows = torch.rand(length, generator=generator) < 0.5
        ids = drawn.clone()
        for i in range(1, length):
            if follows[i]:
                ids[i] = (ids[i - 1] * 7 + 11) % (VOCAB - 1) + 1
        sample: dict[str, Any] = {"input_ids": ids.tolist()}
        if setup == "encoder":
            previous = torch.roll(ids, 1)
            previous[0] = 0
            sample["labels"] = ((ids + previous % 3) % CLASSES).tolist()
        samples.append(sample)
    return samples


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the ids, built in code: the collators pad with it."""
    vocab = {"[PAD]": 0, **{f"t{i}": i for i in range(1, VOCAB)}}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t1")),
        pad_token="[PAD]",
        unk_token="t1",
    )


def model(setup: str) -> torch.nn.Module:
    """The decoder: a LlamaForCausalLM (45m: 4 layers, hidden 512, 45M parameters; SDPA); the
    encoder: a BERT token tagger (45m: 6 layers, hidden 512, 36M); ``--model-size`` scales both."""
    torch.manual_seed(0)
    hidden, layers = MODEL_SIZES[scale()[1]]
    if setup == "decoder":
        return LlamaForCausalLM(
            LlamaConfig(
                vocab_size=VOCAB,
                hidden_size=hidden,
                intermediate_size=32 * round(hidden * 2.6875 / 32),
                num_hidden_layers=layers,
                num_attention_heads=hidden // 64,
                num_key_value_heads=hidden // 64,
                max_position_embeddings=1024,
                attn_implementation="sdpa",
                use_cache=False,
            )
        )
    return BertForTokenClassification(
        BertConfig(
            vocab_size=VOCAB,
            hidden_size=hidden,
            num_hidden_layers=layers + 2,
            num_attention_heads=hidden // 64,
            intermediate_size=4 * hidden,
            max_position_embeddings=512,
            num_labels=CLASSES,
        )
    )


def arguments(out: Path, steps: int, **extra: Any) -> TrainingArguments:
    device, _, batch = scale()
    return TrainingArguments(
        **{
            "output_dir": str(out),
            "per_device_train_batch_size": batch,
            "learning_rate": 1e-3,
            "max_steps": steps,
            "seed": 0,
            "save_strategy": "no",
            "logging_strategy": "no",
            "report_to": "none",
            "disable_tqdm": True,
            "use_cpu": device == "cpu",
            **extra,
        }
    )


def collator(setup: str, flatten: bool = False) -> Any:
    if setup == "encoder":
        return DataCollatorForTokenClassification(tokenizer())
    if flatten:
        return DataCollatorWithFlattening()
    return DataCollatorForLanguageModeling(tokenizer(), mlm=False)


def trainer(setup: str, steps: int, out: Path) -> Trainer:
    """The user's Trainer, its defaults: what ``recipe`` tunes."""
    return Trainer(
        model=model(setup),
        args=arguments(out, steps),
        train_dataset=documents(setup),
        data_collator=collator(setup),
    )


def recipe(setup: str = "decoder", steps: int = 100) -> Recipe:
    """``torchturbo tune benchmarks/tuner_scale.py:recipe`` tunes the decoder's Trainer."""
    out = Path(os.environ.get("TUNER_SCALE_OUT", "tuner-scale-out"))
    return recipe_from_trainer(trainer(setup, steps, out / "recipe"), name=f"scale-{setup}")


def lightning_recipe() -> Recipe:
    """``tune`` on the decoder as a Lightning user trains it (``--trainer lightning``)."""
    steps = int(os.environ.get("TUNER_SCALE_STEPS", "100"))
    return recipe_from_lightning(
        LanguageModule(), Documents(), trainer=lightning_trainer(steps, []), planned_steps=None
    )


class LanguageModule(pl.LightningModule):
    """The decoder in a LightningModule: its loss is the training step's."""

    def __init__(self) -> None:
        super().__init__()
        self.model = model("decoder")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Documents(pl.LightningDataModule):
    """The documents in a shuffled DataLoader of 8 rows, padded by the LM collator."""

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(
            documents("decoder"),
            batch_size=scale()[2],
            shuffle=True,
            generator=torch.Generator().manual_seed(0),
            collate_fn=collator("decoder"),
        )


def lightning_trainer(steps: int, callbacks: list[pl.Callback], **kwargs: Any) -> pl.Trainer:
    settings: dict[str, Any] = {
        "accelerator": "gpu" if scale()[0] == "cuda" else "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return pl.Trainer(max_steps=steps, callbacks=callbacks, **(settings | kwargs))


class LightningMeter(pl.Callback):
    """Train begin, every step's end and the real tokens of every batch, for Lightning."""

    def __init__(self, net: torch.nn.Module) -> None:
        self.meter = Meter(net, causal=True)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.meter.begin = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        sync(trainer.strategy.root_device)
        self.meter.ends.append(time.perf_counter())


def lightning_job(steps: int, way: str, config: Path | None) -> Meter:
    """The decoder's Lightning job: its defaults, ``precision="bf16-mixed"`` (``way``
    ``bf16-mixed``), or the tuned config the documented way."""
    module = LanguageModule()
    clock = LightningMeter(module.model)
    callbacks: list[pl.Callback] = [clock]
    kwargs: dict[str, Any] = {"precision": "bf16-mixed"} if way == "bf16-mixed" else {}
    if config is not None:
        turbo = TurboConfig.load(config)
        kwargs = trainer_kwargs(turbo).kwargs
        callbacks.append(TurboLightningCallback(turbo))
    lightning_trainer(steps, callbacks, **kwargs).fit(module, datamodule=Documents())
    return clock.meter


def encoder_recipe() -> Recipe:
    return recipe("encoder", int(os.environ.get("TUNER_SCALE_STEPS", "100")))


def decoder_recipe() -> Recipe:
    return recipe("decoder", int(os.environ.get("TUNER_SCALE_STEPS", "100")))


class Meter(TrainerCallback):
    """Train begin and every step's end (the device synchronized), and the real tokens of every
    batch the model was given (labels not -100; a causal LM's shifted as its loss shifts them)."""

    def __init__(self, net: torch.nn.Module, causal: bool) -> None:
        self.begin = 0.0
        self.ends: list[float] = []
        self.tokens = 0
        self.causal = causal
        net.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module: Any, args: Any, kwargs: Any) -> None:
        labels = kwargs.get("labels")
        if isinstance(labels, torch.Tensor) and torch.is_grad_enabled():
            labels = labels[..., 1:] if self.causal else labels
            self.tokens += int((labels != -100).sum())

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.begin = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        sync(args.device)
        self.ends.append(time.perf_counter())


def job_trainer(setup: str, way: str, steps: int, out: Path, config: Path | None) -> Any:
    """The Trainer of one way: a peer's own arguments, or TurboTrainer on a turbo.toml."""
    net = model(setup)
    meter = Meter(net, causal=setup == "decoder")
    common = {"model": net, "train_dataset": documents(setup), "callbacks": [meter]}
    if config is not None:
        turbo = TurboConfig.load(config)
        args = arguments(out, steps, **training_arguments(turbo).kwargs)
        made = TurboTrainer(args=args, turbo_config=turbo, data_collator=collator(setup), **common)
        return made, meter
    settings = set(way.split("+"))
    extra: dict[str, Any] = {}
    if "group_by_length" in settings:
        extra["train_sampling_strategy"] = "group_by_length"
    if "bf16" in settings:
        extra["bf16"] = True
    if "torch_compile" in settings:
        extra["torch_compile"] = True
    if "liger" in settings:
        extra["use_liger_kernel"] = True
    flatten = "flattening" in settings
    made = Trainer(
        args=arguments(out, steps, **extra), data_collator=collator(setup, flatten), **common
    )
    return made, meter


def child(args: argparse.Namespace) -> None:
    """One job in this fresh process; prints its figures as one JSON line."""
    if args.setup == "lightning":
        meter = lightning_job(args.steps, args.child, args.config)
    else:
        made, meter = job_trainer(args.setup, args.child, args.steps, args.out, args.config)
        made.train()
    steps = [b - a for a, b in itertools.pairwise([meter.begin, *meter.ends])]
    train_s = meter.ends[-1] - meter.begin
    print(
        "JOB "
        + json.dumps(
            {
                "train_s": train_s,
                "steps": len(steps),
                "first_step_s": steps[0],
                "later_step_s": statistics.median(steps[1:]) if len(steps) > 1 else None,
                "tokens": meter.tokens,
                "tokens_per_s": meter.tokens / train_s,
            }
        )
    )


#: A job may take this many times the first job's process seconds, plus a cold compile where
#: its way compiles, before it is stopped: sized from a measurement, not a guess (the first GPU
#: run lost two peers' jobs to a fixed 60-s timeout).
JOB_TIMEOUT_FACTOR = 3
COMPILE_ALLOWANCE_S = 180


def job_timeout(first_job: dict[str, Any], way: str) -> float | None:
    """The seconds ``way``'s job may take, from the first job's (None: no limit)."""
    seconds = first_job.get("process_s")
    if seconds is None:
        return None
    compiles = "compile" in way or way in ("torchturbo",)
    return JOB_TIMEOUT_FACTOR * seconds + (COMPILE_ALLOWANCE_S if compiles else 0)


def run_job(
    setup: str,
    way: str,
    steps: int,
    out: Path,
    config: Path | None,
    timeout: float | None = None,
) -> dict[str, Any]:
    """``way``'s job in a fresh process (its own compile cache folder, cold), stopped after
    ``timeout`` seconds."""
    job, _ = child_job(__file__, way, setup, steps, out / f"{setup}-{way}", config, timeout)
    return job


def child_job(
    script: str,
    way: str,
    setup: str,
    steps: int,
    folder: Path,
    config: Path | None,
    timeout: float | None = None,
    extra: Sequence[str] = (),
) -> tuple[dict[str, Any], str]:
    """``script --child way`` (and ``extra`` arguments) in a fresh process with a cold compile
    cache of its own in ``folder``: the JOB line it printed (or the error) with the process's
    seconds, and its stderr."""
    command = [sys.executable, script, "--child", way, "--setup", setup]
    command += ["--steps", str(steps), "--out", str(folder), *extra]
    if config is not None:
        command += ["--config", str(config)]
    env = os.environ | {"TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor-cache")}
    begin = time.perf_counter()
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, check=False, env=env, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        error = f"stopped after {timeout:.0f} s (the limit sized from the first job)"
        return {"error": error}, ""
    line = next((x for x in done.stdout.splitlines() if x.startswith("JOB ")), None)
    if done.returncode or line is None:
        error = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "no output"
        return {"error": error}, done.stderr
    job = json.loads(line.removeprefix("JOB "))
    return job | {"process_s": time.perf_counter() - begin}, done.stderr


def grid_configs(setup: str, precisions: list[str]) -> dict[str, TurboConfig]:
    """Every precision x batching x compile x chunked-loss combination of the setup."""
    base = TurboConfig(device=scale()[0])
    batchings = {"rows": {}, "buckets": {"data__batches": "buckets"}}
    if setup == "decoder":
        batchings["packing"] = {"data__batches": "packed"}
    compiles = {"eager": {}, "compile": {"compile__mode": "default"}}
    losses = {"": {}}
    if setup == "decoder":
        losses["chunked"] = {"chunked_loss__enabled": True}
    grid = {}
    for precision, (batching, b), (compiling, c), (loss, chunk) in itertools.product(
        precisions, batchings.items(), compiles.items(), losses.items()
    ):
        name = "+".join(x for x in (precision, batching, compiling, loss) if x)
        grid[name] = base.replace(precision__dtype=precision, **b, **c, **chunk)
    return grid


def peer_ways(setup: str, native_bf16: bool) -> tuple[list[str], dict[str, str]]:
    """The trainer's own ways that run here, and those left out with the reason."""
    if scale()[0] == "cuda":
        return gpu_peer_ways(setup)
    ways = ["defaults", "group_by_length"]
    left_out = {}
    if native_bf16:
        ways.append("bf16+group_by_length")
    else:
        left_out["bf16+group_by_length"] = f"not run: {emulated('cpu', 'bf16')}"
    if setup == "decoder":
        ways.append("flattening")
    return ways, left_out


def gpu_peer_ways(setup: str) -> tuple[list[str], dict[str, str]]:
    """A GPU user's ways: bf16 with length grouping or, for the decoder, the padding-free
    collator, then torch.compile or Liger-Kernel on top (fp32 is no GPU user's setting)."""
    batching = "flattening" if setup == "decoder" else "group_by_length"
    ways = ["bf16+group_by_length", f"bf16+{batching}+torch_compile"]
    if setup == "decoder":
        ways.insert(1, "bf16+flattening")
    left_out = {}
    if importlib.util.find_spec("liger_kernel") is None:
        left_out[f"bf16+{batching}+liger"] = "not run: liger-kernel is not installed"
    elif setup == "decoder":
        ways.append(f"bf16+{batching}+liger")
    return ways, left_out


def job_config(out: Path, setup: str, way: str) -> Path | None:
    """The turbo.toml the job of ``way`` (``torchturbo``, ``grid NAME`` or a trainer's own way)
    trains with, where this script writes it; None for a trainer's own settings."""
    if way == "torchturbo":
        return out / f"{setup}-tune" / "turbo.toml"
    if way.startswith("grid "):
        return out / f"{setup}-grid-{way.removeprefix('grid ')}.toml"
    return None


#: Seconds a tune may take beyond its budget (start-up, the model's facts, writing its report).
TUNE_OVERHEAD_S = 240


def tune_setup(
    setup: str, steps: int, budget: str, out: Path, script: str = __file__
) -> tuple[Path, dict[str, Any]]:
    """``torchturbo tune`` in a fresh process, as a user runs it, on the recipe of the setup's
    default Trainer (``max_steps`` is the job's length): ``script``'s ``{setup}_recipe``."""
    toml = job_config(out, setup, "torchturbo")
    assert toml is not None
    folder = toml.parent
    target = f"{script}:{setup}_recipe"
    command = [sys.executable, "-m", "torchturbo", "tune", target, "--device", scale()[0]]
    command += ["--time-budget", budget, "--out", str(folder)]
    env = os.environ | {"TUNER_SCALE_OUT": str(out), "TUNER_SCALE_STEPS": str(steps)}
    begin = time.perf_counter()
    # The tune keeps to its budget; its start-up, facts and report come on top.
    limit = parse_duration(budget) + TUNE_OVERHEAD_S
    done = subprocess.run(
        command, capture_output=True, text=True, check=False, env=env, timeout=limit
    )
    elapsed = time.perf_counter() - begin
    if done.returncode:
        raise RuntimeError(f"tune failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    results = json.loads((folder / "results.json").read_text())
    return toml, results | {"tune_process_s": elapsed, "tune_stdout": done.stdout}


def tuned_step_ms(results: dict[str, Any]) -> float | None:
    """The chosen config's step as the tuner measured it: its confirmation's rounds, else the
    row that adopted it."""
    confirmation = results.get("confirmation") or {}
    if confirmation.get("step_ms") is not None:
        return float(confirmation["step_ms"])
    rows = [r for r in results.get("candidates", []) if r.get("verdict") == "adopted"]
    return float(rows[-1]["step_ms"]) if rows and rows[-1].get("step_ms") else None


def measure_setup(
    setup: str, args: argparse.Namespace, save: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    """The tuner and its job first, then the trainer's ways, then the grid; ``save`` is called
    with the row after every job, so that a run stopped part way keeps what it measured."""
    native_bf16 = emulated(scale()[0], "bf16") is None
    peers, left_out = peer_ways(setup, native_bf16)
    if setup == "lightning":  # Lightning has no group_by_length: its obvious setting is bf16
        peers = ["defaults", *(["bf16-mixed"] if native_bf16 else [])]
        left_out = {} if native_bf16 else {"bf16-mixed": left_out["bf16+group_by_length"]}
    toml, results = tune_setup(setup, args.steps, args.tune_budget, args.out)
    jobs: dict[str, dict[str, Any]] = {}
    row: dict[str, Any] = {
        "jobs": jobs,
        "left_out": left_out,
        "tuned": results["adopted"],
        "tune_elapsed_s": results["elapsed_s"],
        "tune_process_s": results["tune_process_s"],
        "tune_headline": next(
            (x for x in results["tune_stdout"].splitlines() if "steps (" in x), ""
        ),
        "tuned_step_ms": tuned_step_ms(results),
        "candidates": [
            {k: c.get(k) for k in ("name", "verdict", "reason", "ratio", "rounds", "spent_s")}
            for c in results["candidates"]
        ],
    }
    jobs["torchturbo"] = run_job(setup, "torchturbo", args.steps, args.out, toml)
    print(f"{setup} torchturbo ({', '.join(results['adopted'])}): {jobs['torchturbo']}")
    save(row)
    for way in peers:
        limit = job_timeout(jobs["torchturbo"], way)
        jobs[way] = run_job(setup, way, args.steps, args.out, None, limit)
        print(f"{setup} {way}: {jobs[way]}", flush=True)
        save(row)
    precisions = [p for p in args.precisions if native_bf16 or p == "fp32"]
    skip = args.skip_grid or setup == "lightning"
    grid = {} if skip else grid_configs(setup, precisions)
    for name, config in grid.items():
        path = job_config(args.out, setup, f"grid {name}")
        assert path is not None
        path.parent.mkdir(parents=True, exist_ok=True)
        config.save(path)
        limit = job_timeout(jobs["torchturbo"], name)
        jobs[f"grid {name}"] = run_job(setup, f"grid-{name}", args.steps, args.out, path, limit)
        print(f"{setup} grid {name}: {jobs[f'grid {name}']}", flush=True)
        save(row)
    return row


def flops_per_token(setup: str) -> float:
    """Useful FLOPs of a training step per real token (``FlopCounterMode``, fp32 eager, on
    eight documents without padding: flattened for the decoder, one row each for the encoder)."""
    device = scale()[0]
    net = model(setup).to(device)
    samples = documents(setup, count=8)
    if setup == "encoder":
        total = 0.0
        for sample in samples:
            batch = to_device(collator(setup)([sample]), device)
            total += count_step_flops(lambda b=batch: net(**b).loss.backward())
        return total / sum(len(s["input_ids"]) for s in samples)
    batch = to_device(collator(setup, flatten=True)(samples), device)
    flops = count_step_flops(lambda: net(**batch).loss.backward())
    return flops / int((batch["labels"][..., 1:] != -100).sum())


def add_mfu(row: dict[str, Any], setup: str) -> None:
    """Each job's model FLOPs utilisation: useful FLOPs per real token x real tokens per second,
    over the matrix-product peak measured here in bf16 (fp32 on a CPU without it)."""
    device = torch.device(scale()[0])
    dtype = torch.bfloat16 if emulated(device, "bf16") is None else torch.float32
    peak = measured_peak_flops(device, dtype)
    per_token = flops_per_token(setup)
    row["flops_per_token"], row["mfu_peak_tflops"] = per_token, peak / 1e12
    row["mfu_peak"] = f"{str(dtype).removeprefix('torch.')} matmul peak measured here"
    for job in row["jobs"].values():
        if "tokens_per_s" in job:
            job["mfu"] = per_token * job["tokens_per_s"] / peak


def leaders(row: dict[str, Any]) -> list[str]:
    """The jobs the ratios compare: the tuned one, the grid's fastest and the fastest peer."""
    rate = {w: j["tokens_per_s"] for w, j in row["jobs"].items() if "tokens_per_s" in j}
    grid = [w for w in rate if w.startswith("grid ")]
    peers = [w for w in rate if w != "torchturbo" and not w.startswith("grid ")]
    chosen = ["torchturbo"] if "torchturbo" in rate else []
    chosen += [max(ways, key=rate.__getitem__) for ways in (grid, peers) if ways]
    return chosen


def repeat_leaders(setup: str, row: dict[str, Any], args: argparse.Namespace) -> None:
    """Run the leaders' jobs ``args.repeats`` more times, interleaved, each from a fresh process
    and a cold compile cache: one job of a config varies by up to ~10% between runs, about the
    gap the ratios are asked to resolve. Their figures become the medians of all their runs."""
    ways = leaders(row)
    runs: dict[str, list[dict[str, Any]]] = {w: [row["jobs"][w]] for w in ways}
    for _ in range(args.repeats):
        for way in ways:
            child_way = way.replace("grid ", "grid-", 1)
            shutil.rmtree(args.out / f"{setup}-{child_way}", ignore_errors=True)
            job = run_job(setup, child_way, args.steps, args.out, job_config(args.out, setup, way))
            print(f"{setup} {way} again: {job}", flush=True)
            runs[way].append(job)
    row["runs"] = runs
    for way, done in runs.items():
        good = [j for j in done if "tokens_per_s" in j]
        if good:
            median = {k: statistics.median(j[k] for j in good) for k in MEDIAN_FIELDS}
            row["jobs"][way] = good[0] | median | {"runs": len(good)}


#: The figures of a job that the repeats replace with their medians.
MEDIAN_FIELDS = ("train_s", "first_step_s", "later_step_s", "tokens_per_s")


def report(setup: str, row: dict[str, Any]) -> dict[str, Any]:
    """Print the setup's table and its ratios; return the ratios."""
    jobs = row["jobs"]
    device, size, batch = scale()
    print(f"\n{setup} ({size}, {device}): whole jobs of {batch}-row batches, fresh processes")
    print(f"{'way':<36} {'train s':>8} {'tokens':>8} {'tokens/s':>9} {'MFU':>6}")
    for way, job in jobs.items():
        if "error" in job:
            print(f"{way:<36} error: {job['error']}")
            continue
        mfu = f"{job['mfu']:6.1%}" if job.get("mfu") is not None else f"{'n/a':>6}"
        print(
            f"{way:<36} {job['train_s']:8.1f} {job['tokens']:8,} {job['tokens_per_s']:9.1f} {mfu}"
        )
    if row.get("mfu_peak"):
        print(f"MFU against the {row['mfu_peak']}, {row['mfu_peak_tflops']:.0f} TFLOP/s")
    for way, why in row["left_out"].items():
        print(f"{way:<36} {why}")
    rate = {w: j["tokens_per_s"] for w, j in jobs.items() if "tokens_per_s" in j}
    ours = rate.get("torchturbo")
    grid = {w: r for w, r in rate.items() if w.startswith("grid ")}
    peers = {w: r for w, r in rate.items() if w != "torchturbo" and not w.startswith("grid ")}
    ratios: dict[str, Any] = {}
    if ours is not None and grid:
        best = max(grid, key=grid.__getitem__)
        ratios["vs_grid_best"] = ours / grid[best]
        ratios["grid_best"] = best
    if ours is not None and peers:
        best = max(peers, key=peers.__getitem__)
        ratios["vs_best_peer"] = ours / peers[best]
        ratios["best_peer"] = best
    later = (jobs.get("torchturbo") or {}).get("later_step_s")
    if row.get("tuned_step_ms") and later:
        ratios["job_step_over_tuned_step"] = later * 1e3 / row["tuned_step_ms"]
    print(f"tuned ({', '.join(row['tuned']) or 'nothing'}): {ratios}")
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--setups",
        nargs="+",
        choices=SETUPS,
        default=list(SETUPS),
        help="decoder and encoder through the HF Trainer, the decoder through Lightning",
    )
    parser.add_argument("--steps", type=int, default=100, help="the Trainer's max_steps (100)")
    parser.add_argument("--tune-budget", default="5m", help="tune's --time-budget (its default)")
    parser.add_argument("--skip-grid", action="store_true", help="only the peers and the tuner")
    parser.add_argument(
        "--precisions",
        nargs="+",
        choices=("fp32", "bf16"),
        default=["fp32", "bf16"],
        help="the grid's precisions (both; bf16 only where this CPU runs it natively)",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--model-size", choices=tuple(MODEL_SIZES), default="45m", help="the decoder's size"
    )
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE, help="rows per batch")
    parser.add_argument("--out", type=Path, default=Path("tuner-scale-out"))
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--repeats",
        type=int,
        default=0,
        help="run the tuned job, the grid's fastest and the fastest peer this many more times, "
        "interleaved, and compare their medians",
    )
    parser.add_argument(
        "--again",
        type=Path,
        help="an earlier run's JSON (with its --out folder): only repeat its leaders",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--setup", default="decoder", help=argparse.SUPPRESS)
    parser.add_argument("--config", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2 (a first step and a later one)")
    hf_logging.set_verbosity_error()
    if not args.child:  # the children, and the tune's process, inherit them
        os.environ.update(
            TUNER_SCALE_DEVICE=args.device,
            TUNER_SCALE_MODEL=args.model_size,
            TUNER_SCALE_BATCH=str(args.batch_size),
        )
    if args.child:
        child(args)
        return
    payload: dict[str, Any] = {
        "machine": summary(),
        "torch": torch.__version__,
        "steps": args.steps,
        "device": args.device,
        "model_size": args.model_size,
        "batch_size": args.batch_size,
        "tune_budget": args.tune_budget,
        "grid_precisions": args.precisions,
        "load_average_before": os.getloadavg(),
        "setups": {},
    }

    def save(setup: str, row: dict[str, Any]) -> None:
        payload["setups"][setup] = row
        payload["load_average_after"] = os.getloadavg()
        if args.json:
            write_results(args.json, payload)

    if args.again:  # the leaders of an earlier run, again
        payload = json.loads(args.again.read_text())
        payload["repeats"] = args.repeats
        for setup, row in payload["setups"].items():
            repeat_leaders(setup, row, args)
            row["ratios"] = report(setup, row)
            save(setup, row)
        return
    for setup in args.setups:
        row = measure_setup(setup, args, functools.partial(save, setup))
        if args.repeats:
            repeat_leaders(setup, row, args)
        add_mfu(row, setup)
        row["ratios"] = report(setup, row)
        save(setup, row)


if __name__ == "__main__":
    main()
