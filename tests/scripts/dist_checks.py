"""Every 2-process check of torchturbo.distributed in one launch (tests/test_distributed.py).

    python -m torch.distributed.run --standalone --nproc-per-node 2 dist_checks.py OUT_DIR

One launch because starting 2 processes costs seconds; each check writes its numbers into
OUT_DIR/rank{r}.json and the test asserts on them.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
import unittest.mock
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from torchturbo.config import AccumulationConfig, DataConfig, DistributedConfig, TurboConfig
from torchturbo.data.collate import IGNORE_INDEX
from torchturbo.distributed import (
    CommStats,
    DDPStrategy,
    build_pipeline,
    current_env,
    init_distributed,
    main_print,
    pipeline,
    shutdown,
    wrap_ddp,
)
from torchturbo.distributed.ddp import parameter_digest
from torchturbo.engine import Turbo
from torchturbo.recipe import Recipe
from torchturbo.resume.files import read_checkpoint
from torchturbo.techniques.framework.proposal import Candidate, StageContext
from torchturbo.trials.trial import Trial, fixed_batches
from torchturbo.tune.search.run import TuneOptions, tune
from torchturbo.tune.search.stages import bucket_stage, comm_hook_stage

#: Micro-batch sizes per rank: unequal within a window and across ranks.
SIZES = {0: [3, 6, 5, 2], 1: [7, 2, 4, 4]}
MICRO_STEPS = 2


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def hook_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4)
    )


def micro_batches(rank: int, features: int = 8, outputs: int = 4) -> list[tuple[torch.Tensor, ...]]:
    """Rank ``rank``'s micro-batches; the same on every process (seeded per rank)."""
    generator = torch.Generator().manual_seed(100 + rank)
    teacher = torch.randn(features, outputs, generator=torch.Generator().manual_seed(7))
    batches = []
    for size in SIZES[rank]:
        x = torch.randn(size, features, generator=generator)
        batches.append((x, torch.tanh(x @ teacher)))
    return batches


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean over samples of the per-sample squared error; the engine weighs it by batch size."""
    x, y = batch
    return ((model(x) - y) ** 2).sum(-1).mean()


def reference_params(world_size: int, max_norm: float | None = None) -> list[torch.Tensor]:
    """One process, SGD on the union of all ranks' micro-batches of each window, global mean
    (gradients clipped to ``max_norm`` when given)."""
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    per_rank = [micro_batches(r) for r in range(world_size)]
    for window in range(len(SIZES[0]) // MICRO_STEPS):
        chosen = [b for r in per_rank for b in r[window * MICRO_STEPS : (window + 1) * MICRO_STEPS]]
        x = torch.cat([b[0] for b in chosen])
        y = torch.cat([b[1] for b in chosen])
        optimizer.zero_grad()
        ((model(x) - y) ** 2).sum(-1).mean().backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def full_params(model: nn.Module) -> list[torch.Tensor]:
    """Parameters as whole tensors (FSDP holds DTensor shards)."""
    return [
        (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for p in model.parameters()
    ]


def max_error(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def differs_across_ranks(tensors: list[torch.Tensor]) -> bool:
    flat = torch.cat([t.flatten() for t in tensors])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return not torch.equal(gathered[0], gathered[1])


class _EveryMicroStep(DDPStrategy):
    """Negative control: all-reduce every micro-step (no ``no_sync``)."""

    def backward_context(self, closing: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class _LocalMeans(DDPStrategy):
    """Negative control: plain DDP averaging each rank's locally normalized gradients (no
    pre-scale, no global count)."""

    def wrap(self, model, optimizer, reference, comm_stats):
        self._ddp = wrap_ddp(model, self.config.distributed, self.device, stats=comm_stats)
        return self._ddp

    def reduce_count(self, total: torch.Tensor) -> torch.Tensor:
        return total


def engine_run(config: TurboConfig, *, strategy: type | None = None) -> dict:
    """Train 2 windows with the engine under 2 processes; ``strategy`` replaces the one
    ``[distributed] strategy`` names (the negative controls above)."""
    rank = dist.get_rank()
    turbo = Turbo(config)
    model = tiny_model()
    stats = CommStats() if config.distributed.strategy == "ddp" else None
    chosen = None if strategy is None else strategy(config, turbo.device, current_env())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    turbo.setup(model, optimizer, comm_stats=stats, strategy=chosen)
    first_grads_differ = None
    for index, batch in enumerate(micro_batches(rank)):
        turbo.step(loss_fn, batch)
        if index == 0:
            grads = [
                p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                for p in turbo.model.parameters()
            ]
            first_grads_differ = differs_across_ranks(grads)
    result = {"params": full_params(turbo.model), "first_grads_differ": first_grads_differ}
    if stats is not None:
        result["reductions"] = stats.reductions
        result["bytes"] = stats.bytes
    return result


def check_accumulation(world_size: int) -> dict:
    reference = reference_params(world_size)
    base = TurboConfig(device="cpu", accumulation=AccumulationConfig(steps=MICRO_STEPS))
    exact = engine_run(base)
    local = engine_run(base, strategy=_LocalMeans)
    every_step = engine_run(base, strategy=_EveryMicroStep)
    fsdp = engine_run(base.replace(distributed__strategy="fsdp"))
    # Clipping at a norm far below the gradients' (~3): it must clip the global gradient.
    clipped = reference_params(world_size, max_norm=0.05)
    clip = base.replace(clipping__max_norm=0.05)
    return {
        "err_clipped_ddp": max_error(engine_run(clip)["params"], clipped),
        "err_clipped_fsdp": max_error(
            engine_run(clip.replace(distributed__strategy="fsdp"))["params"], clipped
        ),
        "clipping_changed_result": max_error(clipped, reference_params(world_size)) > 1e-3,
        "grad_scale": max(float(p.abs().max()) for p in reference),
        "err_exact": max_error(exact["params"], reference),
        "err_local": max_error(local["params"], reference),
        "err_fsdp": max_error(fsdp["params"], reference),
        "reductions_no_sync": exact["reductions"],
        "reductions_every_step": every_step["reductions"],
        "first_grads_differ_no_sync": exact["first_grads_differ"],
        "first_grads_differ_every_step": every_step["first_grads_differ"],
    }


def hook_run(hook: str, steps: int, **overrides: object) -> dict:
    """Plain DDP training loop with a counted hook on a learnable regression."""
    rank = dist.get_rank()
    config = DistributedConfig(comm_hook=hook, **overrides)
    model = hook_model()
    stats = CommStats()
    ddp = wrap_ddp(model, config, torch.device("cpu"), stats=stats)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    generator = torch.Generator().manual_seed(rank)
    teacher = torch.randn(32, 4, generator=torch.Generator().manual_seed(3))
    losses, bytes_per_step = [], []
    for _ in range(steps):
        x = torch.randn(32, 32, generator=generator)
        loss = ((ddp(x) - torch.tanh(x @ teacher)) ** 2).mean()
        stats.reset()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        bytes_per_step.append(stats.bytes)
    return {"losses": losses, "bytes": bytes_per_step, "params": full_params(ddp.module)}


def powersgd_expected_bytes(model: nn.Module, rank: int) -> int:
    """What PowerSGD sends per step: 1-D tensors and matrices not worth compressing whole, and
    the P (n x r) and Q (m x r) factors of the others (torch's min_compression_rate = 2)."""
    numbers = 0
    for p in model.parameters():
        if p.dim() <= 1:
            numbers += p.numel()
            continue
        n, m = p.shape[0], p.numel() // p.shape[0]
        r = min(n, m, rank)
        numbers += (n + m) * r if (n + m) * r * 2 < n * m else n * m
    return numbers * 4


def check_hooks() -> dict:
    plain = hook_run("none", 1)
    fp16 = hook_run("fp16", 1)
    psgd = hook_run("powersgd", 40, powersgd_rank=2, powersgd_warmup=2)
    psgd_fp16 = hook_run("powersgd_fp16", 4, powersgd_rank=2, powersgd_warmup=2)
    try:
        hook_run("bf16", 1)
        bf16_error = None
    except ValueError as err:
        bf16_error = str(err)
    return {
        "bytes_none": plain["bytes"][0],
        "bytes_fp16": fp16["bytes"][0],
        "fp16_param_error": max_error(fp16["params"], plain["params"]),
        "param_scale": max(float(p.abs().max()) for p in plain["params"]),
        "bytes_powersgd_warmup": psgd["bytes"][0],
        "bytes_powersgd": psgd["bytes"][-1],
        "bytes_powersgd_expected": powersgd_expected_bytes(hook_model(), 2),
        "bytes_powersgd_fp16": psgd_fp16["bytes"][-1],
        "powersgd_losses": psgd["losses"],
        "bf16_error": bf16_error,
    }


def check_pipeline(schedule: str, *, timed: bool = False) -> dict:
    torch.manual_seed(0)
    full = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)])
    stage_copy = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)])
    stage_copy.load_state_dict(full.state_dict())
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    y = torch.randn(8, 16, generator=torch.Generator().manual_seed(2))

    def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((output - target) ** 2).mean()

    config = DistributedConfig(pipeline_schedule=schedule, pipeline_microbatches=4)
    # Timed: rank 0's measurement says the last block costs 100x the others, so both ranks cut
    # before it; rank 1 must not measure at all (its patched measurement would raise).
    sample = x if timed else None
    costs = [1.0, 1.0, 1.0, 100.0] if dist.get_rank() == 0 else RuntimeError("rank 1 measured")
    with unittest.mock.patch.object(pipeline, "measured_child_seconds", side_effect=[costs]):
        run = build_pipeline(stage_copy, config, mse, torch.device("cpu"), sample=sample)
    loss = run.step(inputs=x) if run.is_first else run.step(target=y)
    reference_loss = mse(full(x), y)
    reference_loss.backward()
    # A slice of a Sequential keeps the children's names, so parameters match by name.
    full_named = dict(full.named_parameters())
    errors, scale = [], 0.0
    for name, p in run.stage_module.named_parameters():
        ref = full_named[name].grad
        errors.append(float((p.grad - ref).abs().max()))
        scale = max(scale, float(ref.abs().max()))
    return {
        "loss": None if loss is None else float(loss),
        "reference_loss": float(reference_loss.detach()),
        "grad_error": max(errors),
        "grad_scale": scale,
        "stage_children": len(run.stage_module),
    }


