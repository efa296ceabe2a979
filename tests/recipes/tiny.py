"""A recipe as a user writes one: a tiny conv classifier on learnable synthetic data."""

import torch
from torch import nn

from torchturbo import Recipe


class TinyConv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU()),
            nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU()),
        )
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).mean(dim=(2, 3)))


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    images, labels = batch
    return nn.functional.cross_entropy(model(images), labels)


def recipe() -> Recipe:
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(64, 3, 16, 16, generator=generator)
    labels = (images[:, 0].mean(dim=(1, 2)) > 0).long()
    return Recipe(
        name="tiny",
        model=TinyConv,
        optimizer=lambda params: torch.optim.Adam(params, lr=1e-2),
        loss_fn=loss_fn,
        dataset=torch.utils.data.TensorDataset(images, labels),
        batch_size=8,
    )


def not_a_recipe() -> int:
    return 3
