"""Hugging Face Trainer integration: settings reach the training, a Trainer setup tunes and benches.

Tiny models from configs (no downloads) on synthetic token-tagging data with long-tailed lengths.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import signal

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from conftest import run_two_ranks, terminal_stop_signals  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from tokenizers.models import WordLevel  # noqa: E402
from transformers import (  # noqa: E402
    BertConfig,
    BertForTokenClassification,
    DataCollatorForTokenClassification,
    PreTrainedTokenizerFast,
    ResNetConfig,
    ResNetForImageClassification,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from torchturbo import TurboConfig  # noqa: E402
from torchturbo.config import sections  # noqa: E402
from torchturbo.data.bucketing import BucketBatchSampler  # noqa: E402
from torchturbo.integrations.stopping import TrainerStopped  # noqa: E402
from torchturbo.integrations.transformers import (  # noqa: E402
    PreemptionCallback,
    TurboCallback,
    TurboTrainer,
    last_complete_checkpoint,
    recipe_from_trainer,
    training_arguments,
)
from torchturbo.integrations.translate import hf_arguments  # noqa: E402
from torchturbo.trials.trial import fixed_batches  # noqa: E402
from torchturbo.trials.variants import compare_configs  # noqa: E402
from torchturbo.tune.report.document import render_markdown, trainer_blocks  # noqa: E402
from torchturbo.tune.report.files import write_trainer_settings  # noqa: E402
from torchturbo.tune.search.run import TuneOptions, tune  # noqa: E402

VOCAB = 64
CLASSES = 4
CPU = TurboConfig(device="cpu")


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"t{i}": i for i in range(2, VOCAB)}}
    model = WordLevel(vocab, unk_token="[UNK]")
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(model), pad_token="[PAD]", unk_token="[UNK]"
    )


def tagging_samples(n: int = 96, seed: int = 0) -> list[dict[str, list[int]]]:
    """Token ids with lognormal lengths; label = (token + previous token) mod CLASSES."""
    generator = torch.Generator().manual_seed(seed)
    lengths = (8 * torch.empty(n).normal_(0, 0.8, generator=generator).exp()).long().clamp(2, 96)
    samples = []
    for length in lengths.tolist():
        ids = torch.randint(2, VOCAB, (length,), generator=generator)
        previous = torch.cat([torch.zeros(1, dtype=torch.long), ids[:-1]])
        samples.append({"input_ids": ids.tolist(), "labels": ((ids + previous) % CLASSES).tolist()})
    return samples


def tiny_bert() -> BertForTokenClassification:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        num_labels=CLASSES,
    )
    return BertForTokenClassification(config)


def arguments(tmp_path, **kwargs) -> TrainingArguments:
    base = {
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": 8,
        "max_steps": 3,
        "learning_rate": 1e-3,
        "report_to": "none",
        "save_strategy": "no",
        "disable_tqdm": True,
        "use_cpu": True,
        "seed": 0,
    }
    return TrainingArguments(**(base | kwargs))


class Probe:
    """Forward hooks on a model: output dtype of a Linear, padding of every batch trained."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.dtypes: list[torch.dtype] = []
        self.masks: list[torch.Tensor] = []
        linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
        linear.register_forward_hook(lambda mod, args, out: self.dtypes.append(out.dtype))
        model.register_forward_pre_hook(self._batch, with_kwargs=True)

    def _batch(self, module, args, kwargs) -> None:
        self.masks.append(kwargs["attention_mask"].detach().clone())

    def padding(self) -> float:
        padded = sum(mask.numel() for mask in self.masks)
        return 1 - sum(int(mask.sum()) for mask in self.masks) / padded

    def rows(self) -> list[int]:
        return [mask.shape[0] for mask in self.masks]


def train_probed(tmp_path, config: TurboConfig | None, trainer_class=Trainer, **args_kwargs):
    model = tiny_bert()
    probe = Probe(model)
    kwargs = {} if config is None else training_arguments(config).kwargs
    extra = {} if trainer_class is Trainer else {"turbo_config": config}
    trainer = trainer_class(
        model=model,
        args=arguments(tmp_path, **(kwargs | args_kwargs)),
        train_dataset=tagging_samples(),
        data_collator=DataCollatorForTokenClassification(tokenizer()),
        **extra,
    )
    trainer.train()
    return trainer, probe


