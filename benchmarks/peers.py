"""Side by side with the peers: the Hugging Face Trainer on text and Lightning on a CNN, three ways.

Is torchturbo worth it to someone who trains with the Trainer? A BERT token tagger (built from a
config, ~3.5 M parameters, no download) learns a synthetic tagging rule on sequences with
lognormal lengths (the ``text`` workload's data: median 32 tokens, a tail to 512), trained by the
Trainer three ways, from the same initial weights with the same optimizer settings:

1. ``defaults``: ``TrainingArguments`` with only what a user must choose (batch size, learning
   rate, epochs): fp32, random batches of 16 padded to their longest sample;
2. ``recommended``: the speed settings of the Trainer's own documentation, as the hardware allows:
   ``bf16=True`` (on a CPU with native bf16 or a CUDA device with bf16),
   ``train_sampling_strategy="group_by_length"`` (``group_by_length=True`` before transformers 5),
   and ``torch_compile=True`` with ``--compile`` (it costs minutes on a small CPU);
3. ``torchturbo``: ``tune`` on ``recipe_from_trainer(defaults)`` within ``--tune-budget`` (or the
   ``--config`` given), then ``TurboTrainer`` with ``training_arguments(config)``.

Each way trains one epoch from scratch, once per round, rounds interleaved (A B C, B C A, C A B)
so that drift of a shared machine hits every way alike. A whole epoch, because the ways order
the same data differently: ``group_by_length`` sorts each mega-batch longest first, so any
shorter window would time a biased share of long or short sequences. Throughput is *real*
(non-padding) tokens per second of the epoch, from the first step to the last (the Trainer's own
overheads and the data loading included; one-time costs, the first ``--warmup`` steps, are also
reported apart), read from the batches the collator built. After the epoch each model's loss is
measured on held-out sequences (fp32, eval mode, mean over real tokens): every way saw the same
samples, so a faster way must not end worse than the defaults by more than the tuner's tolerance
for its speed to count. Medians over rounds, their spread, the ratios and the round-by-round
ratios (both ways ran back to back under the same load) are printed and written (``--json``).

The CNN half (``benchmarks/peers_lightning.py``, ``--workloads vision``) does the same with a
hand-written ResNet in a LightningModule: Lightning's defaults, its documented speed settings
(``bf16-mixed``, ``torch.compile`` with ``--compile``), and torchturbo's tuned settings through
``trainer_kwargs`` and ``TurboLightningCallback``; throughput in samples per second.

    python benchmarks/peers.py --json benchmarks/results/peers.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models from configs only: never reach the Hub

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import (
    BertConfig,
    BertForTokenClassification,
    DataCollatorForTokenClassification,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.utils import logging as hf_logging

from torchturbo.config import TurboConfig
from torchturbo.integrations.transformers import (
    TurboTrainer,
    recipe_from_trainer,
    training_arguments,
)
from torchturbo.integrations.translate import lightning_arguments
from torchturbo.measure.system import cpu_flags
from torchturbo.measure.timing import sync
from torchturbo.output.results_file import write_results
from torchturbo.tune.search.run import TuneOptions, tune
from torchturbo.workloads.text import MAX_LEN, PAD_ID, VOCAB_SIZE, make_sequences

WAYS = ("defaults", "recommended", "torchturbo")
CLASSES = 16
BATCH_SIZE = 16
HELD_OUT = 512
#: The tuner's default loss tolerance: a way whose held-out loss is further from the defaults'
#: (relative) does not count as the same training.
LOSS_TOLERANCE = 0.05


@dataclasses.dataclass
class Data:
    train: list[dict[str, list[int]]]
    held_out: list[dict[str, list[int]]]


def make_data(train_samples: int, seed: int) -> Data:
    """The ``text`` workload's sequences as tokenized samples: ``input_ids`` and ``labels``."""
    tokens, labels, lengths = make_sequences(train_samples + HELD_OUT, CLASSES, seed)
    samples, start = [], 0
    for length in lengths.tolist():
        ids, tags = tokens[start : start + length], labels[start : start + length]
        samples.append({"input_ids": ids.tolist(), "labels": tags.tolist()})
        start += length
    return Data(samples[:train_samples], samples[train_samples:])


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the synthetic ids, built in code: the collator pads with it."""
    vocab = {"[PAD]": PAD_ID, **{f"t{i}": i for i in range(1, VOCAB_SIZE)}}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t1")),
        pad_token="[PAD]",
        unk_token="t1",
    )


def model_init(hidden: int, layers: int) -> BertForTokenClassification:
    config = BertConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=4 * hidden,
        max_position_embeddings=MAX_LEN,
        num_labels=CLASSES,
    )
    return BertForTokenClassification(config)


class CountingCollator:
    """The user's collator, recording each batch's real and padded tokens as it builds them."""

    def __init__(self, collate: Any) -> None:
        self.collate = collate
        self.real = 0
        self.padded = 0
        self.rows: list[int] = []

    def __call__(self, features: list[dict[str, Any]]) -> Any:
        batch = self.collate(features)
        self.real += int(batch["attention_mask"].sum())
        self.padded += batch["attention_mask"].numel()
        self.rows.append(len(features))
        return batch


class StepClock(TrainerCallback):
    """The time at the start of training and at the end of every step, device synchronized."""

    def __init__(self) -> None:
        self.ends: list[float] = []
        self.begin = 0.0

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.begin = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        sync(args.device)
        self.ends.append(time.perf_counter())


def base_arguments(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """What a user sets in every way: batch size, learning rate, one epoch, seed; no
    checkpoints, reporting or progress bar (the same for all three)."""
    return {
        "output_dir": str(out),
        "per_device_train_batch_size": BATCH_SIZE,
        "learning_rate": args.lr,
        "num_train_epochs": 1,
        "seed": 0,
        "save_strategy": "no",
        "logging_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "use_cpu": args.device == "cpu",
    }


def native_bf16(device: str) -> bool:
    if device == "cuda":
        return torch.cuda.is_bf16_supported()
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def recommended_arguments(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """The Trainer docs' speed settings, as this hardware and ``--compile`` allow, and why any
    was left out."""
    kwargs: dict[str, Any] = {}
    left_out = []
    if native_bf16(args.device):
        kwargs["bf16"] = True
    else:
        left_out.append("bf16: no native bf16 on this device")
    if "train_sampling_strategy" in {f.name for f in dataclasses.fields(TrainingArguments)}:
        kwargs["train_sampling_strategy"] = "group_by_length"
    else:
        kwargs["group_by_length"] = True
    if args.compile:
        kwargs["torch_compile"] = True
    else:
        left_out.append("torch_compile: not affordable here (pass --compile to include it)")
    return kwargs, left_out


def build_trainer(
    way: str, args: argparse.Namespace, data: Data, config: TurboConfig | None, extra: dict
) -> tuple[Trainer, CountingCollator, StepClock]:
    collator = CountingCollator(DataCollatorForTokenClassification(tokenizer()))
    clock = StepClock()
    kwargs = base_arguments(args, args.out / way)
    common = {
        "model_init": functools.partial(model_init, args.hidden, args.layers),
        "train_dataset": data.train,
        "data_collator": collator,
        "callbacks": [clock],
    }
    if way == "torchturbo":
        assert config is not None
        arguments = TrainingArguments(**(kwargs | training_arguments(config).kwargs))
        return TurboTrainer(args=arguments, turbo_config=config, **common), collator, clock
    return Trainer(args=TrainingArguments(**(kwargs | extra)), **common), collator, clock


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, data: Data, device: str) -> float:
    """Mean cross-entropy over the real tokens of the held-out samples, fp32, eval mode."""
    model.eval()
    collate = DataCollatorForTokenClassification(tokenizer())
    total, count = 0.0, 0
    for start in range(0, len(data.held_out), 32):
        batch = collate(data.held_out[start : start + 32]).to(device)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        labels = batch["labels"]
        losses = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum")
        total += float(losses)
        count += int((labels != -100).sum())
    return total / count


def run_way(
    way: str, args: argparse.Namespace, data: Data, config: TurboConfig, recommended: dict
) -> dict[str, Any]:
    """Train one way for one epoch from scratch; its throughput and held-out loss."""
    extra = recommended if way == "recommended" else {}
    trainer, collator, clock = build_trainer(way, args, data, config, extra)
    trainer.train()
    seconds = clock.ends[-1] - clock.begin
    return {
        "throughput": collator.real / seconds,
        "epoch_s": seconds,
        "steps": len(clock.ends),
        "first_steps_s": clock.ends[args.warmup - 1] - clock.begin,
        "padding_fraction": 1 - collator.real / collator.padded,
        "rows_per_batch": statistics.mean(collator.rows),
        "held_out_loss": held_out_loss(trainer.model, data, args.device),
    }


def tuned_config(args: argparse.Namespace, data: Data) -> tuple[TurboConfig, dict[str, Any]]:
    """``--config``, or what ``tune`` finds on the defaults' Trainer within ``--tune-budget``."""
    if args.config is not None:
        return TurboConfig.load(args.config), {"source": str(args.config)}
    trainer, _, _ = build_trainer("defaults", args, data, None, {})
    return run_tuner(recipe_from_trainer(trainer, name="peers-bert"), args)


