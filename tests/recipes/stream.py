"""A stream recipe: an ``IterableDataset`` of 37 labelled feature rows with their ids, no
``len()``. ``STREAM_LOG`` (a path prefix) makes each rank append the ids it trains to
``<prefix>.rank<R>``: what the torchrun test reads to check that every rank trained its own
share."""

import os

import torch
from torch import nn
from torch.utils.data import IterableDataset

from torchturbo import Recipe

ITEMS = 37


class Rows(IterableDataset):
    def __iter__(self):
        generator = torch.Generator().manual_seed(0)
        for i in range(ITEMS):
            x = torch.randn(8, generator=generator)
            yield {"x": x, "y": (x.sum() > 0).long(), "id": torch.tensor(i)}


def loss_fn(model: nn.Module, batch: dict) -> torch.Tensor:
    if prefix := os.environ.get("STREAM_LOG"):
        with open(f"{prefix}.rank{os.environ.get('RANK', '0')}", "a") as log:
            log.write("".join(f"{int(i)}\n" for i in batch["id"]))
    return nn.functional.cross_entropy(model(batch["x"]), batch["y"])


def recipe() -> Recipe:
    return Recipe(
        name="stream",
        model=lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        loss_fn=loss_fn,
        dataset=Rows(),
        batch_size=4,
    )