def test_turbo_settings_reach_the_trainers_training_steps(tmp_path):
    config = CPU.replace(precision__dtype="bf16", accumulation__steps=2, data__batches="buckets")
    trainer, probe = train_probed(tmp_path, config, TurboTrainer)
    # bf16 autocast is active in the forward: a Linear's output is bfloat16.
    assert set(probe.dtypes) == {torch.bfloat16}
    # 3 optimizer steps of 2 micro-batches each.
    assert trainer.state.global_step == 3 and len(probe.masks) == 6
    # The bucket sampler is in use: every batch fits its token budget, and an epoch has the
    # user's batches of 8 rows (so their real tokens per step, on average).
    sampler = trainer.get_train_dataloader().batch_sampler
    assert isinstance(sampler, BucketBatchSampler) and sampler.max_tokens is not None
    assert all(mask.numel() <= sampler.max_tokens for mask in probe.masks)
    assert len(sampler) <= math.ceil(len(tagging_samples()) / 8)
    assert len(set(probe.rows())) > 1  # rows vary with length: a budget, not a batch size
    # Negative control: the Trainer's defaults, fp32 random batches of 8, much more padding.
    _, default_probe = train_probed(tmp_path, None)
    assert set(default_probe.dtypes) == {torch.float32} and len(default_probe.masks) == 3
    assert set(default_probe.rows()) == {8}
    assert probe.padding() < default_probe.padding() / 2


def test_a_plain_trainer_gets_length_grouping_from_the_arguments(tmp_path):
    config = CPU.replace(data__batches="buckets")
    trainer, probe = train_probed(tmp_path, config, max_steps=4)
    sampler = trainer.get_train_dataloader().batch_sampler.sampler
    assert type(sampler).__name__ == "LengthGroupedSampler"
    assert set(probe.rows()) == {8}  # fixed rows per batch: grouping, not a token budget
    _, random_probe = train_probed(tmp_path, CPU, max_steps=4)
    assert probe.padding() < random_probe.padding()


