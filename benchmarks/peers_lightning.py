"""The CNN half of ``benchmarks/peers.py``: a hand-written ResNet trained by Lightning three ways.

The model and data are the ``vision`` workload's (a torchvision-shaped ResNet of BasicBlocks at
widths 32/64/128 on 48 px synthetic class patterns, batch 16, AdamW), wrapped in a LightningModule
and a LightningDataModule as a user would write them. The three ways:

1. ``defaults``: ``L.Trainer(max_steps=...)``: fp32;
2. ``recommended``: the speed settings of Lightning's documentation as the hardware allows:
   ``precision="bf16-mixed"`` with native bf16, ``torch.compile(module)`` with ``--compile``;
3. ``torchturbo``: ``tune`` on ``recipe_from_lightning(module, datamodule)``, then
   ``trainer_kwargs(config)`` and ``TurboLightningCallback(config)``.

Each way fits one epoch (the same shuffled order for all); throughput is samples per second of
the epoch, and the held-out loss the mean cross-entropy of the trained model (eval mode) on
images it did not train on.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from torchturbo.config import TurboConfig
from torchturbo.integrations.lightning import (
    TurboLightningCallback,
    recipe_from_lightning,
    trainer_kwargs,
)
from torchturbo.measure.timing import sync
from torchturbo.workloads.vision import DEFAULT_BATCH_SIZE, ResNet, make_images

CLASSES = 10
IMAGE_SIZE = 48


class VisionModule(pl.LightningModule):
    """A user's LightningModule around the hand-written ResNet."""

    def __init__(self, lr: float) -> None:
        super().__init__()
        torch.manual_seed(0)  # every way starts from the same weights
        self.net = ResNet(CLASSES, "batch")
        self.lr = lr

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(self(images), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class VisionData(pl.LightningDataModule):
    """Training images in a shuffled DataLoader of batch 16, and held-out images."""

    def __init__(self, samples: int, held_out: int) -> None:
        super().__init__()
        images, labels = make_images(samples + held_out, IMAGE_SIZE, CLASSES, seed=0)
        self.train = TensorDataset(images[:samples], labels[:samples])
        self.held_out = (images[samples:], labels[samples:])

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        return DataLoader(
            self.train, batch_size=DEFAULT_BATCH_SIZE, shuffle=True, generator=generator
        )


class StepClock(pl.Callback):
    """The time at the end of every training batch (one optimizer step: no accumulation)."""

    def __init__(self) -> None:
        self.ends: list[float] = []
        self.begin = 0.0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.begin = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        sync(trainer.strategy.root_device)
        self.ends.append(time.perf_counter())


def recommended(args: argparse.Namespace, bf16: bool) -> tuple[dict[str, Any], list[str]]:
    """Lightning's documented speed settings that this hardware (``bf16``: native bf16) and
    ``--compile`` allow, and why any was left out."""
    kwargs: dict[str, Any] = {}
    left_out = []
    if bf16:
        kwargs["precision"] = "bf16-mixed"
    else:
        left_out.append("bf16-mixed: no native bf16 on this device")
    if not args.compile:
        left_out.append("torch.compile: not affordable here (pass --compile to include it)")
    return kwargs, left_out


def recipe(args: argparse.Namespace, data: VisionData) -> Any:
    """What the tuner measures: the LightningModule and its data, through the integration."""
    return recipe_from_lightning(VisionModule(args.lr), data)


def run_way(
    way: str,
    args: argparse.Namespace,
    data: VisionData,
    config: TurboConfig,
    recommended_kwargs: dict[str, Any],
) -> dict[str, Any]:
    """Fit one way for one epoch from the same weights; samples/s and held-out loss."""
    module = trained = VisionModule(args.lr)
    clock = StepClock()
    kwargs: dict[str, Any] = {
        "max_epochs": 1,
        "accelerator": "gpu" if args.device == "cuda" else "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    callbacks: list[pl.Callback] = [clock]
    if way == "recommended":
        kwargs |= recommended_kwargs
        if args.compile:
            trained = torch.compile(module)  # Lightning unwraps it; the weights are module's
    elif way == "torchturbo":
        kwargs |= trainer_kwargs(config).kwargs
        callbacks.append(TurboLightningCallback(config))
    pl.Trainer(callbacks=callbacks, **kwargs).fit(trained, datamodule=data)
    seconds = clock.ends[-1] - clock.begin
    return {
        "throughput": len(data.train) / seconds,
        "epoch_s": seconds,
        "steps": len(clock.ends),
        "first_steps_s": clock.ends[args.warmup - 1] - clock.begin,
        "held_out_loss": held_out_loss(module, data, args.device),
    }


@torch.no_grad()
def held_out_loss(module: torch.nn.Module, data: VisionData, device: str) -> float:
    module.eval()
    images, labels = data.held_out
    logits = module(images.to(device)).float()
    return float(F.cross_entropy(logits, labels.to(device)))
