"""Recipes whose data an operator changes between runs, for benchmarks/faults_data.py.

``FAULTS_SAMPLES`` sets how many token rows ``rows`` holds (24 by default; a dataset grown or
shrunk between a run and its resume); ``FAULTS_FLOAT64`` makes sample 17 of ``float64_sample``
float64 among float32 ones (unset: the fixed data); ``stream`` is an IterableDataset of 37 rows.
Each step waits ``FAULTS_STEP_S`` seconds (default 0) so that a run lasts long enough to meet a
fault.
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn
from torch.utils.data import IterableDataset

from torchturbo import Recipe

STEP_S = float(os.environ.get("FAULTS_STEP_S", "0"))


class Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(32, 16)
        self.head = nn.Linear(16, 2)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(input_ids).mean(dim=1))


def _token_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    time.sleep(STEP_S)
    return nn.functional.cross_entropy(model(batch["input_ids"]), batch["label"])


def rows() -> Recipe:
    count = int(os.environ.get("FAULTS_SAMPLES", "24"))
    lengths = [3 + (i * 5) % 7 for i in range(count)]
    samples = [{"input_ids": torch.arange(n) % 32, "label": torch.tensor(n % 2)} for n in lengths]
    return Recipe(
        name="rows",
        model=Bag,
        optimizer=lambda params: torch.optim.Adam(params, lr=1e-2),
        loss_fn=_token_loss,
        dataset=samples,
        batch_size=4,
        lengths=lengths,
        seed=3,
    )


def float64_sample() -> Recipe:
    generator = torch.Generator().manual_seed(0)
    samples = []
    for i in range(24):
        x = torch.randn(8, generator=generator)
        odd = i == 17 and os.environ.get("FAULTS_FLOAT64")
        samples.append((x.double() if odd else x, (x.sum() > 0).long()))
    return Recipe(
        name="float64",
        model=lambda: nn.Linear(8, 2),
        optimizer=lambda params: torch.optim.Adam(params, lr=1e-2),
        loss_fn=lambda model, batch: nn.functional.cross_entropy(model(batch[0]), batch[1]),
        dataset=samples,
        batch_size=4,
        seed=3,
    )


class Rows(IterableDataset):
    def __iter__(self):
        generator = torch.Generator().manual_seed(0)
        for _ in range(37):
            x = torch.randn(8, generator=generator)
            yield x, (x.sum() > 0).long()


def stream() -> Recipe:
    return Recipe(
        name="stream",
        model=lambda: nn.Linear(8, 2),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        loss_fn=lambda model, batch: nn.functional.cross_entropy(model(batch[0]), batch[1]),
        dataset=Rows(),
        batch_size=4,
    )