def test_every_config_field_is_carried_or_noted():
    """Each field at a non-default value changes the keywords or adds a note naming it."""
    changed = {
        ("precision", "dtype"): "tf32",
        ("precision", "grad_scaler"): None,  # the default: fp16 implies it (checked below)
        ("precision", "float8"): True,
        ("optimizer", "implementation"): "fused",
        ("optimizer", "state"): "8bit",
        ("memory_format", "channels_last"): True,
        ("backend", "cudnn_benchmark"): True,
        ("compile", "mode"): "max-autotune",
        ("compile", "fullgraph"): True,
        ("compile", "dynamic"): False,
        ("compile", "scope"): "blocks",
        ("checkpointing", "mode"): "full",
        ("checkpointing", "module_types"): ("BertLayer",),
        ("checkpointing", "name_pattern"): "bert.*",
        ("checkpointing", "every_n"): 2,
        ("checkpointing", "blocks"): None,  # only beside mode = "selective" alone: below
        ("compile", "cache_dir"): "compile-cache",
        ("compile", "activation_memory_budget"): 0.5,
        ("accumulation", "steps"): 4,
        ("accumulation", "micro_batches"): 2,
        ("clipping", "max_norm"): 0.5,
        ("clipping", "norm_type"): 1.0,
        ("data", "num_workers"): 2,
        ("data", "pin_memory"): True,
        ("data", "persistent_workers"): True,
        ("data", "prefetch_factor"): 4,
        ("data", "non_blocking"): False,
        ("data", "batches"): "buckets",
        ("data", "max_tokens"): 4096,
        ("data", "pad_to_multiple"): 8,
        ("data", "max_shapes"): 8,
        ("reliability", "keep_last"): 5,
        ("reliability", "auto_microbatch"): False,
        ("reliability", "memory_budget_bytes"): 2**20,
        ("reliability", "nonfinite_patience"): 0,
        ("reliability", "stop_grace_s"): 60.0,
        ("distributed", "strategy"): "fsdp",
        ("distributed", "comm_hook"): "powersgd",
        ("distributed", "powersgd_rank"): 2,
        ("distributed", "powersgd_warmup"): 5,
        ("distributed", "bucket_cap_mb"): 50.0,
        ("distributed", "gradient_as_bucket_view"): True,
        ("distributed", "static_graph"): True,
        ("distributed", "fsdp_param_dtype"): "bf16",
        ("distributed", "fsdp_reduce_dtype"): "bf16",
        ("distributed", "pipeline_schedule"): "gpipe",
        ("distributed", "pipeline_microbatches"): 8,
        ("chunked_loss", "enabled"): True,
        ("chunked_loss", "chunk_tokens"): 128,
        ("activation_compression", "dtype"): "bf16",
        ("activation_compression", "min_bytes"): 4096,
        ("liger_kernel", "enabled"): True,
        ("tune", "in_run"): True,
        ("tune", "measure_share"): 0.2,
    }
    every_field = {(s, f.name) for s, cls in sections().items() for f in dataclasses.fields(cls)}
    assert set(changed) == every_field  # a new core config field must be added here
    # Fields that only mean something beside another one: the base sets that one.
    companions = {
        "fullgraph": {"compile__mode": "default"},
        "dynamic": {"compile__mode": "default"},
        "scope": {"compile__mode": "default"},
        "cache_dir": {"compile__mode": "default"},
        "chunk_tokens": {"chunked_loss__enabled": True},
        "min_bytes": {"activation_compression__dtype": "bf16"},
        "activation_memory_budget": {"compile__mode": "default"},
        "module_types": {"checkpointing__mode": "selective", "checkpointing__every_n": 2},
        "name_pattern": {"checkpointing__mode": "selective", "checkpointing__every_n": 2},
        "every_n": {"checkpointing__mode": "full"},
        "persistent_workers": {"data__num_workers": 2},
        "prefetch_factor": {"data__num_workers": 2},
        "max_tokens": {"data__batches": "buckets"},
        "max_shapes": {"data__batches": "buckets"},
        "non_blocking": {"data__pin_memory": True},
        "powersgd_rank": {"distributed__comm_hook": "powersgd"},
        "powersgd_warmup": {"distributed__comm_hook": "powersgd"},
    }
    for (section, name), value in changed.items():
        if value is None:
            continue
        base = CPU.replace(**companions.get(name, {}))
        config = CPU.replace(**companions.get(name, {}), **{f"{section}__{name}": value})
        before, after = hf_arguments(base), hf_arguments(config)
        key = f"[{section}] {name}"
        assert (
            after.kwargs != before.kwargs
            or key in after.notes
            or (
                # A companion's note already names the pair (e.g. bucketing's token budget).
                after.notes != before.notes
            )
        ), f"{key} = {value!r} is silently dropped"
    assert hf_arguments(CPU.replace(precision__dtype="fp16")).kwargs["fp16"] is True
    named = CPU.replace(checkpointing__mode="selective", checkpointing__blocks=("layer.0",))
    assert "applied by" in hf_arguments(named).notes["[checkpointing] mode"]


def test_transformers_4_names_are_used_when_the_installed_version_has_them():
    config = CPU.replace(data__batches="buckets", checkpointing__mode="full")
    v4 = hf_arguments(config, fields={"group_by_length", "gradient_checkpointing"})
    assert v4.kwargs["group_by_length"] is True and v4.kwargs["gradient_checkpointing"] is True
    v5 = hf_arguments(config)
    assert v5.kwargs["train_sampling_strategy"] == "group_by_length"
    assert v5.kwargs["activation_checkpointing_kwargs"] == {"use_reentrant": False}
    # What we emit is what the installed TrainingArguments accepts.
    TrainingArguments(output_dir="unused", **v5.kwargs)


def test_clipping_is_left_alone_unless_the_config_sets_it():
    assert "max_grad_norm" not in training_arguments(CPU).kwargs
    assert "[clipping] max_norm" in training_arguments(CPU).notes
    assert training_arguments(CPU.replace(clipping__max_norm=0.5)).kwargs["max_grad_norm"] == 0.5


def make_trainer(tmp_path, **args_kwargs) -> Trainer:
    samples = [s | {"length": len(s["input_ids"]), "note": "dropped"} for s in tagging_samples()]
    return Trainer(
        model=tiny_bert(),
        args=arguments(tmp_path, weight_decay=0.01, **args_kwargs),
        train_dataset=samples,
        data_collator=DataCollatorForTokenClassification(tokenizer()),
    )