def run_tuner(recipe: Any, args: argparse.Namespace) -> tuple[TurboConfig, dict[str, Any]]:
    """``tune`` within ``--tune-budget``; the config and what the tuner decided."""
    options = TuneOptions(
        time_budget_s=args.tune_budget,
        planned_steps=args.planned_steps,
        loss_tolerance=LOSS_TOLERANCE,
        device=args.device,
    )
    started = time.perf_counter()
    config, result = tune(recipe, options)
    tuning = {
        "source": "tune",
        "seconds": time.perf_counter() - started,
        "adopted": list(result.adopted),
        "confirmation": result.confirmation.state,
        "confirmed_ratio": result.confirmation.ratio,
        "verdicts": {row.name: [row.verdict, row.reason] for row in result.candidates},
    }
    print(
        f"tuned {recipe.name} in {tuning['seconds']:.0f} s: adopted {tuning['adopted'] or 'none'}"
        f", {tuning['confirmed_ratio']:.2f}x over fp32 eager ({tuning['confirmation']})"
    )
    for name, (verdict, reason) in tuning["verdicts"].items():
        print(f"  {name}: {verdict}: {reason}")
    if args.json is not None:
        # Kept for --config / --vision-config: a later run can skip the tuning.
        path = args.json.with_suffix(f".{recipe.name}.toml")
        path.parent.mkdir(parents=True, exist_ok=True)
        config.save(path)
        tuning["config_file"] = str(path)
    return config, tuning