def check_flush_guard() -> str | None:
    """Turbo.flush() after a no_sync micro-step must fail loudly, not step on local gradients."""
    turbo = Turbo(TurboConfig(device="cpu", accumulation=AccumulationConfig(steps=2)))
    model = tiny_model()
    turbo.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
    turbo.step(loss_fn, micro_batches(dist.get_rank())[0])
    try:
        turbo.flush()
    except RuntimeError as err:
        return str(err)
    return None


def check_bucketed_epoch() -> dict:
    """An epoch of length-bucketed batches (uneven per rank) through the engine: no hang, equal
    step counts, replicas still identical."""
    generator = torch.Generator().manual_seed(0)
    lengths = [int(n) for n in torch.randint(2, 60, (45,), generator=generator)]
    samples = []
    for length in lengths:
        tokens = torch.randint(0, 32, (length,), generator=generator)
        samples.append({"tokens": tokens, "labels": tokens.roll(-1)})
    config = TurboConfig(
        device="cpu",
        accumulation=AccumulationConfig(steps=2),
        data=DataConfig(batches="buckets", max_tokens=160),
    )
    turbo = Turbo(config)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 32))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = turbo.setup(model, optimizer, samples, lengths=lengths, seed=0)

    def token_loss(model: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        logits = model(batch["tokens"])
        loss = F.cross_entropy(
            logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX
        )
        return loss, batch["mask"].sum()

    steps = sum(1 for batch in loader if turbo.step(token_loss, batch) is not None)
    params = [p.detach() for p in turbo.model.parameters()]
    return {
        "steps": steps,
        "optimizer_steps": turbo.optimizer_steps,
        "replicas_differ": differs_across_ranks(params),
    }


def mlp_recipe(**overrides: object) -> Recipe:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(256, 32, generator=generator)
    targets = (inputs[:, :4].sum(dim=1) > 0).long()
    fields: dict = {
        "name": "mlp",
        "model": hook_model,
        "optimizer": lambda params: torch.optim.SGD(params, lr=0.05),
        "loss_fn": lambda model, batch: F.cross_entropy(model(batch[0]), batch[1]),
        "dataset": torch.utils.data.TensorDataset(inputs, targets),
        "batch_size": 16,
    }
    return Recipe(**(fields | overrides))


def check_tune(rank: int) -> dict:
    """The tuner's DDP stages with ranks that disagree: rank 1's budget is already spent and its
    clock runs a thousand times slow, so on its own it would measure nothing while rank 0
    measures, and its steps (10 ms of sleep each) look 10 us long: it would fit 8 steps in a
    round where rank 0 fits 5, and the ranks' all-reduces would stop pairing up. Rank 0 decides.
    A candidate that fails on every rank is rejected on every rank."""

    def slow_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        time.sleep(0.01)
        return F.cross_entropy(model(batch[0]), batch[1])

    def unbuildable() -> nn.Module:
        raise RuntimeError("no kernel for this op")

    def broken_stage(ctx: StageContext) -> list[Candidate]:
        return [Candidate("broken", ctx.best, 2.0, recipe=mlp_recipe(model=unbuildable))]

    options = TuneOptions(time_budget_s=600.0 if rank == 0 else 1e-9, device="cpu", max_rounds=4)
    clock = time.perf_counter if rank == 0 else (lambda: 1e-3 * time.perf_counter())
    stages = {"broken": broken_stage, "comm_hook": comm_hook_stage, "ddp_buckets": bucket_stage}
    config, result = tune(mlp_recipe(loss_fn=slow_loss), options, stages=stages, clock=clock)
    results = result.to_dict()
    return {
        "config": config.to_dict(),
        "processes": results["processes"],
        "rows": {
            row["name"]: {
                "verdict": row["verdict"],
                "reason": row["reason"],
                "bytes": row.get("comm_bytes_per_step"),
            }
            for row in results["candidates"]
        },
    }


def check_trial_comm() -> dict:
    """Bytes per step with accumulation: one all-reduce serves the window's 4 micro-steps."""
    config = TurboConfig(device="cpu").replace(accumulation__steps=4)
    recipe = mlp_recipe()
    trial = Trial(recipe, config, fixed_batches(recipe, 4))
    for _ in range(16):
        trial.step()
    params = sum(p.numel() for p in trial.model.parameters())
    return {"bytes_per_step": trial.comm_per_step()[0], "params": params}


def check_ranks_kept_in_step() -> dict:
    """Per-rank micro-batch splitting is refused (a budget) or switched off (OOM retries)."""
    budget = Turbo(TurboConfig(device="cpu").replace(reliability__memory_budget_bytes=10**6))
    try:
        budget.setup(tiny_model(), torch.optim.SGD(tiny_model().parameters(), lr=0.1))
        budget_error = None
    except ValueError as err:
        budget_error = str(err)
    plain = Turbo(TurboConfig(device="cpu"))
    model = tiny_model()
    plain.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return {
        "budget_error": budget_error,
        "auto_microbatch": plain.microbatcher.auto,
        "note": plain.applied.get("auto_microbatch"),
        "distributed": plain.applied.get("distributed", "missing"),
    }


def dropout_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 4))


