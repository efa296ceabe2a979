"""The tiny recipe (tiny.py), announcing each micro-step on stdout: a marker that signal tests
wait for before they send a signal (a busy machine makes fixed sleeps unreliable). Each step also
waits ``MARKED_STEP_S`` seconds (default 0.02) so that a run lasts long enough to interrupt;
``MARKED_SIGTERMS=N:K`` sends this process K SIGTERMs during micro-step N."""

import os
import signal
import time

import torch
from torch import nn

from torchturbo import Recipe

_calls = [0]


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
    _calls[0] += 1
    print(
        f"micro-step {_calls[0]} rank {os.environ.get('RANK', '0')} pid {os.getpid()}", flush=True
    )
    at, _, times = os.environ.get("MARKED_SIGTERMS", "0:0").partition(":")
    if _calls[0] == int(at):
        for _ in range(int(times)):
            os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(float(os.environ.get("MARKED_STEP_S", "0.02")))
    images, labels = batch
    return nn.functional.cross_entropy(model(images), labels)


def recipe() -> Recipe:
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(64, 3, 16, 16, generator=generator)
    labels = (images[:, 0].mean(dim=(1, 2)) > 0).long()
    return Recipe(
        name="marked",
        model=TinyConv,
        optimizer=lambda params: torch.optim.Adam(params, lr=1e-2),
        loss_fn=loss_fn,
        dataset=torch.utils.data.TensorDataset(images, labels),
        batch_size=8,
    )
