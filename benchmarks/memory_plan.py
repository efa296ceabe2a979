"""The memory planner against an exhaustive grid, and the estimate against the measured footprint.

For a CNN shaped like torchvision's ResNet (a stem of attributes, not a Sequential; basic blocks
with squeeze-and-excitation), a tiny ``BertModel`` and a tiny ``LlamaForCausalLM`` (both built
from a config), and with ``--models`` three more (a MobileNetV2-shaped CNN of depthwise inverted
residuals, ``DistilBertForSequenceClassification`` and ``GPT2LMHeadModel``), each on synthetic
learnable data:

1. the memory estimate made before launch (``trials.memory_estimate``) against the baseline
   step's measured footprint (``Trial.memory_footprint``);
2. for budgets of 1/2, 1/3 and 1/5 of that footprint, ``tune`` with only the memory stage adopts
   a plan; the grid of the same knobs (every subset of blocks to checkpoint x micro-batch split
   1, 2, 4, 8 x bf16 activations on/off) is measured for footprint, and the fitting grid points
   are timed interleaved (``measure.timing.measure_interleaved``) with the adopted one, in two
   passes: the first ranks them all, the second times the adopted point against the first's
   three fastest again with three times the repeats (the fastest of many noisy figures reads
   high); when the second pass's fastest is not the adopted point, the two are compared in 20
   paired rounds (the tuner's ``compare``: adjacent blocks that take turns, so that drifting
   load hits both alike), and adopted/fastest is that ratio, with its interval. A grid point
   that fits with a superset of another fitting point's knobs is left out of the timing: more
   recompute, more casts or smaller micro-batches on top of a config that already fits (the
   timed set is every minimal fitting point, so the fastest fitting point is among them unless
   an extra knob speeds a step up).

Prints a table and writes JSON:

    python benchmarks/memory_plan.py --json benchmarks/results/memory_plan-avx2.json

Figures are throughput ratios from one interleaved run; absolute times on a shared machine are
noise.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchturbo.base.blocks import find_blocks
from torchturbo.config import TurboConfig
from torchturbo.measure.timing import measure_interleaved, time_once
from torchturbo.recipe import Recipe
from torchturbo.techniques.checkpointing import select_blocks
from torchturbo.trials.memory_estimate import estimate_recipe_memory
from torchturbo.trials.trial import Trial, fixed_batches
from torchturbo.tune.search.compare import compare
from torchturbo.tune.search.outcome import Comparison
from torchturbo.tune.search.run import TuneOptions, tune
from torchturbo.tune.search.stages import tuner_stages
from torchturbo.tune.search.state import NUM_BATCHES

MIB = 2**20
FRACTIONS = (2, 3, 5)
#: Points of the grid's first pass timed again beside the adopted one.
LEADERS = 3
#: Paired rounds of the adopted point against the second pass's fastest.
PAIRED_ROUNDS = 20


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.fc1 = nn.Conv2d(channels, channels // 4, 1)
        self.fc2 = nn.Conv2d(channels // 4, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.fc2(torch.relu(self.fc1(x.mean((2, 3), keepdim=True))))
        return x * torch.sigmoid(scale)


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.se = SqueezeExcite(c_out)
        self.down = (
            nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))
            if stride != 1 or c_in != c_out
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.se(self.bn2(self.conv2(out)))
        return torch.relu(out + self.down(x))


class SEResNet(nn.Module):
    """torchvision's ResNet layout: conv1/bn1/relu/maxpool attributes, layer1..layer4, fc."""

    def __init__(self, width: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        widths = [width, 2 * width, 4 * width, 8 * width]
        c_in = width
        for i, c_out in enumerate(widths):
            layer = nn.Sequential(BasicBlock(c_in, c_out, 1 if i == 0 else 2))
            setattr(self, f"layer{i + 1}", layer)
            c_in = c_out
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_in, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for i in range(1, 5):
            x = getattr(self, f"layer{i}")(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _cnn() -> Recipe:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 3, 64, 64, generator=generator)
    y = (x[:, 0].mean((1, 2)) > 0).long() + 2 * (x[:, 1].mean((1, 2)) > 0).long()

    def loss(model: nn.Module, batch: Any) -> tuple[torch.Tensor, int]:
        images, labels = batch
        return nn.functional.cross_entropy(model(images), labels), labels.numel()

    return Recipe(
        name="se-resnet",
        model=SEResNet,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        loss_fn=loss,
        dataset=torch.utils.data.TensorDataset(x, y),
        batch_size=16,
    )


def _tokens(vocab: int, count: int, length: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    start = torch.randint(0, vocab, (count, 1), generator=generator)
    return (start + torch.arange(length)) % vocab  # learnable: each token follows the last


def _bert() -> Recipe:
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=256,
        max_position_embeddings=256,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    ids = _tokens(512, 256, 128)
    labels = (ids[:, 0] % 2).long()

    class Classifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = BertModel(config, add_pooling_layer=False)
            self.head = nn.Linear(64, 2)

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.bert(input_ids=input_ids).last_hidden_state[:, 0])

    def loss(model: nn.Module, batch: Any) -> tuple[torch.Tensor, int]:
        tokens, targets = batch
        return nn.functional.cross_entropy(model(tokens), targets), targets.numel()

    return Recipe(
        name="bert-tiny",
        model=Classifier,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
        loss_fn=loss,
        dataset=torch.utils.data.TensorDataset(ids, labels),
        batch_size=16,
    )


def _llama() -> Recipe:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=2048,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    ids = _tokens(2048, 256, 128)

    def loss(model: nn.Module, batch: Any) -> tuple[torch.Tensor, int]:
        (tokens,) = batch
        return model(input_ids=tokens, labels=tokens).loss, tokens.numel()

    return Recipe(
        name="llama-tiny",
        model=lambda: LlamaForCausalLM(config),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
        loss_fn=loss,
        dataset=torch.utils.data.TensorDataset(ids),
        batch_size=16,
    )


class InvertedResidual(nn.Module):
    """MobileNetV2's block: expand 1x1, depthwise 3x3, squeeze-and-excite, project 1x1."""

    def __init__(self, c_in: int, c_out: int, stride: int, expand: int = 4) -> None:
        super().__init__()
        hidden = c_in * expand
        self.expand = nn.Sequential(
            nn.Conv2d(c_in, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6()
        )
        self.depthwise = nn.Sequential(
            nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False),
            nn.BatchNorm2d(hidden),
            nn.ReLU6(),
        )
        self.se = SqueezeExcite(hidden)
        self.project = nn.Sequential(nn.Conv2d(hidden, c_out, 1, bias=False), nn.BatchNorm2d(c_out))
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.project(self.se(self.depthwise(self.expand(x))))
        return x + out if self.residual else out


class MobileNet(nn.Module):
    """A stem of attributes and a ``features`` list of inverted residuals, as torchvision's."""

    def __init__(self, classes: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, 2, 1, bias=False)
        self.stem_bn = nn.BatchNorm2d(16)
        self.features = nn.ModuleList(
            [
                InvertedResidual(16, 16, 1),
                InvertedResidual(16, 24, 2),
                InvertedResidual(24, 24, 1),
                InvertedResidual(24, 32, 2),
            ]
        )
        self.classifier = nn.Linear(32, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.stem_bn(self.stem(x)))
        for block in self.features:
            x = block(x)
        return self.classifier(x.mean((2, 3)))


def _mobilenet() -> Recipe:
    return dataclasses.replace(_cnn(), name="mobilenet", model=MobileNet)


def _distilbert() -> Recipe:
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    config = DistilBertConfig(
        vocab_size=512,
        dim=64,
        n_layers=4,
        n_heads=4,
        hidden_dim=256,
        max_position_embeddings=256,
        dropout=0.0,
        attention_dropout=0.0,
        num_labels=2,
    )
    ids = _tokens(512, 256, 128)

    def loss(model: nn.Module, batch: Any) -> tuple[torch.Tensor, int]:
        tokens, targets = batch
        return model(input_ids=tokens, labels=targets).loss, targets.numel()

    return Recipe(
        name="distilbert-tiny",
        model=lambda: DistilBertForSequenceClassification(config),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
        loss_fn=loss,
        dataset=torch.utils.data.TensorDataset(ids, (ids[:, 0] % 2).long()),
        batch_size=16,
    )


def _gpt2() -> Recipe:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=2048,
        n_embd=64,
        n_layer=4,
        n_head=4,
        n_positions=256,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return dataclasses.replace(_llama(), name="gpt2-tiny", model=lambda: GPT2LMHeadModel(config))


RECIPES: dict[str, Callable[[], Recipe]] = {
    "cnn": _cnn,
    "encoder": _bert,
    "decoder": _llama,
    "mobilenet": _mobilenet,
    "distilbert": _distilbert,
    "gpt2": _gpt2,
}


@dataclasses.dataclass(frozen=True)
class Point:
    """One grid point: the blocks checkpointed, the micro-batch split, bf16 activations."""

    blocks: frozenset[str]
    split: int
    compress: bool

    def within(self, other: Point) -> bool:
        return (
            self.blocks <= other.blocks
            and self.split <= other.split
            and self.compress <= other.compress
        )

    def config(self, all_blocks: int) -> TurboConfig:
        changes: dict[str, Any] = {"accumulation__micro_batches": self.split}
        if self.blocks:
            changes["checkpointing__mode"] = "selective"
            changes["checkpointing__blocks"] = tuple(sorted(self.blocks))
        if self.compress:
            changes["activation_compression__dtype"] = "bf16"
        return TurboConfig(device="cpu").replace(**changes)

    def name(self) -> str:
        blocks = ",".join(sorted(self.blocks)) or "-"
        return f"ckpt[{blocks}] x{self.split}{' bf16' if self.compress else ''}"


def _point_of(config: dict[str, Any], recipe: Recipe) -> Point:
    """The grid point of an adopted config (its checkpointing resolved to block names)."""
    turbo = TurboConfig.from_dict(config)
    chosen = select_blocks(recipe.model(), turbo.checkpointing)
    return Point(
        frozenset(n for n, _ in chosen),
        turbo.accumulation.micro_batches,
        turbo.activation_compression.dtype != "off",
    )


def _trial(recipe: Recipe, point: Point, batches: list[Any], blocks: list[str]) -> Trial:
    return Trial(recipe, point.config(len(blocks)), batches)


def _timed(
    recipe: Recipe, points: list[Point], batches: list[Any], blocks: list[str], repeats: int
) -> dict[Point, tuple[float, float]]:
    """Samples per second and spread of each point, timed interleaved in one run."""
    points = list(dict.fromkeys(points))
    trials = {p: _trial(recipe, p, batches, blocks) for p in points}
    try:
        timings = measure_interleaved(
            {p.name(): trials[p].step for p in points},
            device="cpu",
            warmup=2,
            repeats=repeats,
            steps_per_repeat=2,
        )
        return {
            p: (trials[p].mean_count() / timings[p.name()].median, timings[p.name()].spread)
            for p in points
        }
    finally:
        for trial in trials.values():
            trial.close()


def _paired(
    recipe: Recipe, chosen: Point, fastest: Point, batches: list[Any], blocks: list[str]
) -> Comparison:
    """The adopted point against pass 2's fastest in paired rounds (adjacent blocks that take
    turns, so that load which drifts hits both alike): the tuner's own comparison, run for
    ``PAIRED_ROUNDS`` rounds whatever it shows."""
    trials = [_trial(recipe, p, batches, blocks) for p in (fastest, chosen)]
    try:
        for trial in trials:
            for _ in range(2):
                trial.step()
            trial.step_seconds = min(time_once(trial.step, "cpu") for _ in range(2))
        return compare(
            trials[0],
            trials[1],
            against=fastest.name(),
            device=torch.device("cpu"),
            max_rounds=PAIRED_ROUNDS,
            min_rounds=PAIRED_ROUNDS,
            may_continue=lambda _seconds: True,
            decided=lambda _ratios: False,
        ).comparison
    finally:
        for trial in trials:
            trial.close()


def run_model(name: str, time_budget_s: float, repeats: int) -> dict[str, Any]:
    recipe = RECIPES[name]()
    batches = fixed_batches(recipe, NUM_BATCHES)
    blocks = [n for n, _ in find_blocks(recipe.model())]
    begin = time.perf_counter()
    estimate = estimate_recipe_memory(recipe, batches[0])
    estimate_s = time.perf_counter() - begin
    footprints: dict[Point, int] = {}
    splits = [s for s in (1, 2, 4, 8) if recipe.batch_size % s == 0]
    for size in range(len(blocks) + 1):
        for chosen in itertools.combinations(blocks, size):
            for split, compress in itertools.product(splits, (False, True)):
                point = Point(frozenset(chosen), split, compress)
                trial = _trial(recipe, point, batches, blocks)
                try:
                    trial.step()  # the optimizer's state exists after one (whole) step
                    bytes_, _ = trial.memory_footprint()
                finally:
                    trial.close()
                assert bytes_ is not None
                footprints[point] = bytes_
    baseline = footprints[Point(frozenset(), 1, False)]
    out: dict[str, Any] = {
        "model": name,
        "blocks": blocks,
        "estimate_bytes": estimate.total_bytes,
        "measured_bytes": baseline,
        "estimate_error": estimate.total_bytes / baseline - 1,
        "estimate_s": estimate_s,
        "grid_points": len(footprints),
        "budgets": [],
    }
    print(
        f"{name}: estimate {estimate.total_bytes / MIB:.2f} MiB, measured {baseline / MIB:.2f} MiB "
        f"({out['estimate_error']:+.1%}); grid of {len(footprints)} points"
    )
    for fraction in FRACTIONS:
        budget = baseline // fraction
        options = TuneOptions(
            time_budget_s=time_budget_s,
            memory_budget=budget,
            device="cpu",
            skip=("data_loader",),
        )
        _, result = tune(recipe, options, stages={"memory": tuner_stages()["memory"]})
        rows = [o for o in result.candidates if o.stage == "memory" and o.comparison is not None]
        adopted = next((o for o in rows if o.verdict == "adopted"), None)
        fitting = [p for p, b in footprints.items() if b <= budget]
        minimal = [p for p in fitting if not any(q != p and q.within(p) for q in fitting)]
        entry: dict[str, Any] = {
            "fraction": f"1/{fraction}",
            "budget_bytes": budget,
            "plans": [
                {
                    "name": o.name,
                    "verdict": o.verdict,
                    "memory_bytes": o.memory_bytes,
                    "ratio": o.comparison.speed.ratio if o.comparison else None,
                }
                for o in rows
            ],
            "fitting_grid_points": len(fitting),
            "timed_grid_points": len(minimal),
        }
        if adopted is None or not minimal:
            entry["adopted"] = None if adopted is None else adopted.name
            entry["note"] = "no plan adopted" if adopted is None else "no grid point fits"
            out["budgets"].append(entry)
            print(f"  1/{fraction} ({budget / MIB:.2f} MiB): {entry['note']}")
            continue
        chosen = _point_of(adopted.config, recipe)
        # Pass 1 ranks every minimal fitting point; the fastest of many noisy figures reads
        # high (the winner's curse), so pass 2 times the adopted point against the leaders of
        # pass 1 again, with three times the repeats, and the ratio comes from pass 2 alone.
        first = _timed(recipe, [chosen, *minimal], batches, blocks, repeats)
        leaders = sorted(first, key=lambda p: -first[p][0])[: LEADERS + 1]
        second = _timed(recipe, [chosen, *leaders], batches, blocks, 3 * repeats)
        fastest = max(second, key=lambda p: second[p][0])
        paired = None if fastest == chosen else _paired(recipe, chosen, fastest, batches, blocks)
        chosen_bytes = adopted.memory_bytes
        entry.update(
            adopted=adopted.name,
            adopted_point=chosen.name(),
            adopted_bytes=chosen_bytes,
            adopted_fits=chosen_bytes is not None and chosen_bytes <= budget,
            fastest_point=fastest.name(),
            fastest_bytes=footprints[fastest],
            adopted_over_fastest=1.0 if paired is None else paired.speed.ratio,
            adopted_over_fastest_interval=None
            if paired is None
            else (paired.speed.low, paired.speed.high),
            interleaved_adopted_over_fastest=second[chosen][0] / second[fastest][0],
            timed={p.name(): {"samples_per_s": v[0], "spread": v[1]} for p, v in first.items()},
            retimed={p.name(): {"samples_per_s": v[0], "spread": v[1]} for p, v in second.items()},
        )
        out["budgets"].append(entry)
        print(
            f"  1/{fraction} ({budget / MIB:.2f} MiB): adopted {chosen.name()} "
            f"{(chosen_bytes or 0) / MIB:.2f} MiB; fastest fitting {fastest.name()} "
            f"{footprints[fastest] / MIB:.2f} MiB; adopted/fastest "
            f"{entry['adopted_over_fastest']:.3f} ({len(minimal)} timed of {len(fitting)} fit)"
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models",
        default="cnn,encoder,decoder",
        help=f"comma-separated, of {','.join(RECIPES)} (default: cnn,encoder,decoder)",
    )
    parser.add_argument("--tune-budget", type=float, default=120, help="seconds per tune run")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds of the grid")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on a machine shared by several jobs, two threads that "
        "wait for each other ran a step 10x slower than one)",
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = [run_model(name, args.tune_budget, args.repeats) for name in args.models.split(",")]
    print()
    print(f"{'model':<8} {'budget':>6} {'adopted':<34} {'fits':>4} {'vs fastest':>10}")
    for model in results:
        for entry in model["budgets"]:
            ratio = entry.get("adopted_over_fastest")
            print(
                f"{model['model']:<8} {entry['fraction']:>6} "
                f"{(entry.get('adopted_point') or entry.get('note', ''))[:34]:<34} "
                f"{'yes' if entry.get('adopted_fits') else 'no':>4} "
                f"{'' if ratio is None else f'{ratio:.3f}':>10}"
            )
    if args.json:
        from torchturbo.output.results_file import write_results

        write_results(
            args.json,
            {
                "results": results,
                "torch": torch.__version__,
                "machine": platform.processor() or platform.machine(),
                "threads": torch.get_num_threads(),
            },
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