def resume_run(config: TurboConfig, directory: Path, *, load: bool) -> tuple[Turbo, list]:
    """Windows 1-2 then (saving after them) 3-4 of this rank's batches; with ``load``, a fresh
    engine that loads the checkpoint and trains windows 3-4 only."""
    rank = dist.get_rank()
    batches = [b for _ in range(2) for b in micro_batches(rank)]  # 8 micro-batches, 4 windows
    turbo = Turbo(config)
    model = dropout_model()
    turbo.setup(model, torch.optim.Adam(model.parameters(), lr=0.01))
    if load:
        turbo.load(directory)
    for index, batch in enumerate(batches[4:] if load else batches):
        turbo.step(loss_fn, batch)
        if not load and index == 3:
            turbo.save(directory)
    return turbo, full_params(turbo.model)


def check_resume(strategy: str, out_dir: Path) -> dict:
    """A checkpoint of a DDP or FSDP run, resumed by fresh engines, continues bit-exactly:
    every rank's random state travels (the model has dropout), FSDP's shards too."""
    config = TurboConfig(device="cpu").replace(
        accumulation__steps=MICRO_STEPS, distributed__strategy=strategy
    )
    directory = out_dir / f"resume-{strategy}"
    _, expected = resume_run(config, directory, load=False)
    resumed, got = resume_run(config, directory, load=True)
    path = directory / "ckpt-0000000002"
    files = read_checkpoint(path) if dist.get_rank() == 0 else {}
    dist.barrier()
    result = {
        "err": max_error(got, expected),
        "steps": resumed.optimizer_steps,
        "files": sorted(files),
        "shards": sorted(p.name for p in (path / "shards").glob("*")),
    }
    if files:
        result["rng_differs"] = not torch.equal(
            files["rng.pt"]["torch"], files["rng.rank1.pt"]["torch"]
        )
    if strategy == "ddp" and files:
        saved = [files["model.pt"][name] for name, _ in dropout_model().named_parameters()]
        result["replicas"] = files["replicas.json"]["parameter_sha256"]
        result["saved_digest"] = parameter_digest(saved)
    return result


def main() -> None:
    out_dir = Path(sys.argv[1])
    torch.set_num_threads(1)
    env = init_distributed("cpu")
    main_print(f"MAIN_PRINT_MARK from rank {env.rank}")
    result = {"rank": env.rank, "world_size": env.world_size, "backend": env.backend}
    result["accumulation"] = check_accumulation(env.world_size)
    result["hooks"] = check_hooks()
    result["bucketed_epoch"] = check_bucketed_epoch()
    result["flush_error"] = check_flush_guard()
    result["pipeline"] = {s: check_pipeline(s) for s in ("gpipe", "1f1b")}
    result["pipeline"]["1f1b-timed"] = check_pipeline("1f1b", timed=True)
    result["tune"] = check_tune(env.rank)
    result["trial_comm"] = check_trial_comm()
    result["kept_in_step"] = check_ranks_kept_in_step()
    result["resume"] = {name: check_resume(name, out_dir) for name in ("ddp", "fsdp")}
    (out_dir / f"rank{env.rank}.json").write_text(json.dumps(result, indent=1))
    shutdown()


if __name__ == "__main__":
    main()
