"""DDP over bucketed batches of uneven sizes, on 2 CPU processes (tests/test_bucketing_ddp.py).

    python -m torch.distributed.run --standalone --nproc-per-node 2 ddp_bucketing.py OUT_DIR

Trains a tiny token model for one epoch with BucketBatchSampler (world size and rank taken from the
process group), checks the first step's gradient against a single-process reference on the union
of both ranks' batches, and writes OUT_DIR/rank{r}.json for the test to assert on.
"""

from __future__ import annotations

import copy
import faulthandler
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from torchturbo.data.bucketing import BucketBatchSampler
from torchturbo.data.collate import IGNORE_INDEX, pad_collate
from torchturbo.distributed import shutdown

VOCAB = 64


def token_dataset(n: int) -> tuple[list[dict[str, torch.Tensor]], list[int]]:
    """Same samples on every rank (fixed seeds): long-tailed lengths, next-token labels."""
    lengths = np.clip(np.random.default_rng(0).lognormal(np.log(24), 0.7, n).astype(int), 2, 200)
    generator = torch.Generator().manual_seed(0)
    samples = []
    for length in lengths.tolist():
        tokens = torch.randint(0, VOCAB, (length,), generator=generator)
        samples.append({"tokens": tokens, "labels": tokens.roll(-1)})
    return samples, lengths.tolist()


def tiny_model() -> nn.Module:
    return nn.Sequential(
        nn.Embedding(VOCAB, 16), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, VOCAB)
    )


def loss_sum(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of the per-token losses over real tokens, and the number of real tokens."""
    logits = model(batch["tokens"])
    total = F.cross_entropy(
        logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return total, batch["mask"].sum()


def ddp_grads(ddp: DistributedDataParallel, loss: torch.Tensor) -> list[torch.Tensor]:
    ddp.zero_grad(set_to_none=True)
    loss.backward()  # DDP all-reduces and AVERAGES the gradients over ranks here
    return [p.grad.clone() for p in ddp.parameters()]


def reference_grads(model: nn.Module, batches: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    """One process, all batches of the step: mean loss over every real token of the step."""
    model.zero_grad(set_to_none=True)
    sums, counts = zip(*(loss_sum(model, batch) for batch in batches), strict=True)
    (sum(sums) / sum(counts)).backward()
    return [p.grad.clone() for p in model.parameters()]


def max_abs_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def collate_with_indices(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """pad_collate, plus the sample indices so the reference can rebuild the other rank's batch."""
    return pad_collate(samples) | {"index": torch.stack([s["index"] for s in samples])}


def train_one_epoch(rank: int, world: int) -> dict[str, object]:
    """One epoch of DDP training on bucketed batches; what the test checks, as a dict."""
    dataset, lengths = token_dataset(111)  # 17 global batches: one is repeated for 2 ranks
    for index, sample in enumerate(dataset):
        sample["index"] = torch.tensor(index)
    # num_replicas and rank come from the process group.
    sampler = BucketBatchSampler(lengths, max_tokens=256, pad_to_multiple=4, seed=0)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_with_indices)
    torch.manual_seed(0)  # same initial weights on every rank (DDP also broadcasts rank 0's)
    model = tiny_model()
    reference = copy.deepcopy(model)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    result: dict[str, object] = {
        "rank": rank,
        "global_batches": len(sampler.global_batches()),
        "planned_batches": len(sampler),
        "shapes": [],
    }
    for step, batch in enumerate(loader):
        result["shapes"].append(list(batch["tokens"].shape))
        local_tokens = batch["mask"].sum()
        global_tokens = local_tokens.clone()
        dist.all_reduce(global_tokens)  # real tokens of this step on all ranks together
        if step == 0:
            # Negative control: each rank's token mean, then DDP's average over ranks. That
            # weights every rank equally whatever its token count: wrong when the counts differ.
            local_mean_grads = ddp_grads(ddp, loss_sum(ddp, batch)[0] / local_tokens)
        # Correct: each rank contributes sum(loss) / global_tokens, and DDP divides the summed
        # gradients by the world size, so scale by it: the result is sum over every token of
        # the step / global_tokens, the gradient one process computes on the union of batches.
        grads = ddp_grads(ddp, loss_sum(ddp, batch)[0] * world / global_tokens)
        if step == 0:
            all_indices = [torch.zeros(0, dtype=torch.int64)] * world
            dist.all_gather_object(all_indices, batch["index"])
            union = [pad_collate([dataset[int(i)] for i in indices]) for indices in all_indices]
            expected = reference_grads(reference, union)
            result |= {
                "step0_tokens": [int(union_batch["mask"].sum()) for union_batch in union],
                "err_global_norm": max_abs_diff(grads, expected),
                "err_local_mean": max_abs_diff(local_mean_grads, expected),
                "grad_scale": max(float(g.abs().max()) for g in expected),
            }
        optimizer.step()
        result["steps"] = step + 1
    # After the epoch every rank must hold the same weights (DDP kept them in sync).
    checksum = torch.stack([p.detach().double().sum() for p in model.parameters()]).sum()
    checksums = [torch.zeros((), dtype=torch.float64) for _ in range(world)]
    dist.all_gather(checksums, checksum)
    result["weights_in_sync"] = len({float(c) for c in checksums}) == 1
    return result


def main(out_dir: Path) -> None:
    # A crash in a C++ thread (SIGABRT) then prints every Python thread's stack to stderr.
    faulthandler.enable()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # DDP and its reducer hold the process group: they are freed when this call returns, before
    # destroy_process_group, so no gloo object outlives the group into interpreter shutdown.
    result = train_one_epoch(rank, world)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    print(f"rank {rank}: {result['steps']} steps done", flush=True)
    dist.barrier()  # neither rank tears the group down while the other still uses it
    shutdown()  # frees what still holds the group, then destroys it


if __name__ == "__main__":
    main(Path(sys.argv[1]))
