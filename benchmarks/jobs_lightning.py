"""The Lightning side of ``peers_jobs.py``: the same setups as a user writes them for Lightning.

Each setup is a LightningModule and a LightningDataModule written the plain way (a shuffled
DataLoader of batch 16 and the setup's collator): the Llama causal LM and the BERT tagger of
``peers_jobs.py`` (their Hugging Face models inside the module, ``training_step`` returning the
model's loss), and the ``vision`` workload's ResNet on 32 px images. The ways:

1. ``defaults``: ``L.Trainer(max_steps=...)``, fp32;
2. ``compile``: ``torch.compile(module)`` as Lightning's speed guide shows (with ``--compile``);
3. ``torchturbo``: ``tune`` on ``recipe_from_lightning(module, datamodule, trainer=...)``, whose
   ``max_steps`` is the job's length, then exactly what docs/integrations.md says:
   ``trainer_kwargs(config)`` and ``TurboLightningCallback(config)``, which rebuilds the
   datamodule's DataLoader on the config's batch plan when it trains on length buckets.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import peers
import torch
from peers_lightning import StepClock, VisionModule
from torch.utils.data import DataLoader, TensorDataset
from transformers import DataCollatorForLanguageModeling, DataCollatorForTokenClassification

from torchturbo.config import TurboConfig
from torchturbo.integrations.lightning import (
    TurboLightningCallback,
    recipe_from_lightning,
    trainer_kwargs,
)
from torchturbo.recipe import Recipe
from torchturbo.workloads.vision import make_images

BATCH_SIZE = 16
#: The ``cnn`` setup's image side: 32 px keeps a step under a second on 2 shared cores.
IMAGE_SIZE = 32
WAYS = ("defaults", "compile", "torchturbo")


class TextModule(pl.LightningModule):
    """A Hugging Face model in a LightningModule: its loss is the training step's."""

    def __init__(self, setup: str) -> None:
        super().__init__()
        torch.manual_seed(0)  # every way starts from the same weights
        if setup == "llama":
            self.model: Any = peers.llama(64, 2)
        else:
            self.model = peers.model_init(64, 2)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Data(pl.LightningDataModule):
    """The setup's training set in a shuffled DataLoader (the callback rebuilds it on length
    buckets when the tuned config asks for them)."""

    def __init__(self, setup: str) -> None:
        super().__init__()
        self.collate: Any = None
        if setup == "cnn":
            images, labels = make_images(1536, IMAGE_SIZE, 10, seed=0)
            self.train: Any = TensorDataset(images, labels)
        elif setup == "llama":
            self.train = peers.documents(1536)
            self.collate = DataCollatorForLanguageModeling(peers.tokenizer(), mlm=False)
        else:
            self.train = peers.make_data(1536, 0).train
            self.collate = DataCollatorForTokenClassification(peers.tokenizer())

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        return DataLoader(
            self.train,
            batch_size=BATCH_SIZE,
            shuffle=True,
            generator=generator,
            collate_fn=self.collate,
        )


def module_for(setup: str) -> pl.LightningModule:
    return VisionModule(1e-3) if setup == "cnn" else TextModule(setup)


def trainer(steps: int, callbacks: list[pl.Callback], **kwargs: Any) -> pl.Trainer:
    """A quiet CPU Trainer of ``steps`` steps; ``kwargs`` (torchturbo's) win over these."""
    settings: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return pl.Trainer(max_steps=steps, callbacks=callbacks, **(settings | kwargs))


def fit_job(
    setup: str, way: str, steps: int, config: TurboConfig | None
) -> tuple[float, list[float]]:
    """One job of ``steps`` optimizer steps: its start and every step's end."""
    module = trained = module_for(setup)
    clock = StepClock()
    callbacks: list[pl.Callback] = [clock]
    kwargs: dict[str, Any] = {}
    if way == "compile":
        trained = torch.compile(module)  # Lightning unwraps it; the weights are module's
    elif way == "torchturbo" and config is not None:
        kwargs = trainer_kwargs(config).kwargs
        callbacks.append(TurboLightningCallback(config))
    data = Data(setup)
    trainer(steps, callbacks, **kwargs).fit(trained, datamodule=data)
    return clock.begin, clock.ends


def recipe_for(setup: str, steps: int) -> Recipe:
    """What the tuner measures: the module and its data, the job's length from the Trainer."""
    return recipe_from_lightning(module_for(setup), Data(setup), trainer=trainer(steps, []))