def test_recipe_from_trainer_holds_the_trainers_setup(tmp_path):
    trainer = make_trainer(tmp_path)
    recipe = recipe_from_trainer(trainer)
    assert recipe.lengths == [len(s["input_ids"]) for s in tagging_samples()]
    assert recipe.count_unit == "tokens" and recipe.batch_size == 8 and recipe.seed == 0
    model, optimizer = recipe.build()
    # Every trial starts from the Trainer's weights, with the Trainer's optimizer.
    for mine, theirs in zip(model.parameters(), trainer.model.parameters(), strict=True):
        assert torch.equal(mine, theirs) and mine is not theirs
    assert type(optimizer) is torch.optim.AdamW
    decays = sorted(group["weight_decay"] for group in optimizer.param_groups)
    assert decays == [0.0, 0.01] and optimizer.defaults["lr"] == 1e-3
    norm_weight = model.bert.embeddings.LayerNorm.weight
    no_decay = next(g for g in optimizer.param_groups if g["weight_decay"] == 0.0)
    assert any(p is norm_weight for p in no_decay["params"])
    # The batch holds model inputs only (the length and note columns are dropped, as Trainer
    # does), and the loss is the Trainer's, over the labelled tokens.
    batch = recipe.collate([recipe.dataset[i] for i in range(4)])
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    model.eval()  # no dropout: the two losses below must see the same network
    loss, count = recipe.loss_fn(model, batch)
    assert count == int((batch["labels"] != -100).sum()) == sum(recipe.lengths[:4])
    assert torch.allclose(loss, trainer.compute_loss(model, dict(batch)))
    assert "labels" in batch  # compute_loss did not pop it from the reused batch


def test_recipe_from_trainer_with_model_init_and_a_given_optimizer(tmp_path):
    model = tiny_bert()
    sgd = torch.optim.SGD(
        [
            {"params": list(model.classifier.parameters()), "lr": 0.5},
            {"params": list(model.bert.parameters())},
        ],
        lr=0.1,
        momentum=0.9,
    )
    trainer = Trainer(
        model=model,
        args=arguments(tmp_path),
        train_dataset=tagging_samples(),
        data_collator=DataCollatorForTokenClassification(tokenizer()),
        optimizers=(sgd, None),
    )
    _, optimizer = recipe_from_trainer(trainer).build()
    assert type(optimizer) is torch.optim.SGD
    assert [g["lr"] for g in optimizer.param_groups] == [0.5, 0.1]
    assert optimizer.defaults["momentum"] == 0.9

    calls = []
    init_trainer = Trainer(
        model_init=lambda: calls.append(1) or tiny_bert(),
        args=arguments(tmp_path),
        train_dataset=tagging_samples(),
        data_collator=DataCollatorForTokenClassification(tokenizer()),
    )
    before = len(calls)
    recipe_from_trainer(init_trainer).build()
    assert len(calls) == before + 1


class TaggingStream(torch.utils.data.IterableDataset):
    """The tagging samples as a stream, as a ``datasets.IterableDataset`` gives them."""

    column_names = ("input_ids", "labels")  # as a stream with known features has them

    def __iter__(self):
        yield from tagging_samples()


def test_recipe_from_trainer_takes_a_stream(tmp_path):
    trainer = Trainer(
        model=tiny_bert(),
        args=arguments(tmp_path, max_steps=4),
        train_dataset=TaggingStream(),
        data_collator=DataCollatorForTokenClassification(tokenizer()),
    )
    recipe = recipe_from_trainer(trainer)
    assert recipe.lengths is None and recipe.count_unit == "tokens"
    first, second = fixed_batches(recipe, 2)  # the stream's own order: its first 16 samples
    for batch, samples in ((first, tagging_samples()[:8]), (second, tagging_samples()[8:16])):
        assert torch.equal(batch["labels"], recipe.collate(samples)["labels"])
    model, _ = recipe.build()
    _, count = recipe.loss_fn(model, first)
    assert count == int((first["labels"] != -100).sum())


