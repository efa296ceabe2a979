"""Lightning integration: the callback transforms the module as the engine does, the Trainer's
keywords carry the config, and Lightning trains to the same losses as the Turbo loop."""

from __future__ import annotations

import copy
import os
import signal

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("lightning.pytorch")

from conftest import run_two_ranks, terminal_stop_signals  # noqa: E402

from torchturbo import Turbo, TurboConfig  # noqa: E402
from torchturbo.integrations.lightning import (  # noqa: E402
    TurboLightningCallback,
    recipe_from_lightning,
    trainer_kwargs,
)
from torchturbo.integrations.stopping import TrainerStopped  # noqa: E402
from torchturbo.recipe import RecipeError  # noqa: E402
from torchturbo.trials.variants import compare_configs  # noqa: E402
from torchturbo.tune.report.files import write_trainer_settings  # noqa: E402

pytestmark = [
    # Lightning suggests more loader workers and a logger; neither matters to these tests.
    pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning"),
    # Lightning 2.6 builds torch's LeafSpec, which torch 2.13 deprecates; not ours to fix.
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)`:FutureWarning"),
]

CPU = TurboConfig(device="cpu")
STEPS = 4


class Classifier(pl.LightningModule):
    """A user's module: conv blocks in Sequentials, a loss that it logs, AdamW."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.features = nn.Sequential(
            nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()),
            nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU()),
        )
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))

    def training_step(self, batch, batch_idx):
        images, labels = batch
        loss = F.cross_entropy(self(images), labels)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Images(pl.LightningDataModule):
    """Learnable synthetic images: the label is the sign of the red channel's mean."""

    def setup(self, stage: str) -> None:
        generator = torch.Generator().manual_seed(0)
        images = torch.randn(64, 3, 12, 12, generator=generator)
        self.data = TensorDataset(images, (images[:, 0].mean(dim=(1, 2)) > 0).long())

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=8, shuffle=False)


class LossRecorder(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def fit(module: pl.LightningModule, config: TurboConfig | None, *callbacks) -> LossRecorder:
    recorder = LossRecorder()
    kwargs = {"accelerator": "cpu"} if config is None else trainer_kwargs(config).kwargs
    extra = [] if config is None else [TurboLightningCallback(config)]
    trainer = pl.Trainer(
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*extra, *callbacks, recorder],
        **kwargs,
    )
    trainer.fit(module, datamodule=Images())
    return recorder


def count_calls(module: nn.Module) -> list[int]:
    calls = [0]
    module.register_forward_hook(lambda *args: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_lightning_with_the_callback_trains_like_the_turbo_loop():
    config = CPU.replace(memory_format__channels_last=True, checkpointing__mode="full")
    module = Classifier()
    recipe = recipe_from_lightning(module, Images())  # before fit: trials start from these weights
    conv = module.features[0][0]
    calls = count_calls(conv)
    lightning_losses = fit(module, config).losses

    # channels_last weights, and checkpointed blocks: the first conv ran again in every backward.
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert calls[0] == 2 * STEPS

    turbo = Turbo(config)
    model, optimizer = recipe.build()
    turbo.setup(model, optimizer)
    loader = DataLoader(recipe.dataset, batch_size=recipe.batch_size, collate_fn=recipe.collate)
    batches = [batch for batch, _ in zip(loader, range(STEPS), strict=False)]
    turbo_losses = [float(turbo.step(recipe.loss_fn, batch).loss) for batch in batches]
    # Same fp32 operations on the same batches from the same weights: equal up to the order in
    # which oneDNN sums a convolution (NCHW input converted inside vs converted beforehand).
    assert lightning_losses == pytest.approx(turbo_losses, rel=1e-5)

    # Negative control: the same module without the callback is neither NHWC nor checkpointed.
    plain = Classifier()
    plain_calls = count_calls(plain.features[0][0])
    fit(plain, None)
    assert not plain.features[0][0].weight.is_contiguous(memory_format=torch.channels_last)
    assert plain_calls[0] == STEPS


class DtypeProbe(pl.Callback):
    """Output dtype of the head and the number of training batches per optimizer step."""

    def __init__(self) -> None:
        self.dtypes: list[torch.dtype] = []
        self.batches = 0

    def on_fit_start(self, trainer, pl_module) -> None:
        pl_module.head.register_forward_hook(lambda m, a, out: self.dtypes.append(out.dtype))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.batches += 1


def test_trainer_kwargs_carry_precision_accumulation_and_clipping():
    config = CPU.replace(precision__dtype="bf16", accumulation__steps=2, clipping__max_norm=0.5)
    settings = trainer_kwargs(config)
    assert settings.kwargs["precision"] == "bf16-mixed"
    assert settings.kwargs["gradient_clip_val"] == 0.5
    probe = DtypeProbe()
    module = Classifier()
    fit(module, config, probe)
    assert set(probe.dtypes) == {torch.bfloat16}  # autocast active in training
    assert module.trainer.global_step == STEPS and probe.batches == 2 * STEPS
    assert "[accumulation] steps" in settings.notes  # mean of means: said, not hidden
    # Negative control: the defaults train in fp32, one batch per step.
    plain_probe = DtypeProbe()
    fit(Classifier(), CPU, plain_probe)
    assert set(plain_probe.dtypes) == {torch.float32} and plain_probe.batches == STEPS


def test_recipe_from_lightning_builds_the_modules_optimizer_and_benches():
    module = Classifier()
    recipe = recipe_from_lightning(module, Images())
    model, optimizer = recipe.build()
    assert type(optimizer) is torch.optim.AdamW and optimizer.defaults["lr"] == 1e-2
    assert {id(p) for p in optimizer.param_groups[0]["params"]} == {
        id(p) for p in model.parameters()
    }
    pairs = zip(model.parameters(), module.parameters(), strict=True)
    assert all(torch.equal(copied, original) for copied, original in pairs)
    assert recipe.batch_size == 8 and recipe.lengths is None
    rows = compare_configs(
        recipe,
        {"baseline": CPU, "channels_last": CPU.replace(memory_format__channels_last=True)},
        baseline="baseline",
        repeats=2,
        steps_per_repeat=1,
    )
    assert rows[1].notes == {} and all(r.throughput > 0 for r in rows)


class Tagger(pl.LightningModule):
    """A user's token tagger: dict batches of padded ids and per-token labels (-100 on pads)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 3)

    def training_step(self, batch, batch_idx):
        logits = self.head(self.embed(batch["input_ids"]))
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def pad_tags(samples: list[dict]) -> dict[str, torch.Tensor]:
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    labels = torch.full((len(samples), longest), -100)
    for row, sample in enumerate(samples):
        ids[row, : len(sample["input_ids"])] = torch.tensor(sample["input_ids"])
        labels[row, : len(sample["labels"])] = torch.tensor(sample["labels"])
    return {"input_ids": ids, "labels": labels}


class Tags(pl.LightningDataModule):
    def setup(self, stage: str) -> None:
        self.data = [
            {"input_ids": [1 + (i + j) % 15 for j in range(n)], "labels": [j % 3 for j in range(n)]}
            for i, n in enumerate([3, 9, 2, 7, 5, 12, 4, 6])
        ]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=4, collate_fn=pad_tags)


def test_token_batches_are_counted_in_tokens_and_images_in_samples():
    """Length buckets hold more short samples or fewer long ones: a tagger's recipe must count
    its labels that count, or the tuner would compare bucketed batches by samples."""
    recipe = recipe_from_lightning(Tagger(), Tags())
    assert recipe.count_unit == "tokens" and recipe.lengths == [3, 9, 2, 7, 5, 12, 4, 6]
    model, _ = recipe.build()
    datamodule = Tags()
    datamodule.setup("fit")
    batch = pad_tags(datamodule.data[:4])
    loss, count = recipe.loss_fn(model, batch)
    assert int(count) == 3 + 9 + 2 + 7 and loss.dim() == 0
    assert recipe_from_lightning(Classifier(), Images()).count_unit == "samples"


def test_recipes_refuse_what_torchturbo_cannot_step():
    class Manual(Classifier):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

    with pytest.raises(RecipeError, match="manual optimization"):
        recipe_from_lightning(Manual(), Images())

    class TwoOptimizers(Classifier):
        def configure_optimizers(self):
            return [torch.optim.SGD(self.head.parameters(), lr=0.1)], []

    recipe_from_lightning(TwoOptimizers(), Images())  # ([one], [no scheduler]) is fine

    class Gan(Classifier):
        def configure_optimizers(self):
            return (
                {"optimizer": torch.optim.SGD(self.head.parameters(), lr=0.1)},
                {"optimizer": torch.optim.SGD(self.features.parameters(), lr=0.1)},
            )

    with pytest.raises(RecipeError, match="2 optimizers"):
        recipe_from_lightning(Gan(), Images())


def test_a_copy_is_what_the_callback_transforms():
    module = Classifier()
    trained = copy.deepcopy(module)
    fit(trained, CPU.replace(memory_format__channels_last=True))
    assert not module.features[0][0].weight.is_contiguous(memory_format=torch.channels_last)
    assert trained.features[0][0].weight.is_contiguous(memory_format=torch.channels_last)


DDP_SCRIPT = """
import json, os, sys
sys.path.insert(0, {tests!r})
import lightning.pytorch as pl
from test_integrations_lightning import Classifier, Images
from torchturbo import TurboConfig
from torchturbo.distributed import shutdown
from torchturbo.integrations.lightning import TurboLightningCallback, trainer_kwargs

config = TurboConfig(device="cpu").replace(distributed__comm_hook="fp16")
seen = {{}}


class Hook(pl.Callback):
    def on_train_end(self, trainer, pl_module):
        # Still inside fit: the strategy holds the DDP wrapper until teardown.
        seen["hook"] = trainer.strategy.model._get_ddp_logging_data().get("comm_hook")


module = Classifier()
trainer = pl.Trainer(
    devices=2, max_steps=3, logger=False, enable_checkpointing=False,
    enable_progress_bar=False, enable_model_summary=False,
    callbacks=[TurboLightningCallback(config), Hook()], **trainer_kwargs(config).kwargs,
)
trainer.fit(module, datamodule=Images())
first = next(module.parameters()).detach().flatten()[:8].tolist()
out = os.path.join(sys.argv[1], f"rank{{trainer.global_rank}}.json")
with open(out, "w") as f:
    json.dump({{"hook": seen["hook"], "world": trainer.world_size, "first": first}}, f)
# Lightning leaves the process group alive at exit, where gloo aborted the process in about
# 1 run of 5 on a loaded machine: free the Trainer (its strategy holds the DDP wrapper) and
# leave the group before the interpreter shuts down.
del trainer
shutdown()
"""


@pytest.mark.slow
def test_the_ddp_strategy_carries_the_comm_hook_under_torchrun(tmp_path):
    script = tmp_path / "pl_ddp.py"
    script.write_text(DDP_SCRIPT.format(tests=os.path.dirname(__file__)))
    ranks, _ = run_two_ranks(script, tmp_path, timeout_s=240)
    assert all(r["world"] == 2 and "fp16_compress_hook" in r["hook"] for r in ranks)
    assert ranks[0]["first"] == ranks[1]["first"]


def test_tune_writes_lightning_settings_a_user_can_paste(tmp_path):
    config = CPU.replace(
        precision__dtype="bf16",
        accumulation__steps=2,
        distributed__comm_hook="powersgd_fp16",
        distributed__powersgd_rank=2,
    )
    path = write_trainer_settings(tmp_path, config)["lightning"]
    namespace: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    kwargs = namespace["TRAINER_KWARGS"]
    strategy = kwargs["strategy"]
    assert isinstance(strategy, pl.strategies.DDPStrategy)
    assert strategy._ddp_comm_state.matrix_approximation_rank == 2
    assert {k: v for k, v in kwargs.items() if k != "strategy"} == {
        k: v for k, v in trainer_kwargs(config).kwargs.items() if k != "strategy"
    }
    trainer = pl.Trainer(logger=False, enable_progress_bar=False, **kwargs)
    assert trainer.accumulate_grad_batches == 2 and trainer.precision == "bf16-mixed"


def test_recipe_from_lightning_plans_the_trainers_steps_or_the_ones_given():
    module = Classifier()
    assert recipe_from_lightning(module, Images()).planned_steps is None
    quiet = {"accelerator": "cpu", "logger": False, "enable_progress_bar": False}
    by_epochs = pl.Trainer(max_epochs=2, **quiet)
    recipe = recipe_from_lightning(module, Images(), trainer=by_epochs)
    # 64 images in batches of 8: 8 batches an epoch.
    assert recipe.planned_steps == 16
    assert recipe.planned_steps_source == "the Lightning Trainer's max_epochs=2 x 8 batches"
    by_steps = pl.Trainer(max_steps=5, accumulate_grad_batches=2, **quiet)
    assert recipe_from_lightning(module, Images(), trainer=by_steps).planned_steps == 10
    given = recipe_from_lightning(module, Images(), trainer=by_steps, planned_steps=7)
    assert given.planned_steps == 7 and given.planned_steps_source == "planned_steps="


# --- preemption: the step under way saved as Lightning's checkpoint, resumed exactly -----------


class Dropping(Classifier):
    """The classifier with dropout: a resume must also give back the random state."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.dropout(self.features(x).mean(dim=(2, 3)), 0.3, self.training))


class ResumableLoader(DataLoader):
    """A shuffled loader that Lightning can resume mid-epoch (its ``state_dict`` interface, as
    torchdata's StatefulDataLoader has): Lightning restarts any other loader's epoch."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, generator=torch.Generator().manual_seed(0), **kwargs)
        self.yielded, self.skip, self.start = 0, 0, self.generator.get_state()

    def __iter__(self):
        self.start, skip, self.skip = self.generator.get_state(), self.skip, 0
        for index, batch in enumerate(super().__iter__()):
            self.yielded = index + 1
            if index >= skip:
                yield batch

    def state_dict(self) -> dict:
        return {"start": self.start, "yielded": self.yielded}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["start"])
        self.skip = state["yielded"]


class ShuffledImages(Images):
    def train_dataloader(self) -> DataLoader:
        return ResumableLoader(self.data, batch_size=8, shuffle=True)


class SignalAt(pl.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step - 1:
            os.kill(os.getpid(), signal.SIGTERM)


def _preemptible(root, *callbacks) -> pl.Trainer:
    return pl.Trainer(
        max_steps=6,
        accelerator="cpu",
        default_root_dir=root,
        callbacks=[TurboLightningCallback(CPU), *callbacks],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
    )


def _fitted(root, *callbacks, ckpt_path=None) -> dict[str, torch.Tensor]:
    module = Dropping()
    _preemptible(root, *callbacks).fit(module, ShuffledImages(), ckpt_path=ckpt_path)
    return {name: value.clone() for name, value in module.state_dict().items()}


@pytest.mark.slow
def test_a_stop_signal_saves_the_step_under_way_and_fit_resumes_it_exactly(tmp_path):
    full = _fitted(tmp_path / "full")
    with terminal_stop_signals(), pytest.raises(TrainerStopped) as caught:
        _fitted(tmp_path / "run", SignalAt(3))
    assert caught.value.code == 75 and caught.value.step == 3
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["hpc_ckpt_1.ckpt"]
    resumed = _fitted(tmp_path / "run", ckpt_path="hpc")
    assert all(torch.equal(full[name], value) for name, value in resumed.items())


@pytest.mark.slow
def test_negative_control_without_the_random_state_the_resume_differs(tmp_path, monkeypatch):
    full = _fitted(tmp_path / "full")
    with terminal_stop_signals(), pytest.raises(TrainerStopped):
        _fitted(tmp_path / "run", SignalAt(3))
    monkeypatch.setattr(TurboLightningCallback, "load_state_dict", lambda self, state: None)
    resumed = _fitted(tmp_path / "run", ckpt_path="hpc")
    assert not all(torch.equal(full[name], value) for name, value in resumed.items())


class ManyTags(Tags):
    def setup(self, stage: str) -> None:
        self.data = [
            {"input_ids": [1 + (i + j) % 15 for j in range(n)], "labels": [j % 3 for j in range(n)]}
            for i, n in enumerate([2, 30, 3, 28, 4, 25, 2, 31] * 6)
        ]


class SeenPrecision(pl.Callback):
    def __init__(self) -> None:
        self.seen: list[str] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.seen.append(trainer.precision)


def test_in_run_tuning_starts_from_the_facts_and_measures_the_precision_on_lightning_steps(
    fast_bf16, tmp_path
):
    """``[tune] in_run = true`` and nothing else: the callback starts on bf16 and length
    buckets (the facts say bf16 is fast and the lengths pad), runs fp32 windows against bf16
    ones by swapping the precision plugin, adopts bf16 and keeps what it decided."""
    config = CPU.replace(tune__in_run=True)
    callback, seen = TurboLightningCallback(config), SeenPrecision()
    trainer = pl.Trainer(
        max_steps=40,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[callback, seen],
        **trainer_kwargs(config).kwargs,
    )
    trainer.fit(Tagger(), datamodule=ManyTags())
    assert trainer.global_step == 40
    assert callback.config.data.batches == "buckets" and callback.config.precision.dtype == "bf16"
    (bf16,) = callback.in_run.comparisons
    assert bf16.verdict == "adopted" and bf16.windows["without"] >= 3
    assert "32-true" in seen.seen and seen.seen[-1] == "bf16-mixed"
    decided = TurboConfig.from_toml((tmp_path / "tuned" / "turbo.toml").read_text())
    assert decided.precision.dtype == "bf16" and not decided.tune.in_run