def interleave(rounds: int, run: Any) -> dict[str, list[dict[str, Any]]]:
    """``run(way)`` for every way, ``rounds`` times, starting each round one way later."""
    results: dict[str, list[dict[str, Any]]] = {way: [] for way in WAYS}
    for index in range(rounds):
        for way in WAYS[index % len(WAYS) :] + WAYS[: index % len(WAYS)]:
            results[way].append(run(way))
    return results


def summarize(rounds: dict[str, list[dict[str, Any]]], unit: str) -> dict[str, Any]:
    """Medians over rounds per way, the spread of throughput, ratios, loss differences."""
    ways: dict[str, Any] = {}
    for way, runs in rounds.items():
        throughput = [run["throughput"] for run in runs]
        median = statistics.median(throughput)
        ways[way] = {
            "throughput": median,
            "unit": unit,
            # (max - min) / median over the rounds: with 3 rounds, the whole range.
            "throughput_spread": (max(throughput) - min(throughput)) / median,
            **{
                key: statistics.median(run[key] for run in runs)
                for key in runs[0]
                if key not in ("throughput",)
            },
            "runs": runs,
        }
    base = ways["defaults"]
    for way in ways.values():
        way["ratio_to_defaults"] = way["throughput"] / base["throughput"]
        loss_change = (way["held_out_loss"] - base["held_out_loss"]) / base["held_out_loss"]
        way["loss_vs_defaults"] = loss_change
        # One-sided: a faster way must not train worse; ending lower is no failure.
        way["loss_within_tolerance"] = loss_change <= LOSS_TOLERANCE
    turbo, recommended = ways["torchturbo"], ways["recommended"]
    turbo["ratio_to_recommended"] = turbo["throughput"] / recommended["throughput"]
    # Paired by round: both ways ran back to back under the same load.
    turbo["round_ratios_to_recommended"] = [
        mine["throughput"] / theirs["throughput"]
        for mine, theirs in zip(turbo["runs"], recommended["runs"], strict=True)
    ]
    return ways


def print_table(title: str, ways: dict[str, Any]) -> None:
    unit = ways["defaults"]["unit"]
    print(title)
    print(
        f"{'way':<12}{unit:>11}{'spread':>7}{'x def':>7}{'pad':>5}{'first s':>8}{'loss':>7}"
        f"{'vs def':>8}"
    )
    for name, way in ways.items():
        padding = f"{way['padding_fraction']:.0%}" if "padding_fraction" in way else "-"
        print(
            f"{name:<12}{way['throughput']:>11.0f}{way['throughput_spread']:>7.0%}"
            f"{way['ratio_to_defaults']:>6.2f}x{padding:>5}{way['first_steps_s']:>8.1f}"
            f"{way['held_out_loss']:>7.3f}{way['loss_vs_defaults']:>+8.1%}"
        )
    turbo = ways["torchturbo"]
    rounds = ", ".join(f"{ratio:.2f}x" for ratio in turbo["round_ratios_to_recommended"])
    print(f"torchturbo / recommended: {turbo['ratio_to_recommended']:.2f}x (by round: {rounds})\n")