@pytest.mark.slow
def test_recipe_from_trainer_tunes_dynamic_batching_and_benches(tmp_path):
    recipe = recipe_from_trainer(make_trainer(tmp_path))
    options = TuneOptions(time_budget_s=120, device="cpu", only=("dynamic_batching",))
    config, result = tune(recipe, options)
    buckets = next(o for o in result.candidates if o.name == "length buckets")
    # Measured, not skipped for want of lengths: the Trainer's dataset gave them.
    assert buckets.comparison is not None and buckets.parity is not None, buckets.reason
    # Adopted or not is the machine's noise on a model this small (tests/test_hf_recipe.py holds
    # the adoption on a larger encoder); what the tuner chose is what the config says.
    assert buckets.verdict in ("adopted", "rejected")
    assert (config.data.batches == "buckets") == (buckets.verdict == "adopted")
    assert result.unit == "tokens/s"
    rows = compare_configs(
        recipe,
        {"baseline": CPU, "bf16": CPU.replace(precision__dtype="bf16")},
        baseline="baseline",
        repeats=2,
        steps_per_repeat=1,
    )
    assert [r.variant for r in rows] == ["baseline", "bf16"]
    assert all(r.throughput > 0 and r.unit == "tokens/s" for r in rows)


def test_turbo_callback_puts_a_conv_model_in_channels_last(tmp_path):
    torch.manual_seed(0)
    model = ResNetForImageClassification(
        ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=2)
    )
    images = torch.randn(16, 3, 32, 32)
    samples = [{"pixel_values": x, "labels": int(x[0].mean() > 0)} for x in images]
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert not convs[0].weight.is_contiguous(memory_format=torch.channels_last)
    callback = TurboCallback(CPU.replace(memory_format__channels_last=True, precision__float8=True))
    trainer = Trainer(
        model=model,
        args=arguments(tmp_path, max_steps=2),
        train_dataset=samples,
        callbacks=[callback],
    )
    assert all(c.weight.is_contiguous(memory_format=torch.channels_last) for c in convs)
    trainer.train()
    # float8 is reported, not applied, where there is no fp8 unit (the Linear stays a Linear).
    assert callback.applied["channels_last"] is None
    assert "CPUs have no fp8 units" in callback.applied["float8"]
    assert type(model.classifier[-1]) is torch.nn.Linear
    assert all(c.weight.is_contiguous(memory_format=torch.channels_last) for c in convs)


DDP_SCRIPT = """
import json, os, sys
os.environ["HF_HUB_OFFLINE"] = "1"
sys.path.insert(0, {tests!r})
import torch
from test_integrations_transformers import arguments, tagging_samples, tiny_bert, tokenizer
from transformers import DataCollatorForTokenClassification
from torchturbo import TurboConfig
from torchturbo.distributed import shutdown
from torchturbo.integrations.transformers import TurboTrainer, training_arguments
from pathlib import Path

config = TurboConfig(device="cpu").replace(distributed__comm_hook="fp16", data__batches="buckets")
trainer = TurboTrainer(
    model=tiny_bert(),
    args=arguments(Path(sys.argv[1]), **training_arguments(config).kwargs),
    train_dataset=tagging_samples(),
    data_collator=DataCollatorForTokenClassification(tokenizer()),
    turbo_config=config,
)
trainer.train()
ddp = trainer.model_wrapped
rank = int(os.environ["RANK"])
logging = ddp._get_ddp_logging_data()
first = [p.detach().clone() for p in trainer.model.parameters()][0]
(Path(sys.argv[1]) / f"rank{{rank}}.json").write_text(json.dumps({{
    "wrapper": type(ddp).__name__, "comm_hook": logging.get("comm_hook"),
    "first": first.flatten()[:8].tolist(),
}}))
# The Trainer and its DDP wrapper hold the process group: free them before it is destroyed,
# or gloo work they reference can abort the process at exit.
del trainer, ddp
shutdown()
"""


@pytest.mark.slow
def test_turbo_trainer_registers_the_comm_hook_under_torchrun(tmp_path):
    script = tmp_path / "hf_ddp.py"
    script.write_text(DDP_SCRIPT.format(tests=os.path.dirname(__file__)))
    ranks, _ = run_two_ranks(script, tmp_path, timeout_s=240)
    assert all(r["wrapper"] == "DistributedDataParallel" for r in ranks)
    assert all("fp16_compress_hook" in r["comm_hook"] for r in ranks)
    assert ranks[0]["first"] == ranks[1]["first"]  # replicas stayed in step


