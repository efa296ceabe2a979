"""One process training the ``text`` workload on the union of two ranks' batches, for
tests/test_distributed.py (run in its own process: the training's freed memory stays with it).

    python union_reference.py OUT.pt STEPS

Each rank's batches are what ``Turbo.setup`` gives it under torchrun (a DistributedSampler seeded
by the recipe). Each half of the union runs its forward with that rank's random stream, so
dropout draws the masks the rank drew. ``OUT.pt`` holds the parameters after ``STEPS`` steps on
the mean over all tokens of the union (``union``) and, as the negative control, on the mean of
the two ranks' means (``mean_of_means``), and the parameters' names in order (``parameters``).
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.utils.data import BatchSampler, DistributedSampler

from torchturbo.recipe import Recipe
from torchturbo.workloads import get_workload


def train_on_union(recipe: Recipe, steps: int, *, weigh_by_count: bool) -> nn.Module:
    model, optimizer = recipe.build()
    streams = [torch.get_rng_state()] * 2  # every rank starts where the seeded build left it
    collate = recipe.collate_fn()
    per_rank = []
    for rank in range(2):
        sampler = DistributedSampler(recipe.dataset, 2, rank, shuffle=True, seed=recipe.seed)
        sampler.set_epoch(0)
        per_rank.append(list(BatchSampler(sampler, recipe.batch_size, drop_last=False)))
    for step in range(steps):
        terms = []
        for rank in range(2):
            torch.set_rng_state(streams[rank])
            batch = collate([recipe.dataset[i] for i in per_rank[rank][step]])
            terms.append(recipe.loss_fn(model, batch))
            streams[rank] = torch.get_rng_state()
        if weigh_by_count:
            loss = sum(mean * count for mean, count in terms) / sum(c for _, c in terms)
        else:
            loss = sum(mean for mean, _ in terms) / 2
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model


def main() -> None:
    out, steps = sys.argv[1], int(sys.argv[2])
    recipe = get_workload("text")
    union = train_on_union(recipe, steps, weigh_by_count=True)
    control = train_on_union(recipe, steps, weigh_by_count=False)
    torch.save(
        {
            "parameters": [name for name, _ in union.named_parameters()],
            "union": union.state_dict(),
            "mean_of_means": control.state_dict(),
        },
        out,
    )


if __name__ == "__main__":
    main()