def text_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """The Trainer three ways on long-tailed text; the summary and what each way ran with."""
    data = make_data(args.samples, seed=0)
    config, tuning = tuned_config(args, data)
    recommended, left_out = recommended_arguments(args)
    rounds = interleave(args.rounds, lambda way: run_way(way, args, data, config, recommended))
    ways = summarize(rounds, "real tok/s")
    model = f"BertForTokenClassification({args.hidden}x{args.layers})"
    print_table(f"Hugging Face Trainer, {model}, one epoch of long-tailed text:", ways)
    return {
        "model": model,
        "parameters": sum(p.numel() for p in model_init(args.hidden, args.layers).parameters()),
        "samples": args.samples,
        "recommended": recommended,
        "recommended_left_out": left_out,
        "torchturbo_config": config.to_dict(),
        "torchturbo_arguments": training_arguments(config).kwargs,
        "tuning": tuning,
        "ways": ways,
    }


def vision_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Lightning three ways on the hand-written ResNet (``peers_lightning.py``)."""
    import peers_lightning as cnn

    data = cnn.VisionData(args.images, HELD_OUT)
    if args.vision_config is not None:
        config, tuning = TurboConfig.load(args.vision_config), {"source": str(args.vision_config)}
    else:
        config, tuning = run_tuner(cnn.recipe(args, data), args)
    recommended, left_out = cnn.recommended(args, native_bf16(args.device))
    rounds = interleave(args.rounds, lambda way: cnn.run_way(way, args, data, config, recommended))
    ways = summarize(rounds, "samples/s")
    print_table("Lightning, the vision workload's ResNet, one epoch of 48 px images:", ways)
    return {
        "model": "ResNet(32/64/128, BatchNorm): the vision workload's",
        "samples": args.images,
        "recommended": recommended,
        "recommended_left_out": left_out,
        "torchturbo_config": config.to_dict(),
        # A DDP strategy, when there is one, is an object: the JSON keeps the plain keywords.
        "torchturbo_trainer_kwargs": {
            k: v for k, v in lightning_arguments(config).kwargs.items() if k != "strategy"
        },
        "tuning": tuning,
        "ways": ways,
    }


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the results to this JSON file")
    parser.add_argument(
        "--workloads",
        nargs="+",
        choices=("text", "vision"),
        default=["text", "vision"],
        help="text (Hugging Face Trainer), vision (Lightning); default both",
    )
    parser.add_argument("--samples", type=int, default=1600, help="training sequences (1600)")
    parser.add_argument("--images", type=int, default=1024, help="training images (1024)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved epochs per way (3)")
    parser.add_argument("--warmup", type=int, default=3, help="steps counted as one-time (3)")
    parser.add_argument("--hidden", type=int, default=256, help="BERT width (256)")
    parser.add_argument("--layers", type=int, default=4, help="BERT layers (4)")
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate (1e-3)")
    parser.add_argument("--compile", action="store_true", help="recommended ways compile too")
    parser.add_argument("--config", type=Path, help="a tuned turbo.toml for text: skip tuning")
    parser.add_argument("--vision-config", type=Path, help="the same for vision")
    parser.add_argument(
        "--tune-budget", type=float, default=1200.0, help="seconds each tuning may take (1200)"
    )
    parser.add_argument(
        "--planned-steps",
        type=int,
        default=10_000,
        help="run length the tuner weighs one-time costs against (10000)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on a shared 2-core machine two OpenMP threads "
        "competing with another process for a core slow a step many times over)",
    )
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--out", type=Path, default=Path("peers-out"), help="Trainer output dirs")
    parser.add_argument("--quick", action="store_true", help="a tiny run: smoke test")
    args = parser.parse_args()
    if args.quick:
        args.samples, args.images, args.rounds, args.hidden, args.layers = 256, 128, 1, 64, 1
        args.tune_budget = 30.0
    if min(args.samples, args.images, args.rounds, args.warmup, args.threads) < 1:
        parser.error("--samples, --images, --rounds, --warmup and --threads must be >= 1")
    torch.set_num_threads(args.threads)
    # The trainers' info lines and tips would bury the tables.
    hf_logging.set_verbosity_error()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    # Lightning 2.6 builds torch's LeafSpec, which torch 2.13 deprecates: once per fit.
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)`")
    import transformers

    load = os.getloadavg()[0]
    print(
        f"peers: one epoch per run, {args.rounds} rounds interleaved, {args.threads} thread(s), "
        f"torch {torch.__version__}, transformers {transformers.__version__}, load {load:.1f}\n"
    )
    setup = {
        "rounds": args.rounds,
        "batch_size": BATCH_SIZE,
        "lr": args.lr,
        "threads": args.threads,
        "device": args.device,
        "compile_in_recommended": args.compile,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "loss_tolerance": LOSS_TOLERANCE,
        "load_average_before": os.getloadavg(),
    }
    payload: dict[str, Any] = {"setup": setup}
    if "text" in args.workloads:
        payload["text"] = text_benchmark(args)
    if "vision" in args.workloads:
        payload["vision"] = vision_benchmark(args)
    setup["load_average_after"] = os.getloadavg()
    if args.json:
        write_results(args.json, payload)


if __name__ == "__main__":
    main()