def test_importing_the_package_does_not_import_the_libraries():
    import subprocess
    import sys

    code = (
        "import sys, torchturbo.integrations, torchturbo.integrations.translate;"
        "print(any(m in sys.modules for m in ('transformers', 'lightning')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_tune_writes_trainer_arguments_a_user_can_paste(tmp_path):
    config = CPU.replace(
        precision__dtype="bf16",
        data__batches="buckets",
        compile__mode="default",
        distributed__comm_hook="fp16",
    )
    paths = write_trainer_settings(tmp_path, config)
    source = paths["hf_trainer"].read_text()
    namespace: dict = {}
    exec(compile(source, str(paths["hf_trainer"]), "exec"), namespace)
    assert namespace["TRAINING_ARGUMENTS"] == training_arguments(config).kwargs
    args = TrainingArguments(output_dir=str(tmp_path / "out"), **namespace["TRAINING_ARGUMENTS"])
    assert args.bf16 and args.torch_compile and args.train_sampling_strategy == "group_by_length"
    # What the arguments cannot carry is in the file, with where it goes instead.
    assert "[data] batches" in source and "[distributed] comm_hook" in source
    assert "import torchturbo" not in source.split('"""')[-1]  # the arguments need no torchturbo


def test_the_report_shows_the_trainer_ways_in_valid_python():
    markdown = render_markdown(trainer_blocks())
    assert "### In a Hugging Face Trainer" in markdown
    assert "### In Lightning" in markdown
    for snippet in re.findall(r"```python\n(.*?)```", markdown, re.S):
        compile(snippet, "report", "exec")


@pytest.mark.slow
def test_peers_benchmark_runs_the_trainer_three_ways(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    config = tmp_path / "turbo.toml"
    CPU.replace(precision__dtype="bf16", data__batches="buckets").save(config)
    script = Path(__file__).parent.parent / "benchmarks" / "peers.py"
    command = [sys.executable, str(script), "--quick", "--workloads", "text"]
    command += ["--config", str(config), "--out", str(tmp_path / "out")]
    command += ["--json", str(tmp_path / "peers.json")]
    subprocess.run(command, check=True, capture_output=True, timeout=300)
    ways = json.loads((tmp_path / "peers.json").read_text())["text"]["ways"]
    assert set(ways) == {"defaults", "recommended", "torchturbo"}
    assert all(way["throughput"] > 0 and way["held_out_loss"] > 0 for way in ways.values())
    # Each way trained the same epoch; torchturbo's buckets pad least.
    assert ways["torchturbo"]["padding_fraction"] < ways["defaults"]["padding_fraction"]


def test_recipe_from_trainer_plans_the_steps_the_trainer_will_run(tmp_path):
    trainer = make_trainer(tmp_path)
    recipe = recipe_from_trainer(trainer)
    assert recipe.planned_steps == 3 and recipe.planned_steps_source == "the Trainer's max_steps=3"
    # 96 samples, batch 8: 12 batches, 6 optimizer steps an epoch over 2 accumulated batches.
    trainer = make_trainer(
        tmp_path, max_steps=-1, num_train_epochs=2, gradient_accumulation_steps=2
    )
    recipe = recipe_from_trainer(trainer)
    assert recipe.planned_steps == 24
    assert recipe.planned_steps_source == (
        "the Trainer's num_train_epochs=2 x 6 optimizer steps per epoch "
        "x gradient_accumulation_steps=2"
    )
    # The Trainer's own count: the optimizer steps it runs are the planned batches over 2.
    trainer.train()
    assert trainer.state.global_step * 2 == recipe.planned_steps


# --- preemption: the Trainer's own checkpoint of the step under way ---------------------------


class _SignalDuring(TrainerCallback):
    """Sends this process ``signum`` as optimizer step ``step`` begins (global_step step - 1)."""

    def __init__(self, step: int, signum: int = signal.SIGTERM) -> None:
        self.step, self.signum = step, signum

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        if state.global_step == self.step - 1:
            os.kill(os.getpid(), self.signum)


def _stoppable(tmp_path, config, *callbacks, trainer_class=TurboTrainer) -> Trainer:
    extra = {"turbo_config": config} if trainer_class is TurboTrainer else {}
    return trainer_class(
        model=tiny_bert(),  # dropout on: the resumed masks must be the uninterrupted ones
        args=arguments(tmp_path, max_steps=6, **training_arguments(config).kwargs),
        train_dataset=tagging_samples(),
        data_collator=DataCollatorForTokenClassification(tokenizer()),
        callbacks=list(callbacks),
        **extra,
    )


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in trainer.model.state_dict().items()}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("trainer_class", "batches"),
    [(TurboTrainer, "buckets"), (Trainer, "rows")],
    ids=["TurboTrainer, length buckets", "Trainer with PreemptionCallback"],
)
def test_a_stop_signal_saves_the_step_under_way_as_the_trainers_checkpoint_and_resumes_exactly(
    tmp_path, trainer_class, batches
):
    config = CPU.replace(data__batches=batches)
    full = _stoppable(tmp_path / "full", config, trainer_class=trainer_class)
    full.train()
    expected = _weights(full)
    plain = trainer_class is Trainer
    stops = [_SignalDuring(3), *([PreemptionCallback()] if plain else [])]
    stopped = _stoppable(tmp_path / "run", config, *stops, trainer_class=trainer_class)
    with terminal_stop_signals(), pytest.raises(TrainerStopped) as caught:
        stopped.train()
    assert caught.value.code == 75 and caught.value.step == 3  # the step under way, saved
    out = tmp_path / "run" / "out"
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-3"]
    assert "SIGTERM: stopped after optimizer step 3 and saved it in " in caught.value.line
    resumed = _stoppable(tmp_path / "run", config, trainer_class=trainer_class)
    resumed.train(resume_from_checkpoint=True if not plain else str(out / "checkpoint-3"))
    assert all(torch.equal(expected[k], v) for k, v in resumed.model.state_dict().items())


