"""Shared fixtures: tiny real models, deterministic seeds."""

from __future__ import annotations

import pytest
import torch
from torch import nn


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


class MLP(nn.Module):
    """Sequential blocks with dropout: checkpointing and accumulation tests use it."""

    def __init__(self, width: int = 16, depth: int = 3, dropout: float = 0.0, classes: int = 5):
        super().__init__()
        self.blocks = nn.Sequential(
            *[
                nn.Sequential(nn.Linear(width, width), nn.Dropout(dropout), nn.ReLU())
                for _ in range(depth)
            ]
        )
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


class ConvNet(nn.Module):
    """A small conv classifier for layout and precision tests."""

    def __init__(self, classes: int = 4):
        super().__init__()
        self.features = nn.Sequential(
            nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU()),
            nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU()),
        )
        self.head = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


def classification_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]):
    inputs, targets = batch
    return nn.functional.cross_entropy(model(inputs), targets)
