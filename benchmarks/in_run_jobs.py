"""Tuning inside the run, measured as users run it: whole Trainer jobs from fresh processes.

For each setup (the 45M decoder and 36M encoder of ``tuner_scale.py``, and a BERT masked LM
from transformers' own classes, which none of torchturbo's tests or tunes were written on) and
each ``--steps`` (100, 300, 1,000), three jobs of the same documents and batch size:

* **in-run**: ``TurboTrainer`` with ``[tune] in_run = true`` and nothing else, on the Trainer's
  default arguments: the facts choose its start, its own steps are all it trains;
* **trainer's best**: the Trainer's obvious setting, ``bf16=True`` with ``group_by_length``
  (where this CPU runs bf16 natively; else ``group_by_length``);
* **tune, then train**: ``torchturbo tune`` at its default budget in a fresh process, then the
  job on the turbo.toml it wrote, the tune's seconds counted in the job's.

Each job is timed from the start of ``train()`` to its last step, plus the process's start-up
where said, and counts the real tokens it trained (not padding; for the masked LM every
non-pad input token). After training, each job's model is evaluated on the same held-out
documents (another seed's, fp32, no dropout; the masked LM's masks drawn from one seed): the
mean loss over the held-out batches and its standard error. Printed: seconds, tokens,
tokens/s, held-out loss, and in-run over each peer.

    python benchmarks/in_run_jobs.py --json benchmarks/results/in_run_jobs.json
    python benchmarks/in_run_jobs.py --setups mlm --steps 30 --skip-tune   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import (
    BertConfig,
    BertForMaskedLM,
    DataCollatorForLanguageModeling,
    PreTrainedTokenizerFast,
    Trainer,
)
from transformers.utils import logging as hf_logging

sys.path.insert(0, str(Path(__file__).parent))
import tuner_scale

from torchturbo.config import TurboConfig
from torchturbo.integrations.transformers import (
    TurboTrainer,
    recipe_from_trainer,
    training_arguments,
)
from torchturbo.measure.machine import summary
from torchturbo.measure.native import emulated
from torchturbo.output.results_file import write_results
from torchturbo.recipe import Recipe

SETUPS = ("decoder", "encoder", "mlm")
#: Held-out documents (drawn from another seed than the training ones) and their batch.
HELD_OUT, HELD_OUT_SEED, HELD_OUT_BATCH = 128, 1, 8
WAYS = ("in-run", "trainer-best", "tune-then-train")


def mlm_tokenizer() -> PreTrainedTokenizerFast:
    """The word-level tokenizer of the documents, with a mask token for the masked LM."""
    vocab = {"[PAD]": 0, "[MASK]": 1, **{f"t{i}": i for i in range(2, tuner_scale.VOCAB)}}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t2")),
        pad_token="[PAD]",
        mask_token="[MASK]",
        unk_token="t2",
    )


def mlm_model() -> BertForMaskedLM:
    """BERT for masked LM from its config (6 layers, hidden 512: 36M parameters with the head)."""
    torch.manual_seed(0)
    hidden, layers = tuner_scale.MODEL_SIZES[tuner_scale.scale()[1]]
    return BertForMaskedLM(
        BertConfig(
            vocab_size=tuner_scale.VOCAB,
            hidden_size=hidden,
            num_hidden_layers=layers + 2,
            num_attention_heads=hidden // 64,
            intermediate_size=4 * hidden,
            max_position_embeddings=512,
        )
    )


class Clock(tuner_scale.Meter):
    """``tuner_scale.Meter`` (train begin, every step's end), counting every batch's non-pad
    input tokens (``attention_mask``), else its labels that count: a masked LM's labels are
    only its masked tokens."""

    def _count(self, module: Any, args: Any, kwargs: Any) -> None:
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and torch.is_grad_enabled():
            self.tokens += int(mask.sum())
            return
        super()._count(module, args, kwargs)


def parts(setup: str) -> tuple[torch.nn.Module, list[dict[str, Any]], Any]:
    """The setup's model, documents and collator."""
    if setup == "mlm":
        collate = DataCollatorForLanguageModeling(mlm_tokenizer(), mlm=True)
        return mlm_model(), tuner_scale.documents("decoder"), collate
    return tuner_scale.model(setup), tuner_scale.documents(setup), tuner_scale.collator(setup)


def child(way: str, setup: str, steps: int, out: Path, config: Path | None) -> dict[str, Any]:
    """One job in this process: ``in-run``, ``trainer-best`` or a turbo.toml's."""
    net, data, collate = parts(setup)
    clock = Clock(net, causal=setup == "decoder")
    common = {"model": net, "train_dataset": data, "data_collator": collate, "callbacks": [clock]}
    if way == "in-run" or config is not None:
        turbo = (
            TurboConfig.load(config)
            if config is not None
            else TurboConfig(device=tuner_scale.scale()[0]).replace(tune__in_run=True)
        )
        args = tuner_scale.arguments(out, steps, **training_arguments(turbo).kwargs)
        made: Trainer = TurboTrainer(args=args, turbo_config=turbo, **common)
    else:
        extra: dict[str, Any] = {"train_sampling_strategy": "group_by_length"}
        if emulated(tuner_scale.scale()[0], "bf16") is None:
            extra["bf16"] = True
        made = Trainer(args=tuner_scale.arguments(out, steps, **extra), **common)
    made.train()
    train_s = clock.ends[-1] - clock.begin
    # Without accelerate's autocast wrapper of the forward: the held-out loss is fp32's.
    loss, error = held_out_loss(
        made.accelerator.unwrap_model(made.model, keep_fp32_wrapper=False), setup, collate
    )
    return {
        "train_s": train_s,
        "steps": len(clock.ends),
        "tokens": clock.tokens,
        "held_out_loss": loss,
        "held_out_se": error,
    }


def held_out_loss(net: torch.nn.Module, setup: str, collate: Any) -> tuple[float, float]:
    """The trained model's mean loss over the held-out batches (fp32, eval mode, masks of the
    masked LM drawn from one seed) and the standard error of that mean."""
    documents = tuner_scale.documents(
        "decoder" if setup == "mlm" else setup, HELD_OUT, seed=HELD_OUT_SEED
    )
    device = next(net.parameters()).device
    net.eval()
    torch.manual_seed(HELD_OUT_SEED)
    losses = []
    with torch.no_grad():
        for start in range(0, HELD_OUT, HELD_OUT_BATCH):
            batch = collate(documents[start : start + HELD_OUT_BATCH])
            inputs = {k: v.to(device) for k, v in batch.items()}
            losses.append(float(net(**inputs).loss))
    spread = torch.tensor(losses, dtype=torch.float64)
    return float(spread.mean()), float(spread.std() / len(losses) ** 0.5)


def run_child(way: str, setup: str, steps: int, out: Path, config: Path | None = None) -> dict:
    """``way``'s job in a fresh process: its figures, the process's seconds, what in-run said."""
    folder = out / f"{setup}-{steps}-{way}"
    job, stderr = tuner_scale.child_job(__file__, way, setup, steps, folder, config)
    said = [x for x in stderr.splitlines() if x.startswith("in-run:")]
    return job if "error" in job else job | {"said": said}


def mlm_recipe() -> Recipe:
    """``torchturbo tune benchmarks/in_run_jobs.py:mlm_recipe``: the masked LM's Trainer on its
    defaults, as ``tuner_scale.py``'s recipes are the decoder's and the encoder's."""
    steps = int(os.environ.get("TUNER_SCALE_STEPS", "100"))
    out = Path(os.environ.get("TUNER_SCALE_OUT", "in-run-jobs-out"))
    net, data, collate = parts("mlm")
    made = Trainer(
        model=net,
        args=tuner_scale.arguments(out / "recipe", steps),
        train_dataset=data,
        data_collator=collate,
    )
    return recipe_from_trainer(made, name="in-run-mlm")


def tune_then_train(setup: str, steps: int, out: Path, budget: str) -> dict[str, Any]:
    """``torchturbo tune`` (fresh process, default budget) then its job; both counted."""
    script = __file__ if setup == "mlm" else tuner_scale.__file__
    toml, results = tuner_scale.tune_setup(
        setup, steps, budget, out / f"{setup}-{steps}", script=script
    )
    job = run_child("tuned", setup, steps, out, toml)
    if "error" in job:
        return job
    return job | {
        "tune_s": results["tune_process_s"],
        "adopted": results["adopted"],
        "train_s": job["train_s"] + results["tune_process_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS))
    parser.add_argument("--steps", nargs="+", type=int, default=[100, 300, 1000])
    parser.add_argument("--tune-budget", default="5m", help="tune's --time-budget (its default)")
    parser.add_argument("--skip-tune", action="store_true", help="only in-run and the trainer")
    parser.add_argument("--out", type=Path, default=Path("in-run-jobs-out"))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--setup", default="decoder", help=argparse.SUPPRESS)
    parser.add_argument("--config", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    hf_logging.set_verbosity_error()
    if args.child:
        job = child(args.child, args.setup, args.steps[0], args.out, args.config)
        print("JOB " + json.dumps(job))
        return
    payload: dict[str, Any] = {"machine": summary(), "torch": torch.__version__, "jobs": {}}
    print(
        f"{'setup':<8} {'steps':>5} {'way':<16} {'seconds':>8} {'tokens':>9} {'tokens/s':>9} "
        f"{'held-out loss':>16}"
    )
    for steps in args.steps:
        for setup in args.setups:
            jobs: dict[str, Any] = {}
            jobs["in-run"] = run_child("in-run", setup, steps, args.out)
            jobs["trainer-best"] = run_child("trainer-best", setup, steps, args.out)
            if not args.skip_tune:
                jobs["tune-then-train"] = tune_then_train(setup, steps, args.out, args.tune_budget)
            for way, job in jobs.items():
                if "error" in job:
                    print(f"{setup:<8} {steps:>5} {way:<16} {job['error']}")
                    continue
                job["tokens_per_s"] = job["tokens"] / job["train_s"]
                print(
                    f"{setup:<8} {steps:>5} {way:<16} {job['train_s']:8.1f} {job['tokens']:9,} "
                    f"{job['tokens_per_s']:9.1f} {job['held_out_loss']:9.4f} ± "
                    f"{job['held_out_se']:.4f}"
                )
            ours = jobs["in-run"].get("tokens_per_s")
            for way in ("trainer-best", "tune-then-train"):
                theirs = (jobs.get(way) or {}).get("tokens_per_s")
                if ours and theirs:
                    jobs[f"in-run over {way}"] = ours / theirs
                    print(f"{'':<15} in-run over {way}: {ours / theirs:.2f}x")
            payload["jobs"][f"{setup} {steps}"] = jobs
            if args.json:
                write_results(args.json, payload)


if __name__ == "__main__":
    main()