def test_resuming_skips_a_checkpoint_that_a_kill_cut_short(tmp_path):
    for step in (2, 4):
        (tmp_path / f"checkpoint-{step}").mkdir()
    (tmp_path / "checkpoint-2" / "trainer_state.json").write_text("{}")
    with pytest.warns(RuntimeWarning, match=r"checkpoint-4 has no trainer_state\.json"):
        assert last_complete_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-2")
    (tmp_path / "checkpoint-4" / "trainer_state.json").write_text("{}")
    assert last_complete_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-4")


def test_in_run_turbo_trainer_starts_where_the_facts_point(fast_bf16, tmp_path):
    """``[tune] in_run = true`` and nothing else: the Trainer's arguments are rebuilt on bf16,
    its batches are length buckets, it trains the steps asked and keeps its reasons."""
    from recipes import hf_causal_lm
    from transformers import TrainingArguments

    from torchturbo.integrations.transformers import TurboTrainer

    config = TurboConfig(device="cpu").replace(tune__in_run=True)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=6,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        save_strategy="no",
    )
    trainer = TurboTrainer(
        model=hf_causal_lm.model(),
        args=args,
        train_dataset=hf_causal_lm.documents(),
        data_collator=hf_causal_lm.collator(),
        turbo_config=config,
    )
    assert trainer.args.bf16 and not args.bf16  # the user's arguments are left as they were
    assert trainer.turbo_config.data.batches == "buckets"
    output = trainer.train()
    assert output.global_step == 6
    saved = json.loads((tmp_path / "tuned" / "results.json").read_text())
    assert {s["name"] for s in saved["start"] if s["taken"]} == {"bf16", "length buckets"}
    assert saved["measured"] == []  # accelerate's autocast is fixed for the run


def test_in_run_turbo_trainer_measures_a_switchable_transform_on_its_steps(
    fast_chunked_loss, tmp_path
):
    """A causal LM whose logits dominate: the chunked loss, expected to gain under what a start
    needs, is tried on the Trainer's own optimizer steps (made twice as fast with it here) by
    switching it per step, and adopted; the precision, accelerate's, is not measured."""
    from recipes import hf_causal_lm

    from torchturbo.integrations.transformers import TurboTrainer

    model = hf_causal_lm.logits_heavy_model()
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=40,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        save_strategy="no",
    )
    trainer = TurboTrainer(
        model=model,
        args=args,
        train_dataset=hf_causal_lm.documents(),
        data_collator=hf_causal_lm.collator(),
        turbo_config=TurboConfig(device="cpu").replace(tune__in_run=True),
    )
    assert not trainer.turbo_config.chunked_loss.enabled
    assert trainer.train().global_step == 40
    saved = json.loads((tmp_path / "tuned" / "results.json").read_text())
    (chunked,) = saved["measured"]
    assert chunked["name"] == "chunked_loss" and chunked["verdict"] == "adopted"
    assert chunked["windows"]["without"] >= 3
    assert trainer.turbo_config.chunked_loss.enabled
