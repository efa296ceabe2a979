"""The tuner's stages, in the article's order, each proposing candidates against the current best.

A stage is a plain function ``(context) -> list[Candidate] | str``: the candidates to measure, or
the reason the stage does not apply (a Transformer gets no channels_last; a recipe without lengths
gets no dynamic batching). Stages only build configs: measuring and deciding is ``search.py``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from torchturbo.config import TurboConfig
from torchturbo.recipe import Recipe


@dataclass(frozen=True)
class Candidate:
    """One configuration to try. ``batches`` overrides the trial's batches (micro-batching,
    bucketing); ``recipe`` overrides the recipe (tests inject broken techniques this way)."""

    name: str
    config: TurboConfig
    batches: list[Any] | None = None
    recipe: Recipe | None = None


@dataclass
class StageContext:
    """What stages may read: the recipe, the current best, and facts measured so far."""

    recipe: Recipe
    best: TurboConfig
    device: torch.device
    has_convolutions: bool
    best_memory_bytes: int | None
    memory_budget: int | None
    world_size: int = 1
    #: The process group's backend under torchrun ("nccl", "gloo"), None in one process.
    backend: str | None = None
    micro_batches: Callable[[int], list[Any]] | None = None
    bucketed_batches: Callable[[], list[Any]] | None = None
    notes: dict[str, str] = field(default_factory=dict)


def precision_stage(ctx: StageContext) -> list[Candidate] | str:
    # All four on every device, decided by measurement: fp16 without native fp16 units, or TF32
    # without tensor cores, simply measures as no faster and is rejected with the figure.
    return [
        Candidate("tf32", ctx.best.replace(precision__dtype="tf32")),
        Candidate("bf16", ctx.best.replace(precision__dtype="bf16")),
        Candidate("fp16+scaler", ctx.best.replace(precision__dtype="fp16")),
    ]


def memory_format_stage(ctx: StageContext) -> list[Candidate] | str:
    if not ctx.has_convolutions:
        return "the model has no 2-D convolutions: channels_last changes nothing"
    candidates = [Candidate("channels_last", ctx.best.replace(memory_format__channels_last=True))]
    if ctx.device.type == "cuda":
        candidates.append(
            Candidate(
                "channels_last+cudnn_benchmark",
                ctx.best.replace(memory_format__channels_last=True, backend__cudnn_benchmark=True),
            )
        )
    return candidates


def compile_stage(ctx: StageContext) -> list[Candidate] | str:
    modes = ["default"]
    if ctx.device.type == "cuda":
        # CUDA graphs (reduce-overhead) remove launch overhead; max-autotune-no-cudagraphs
        # searches matmul/conv kernels. On CPU neither applies, and each compile costs minutes.
        modes += ["reduce-overhead", "max-autotune-no-cudagraphs"]
    return [Candidate(f"compile:{m}", ctx.best.replace(compile__mode=m)) for m in modes]


def memory_stage(ctx: StageContext) -> list[Candidate] | str:
    if ctx.memory_budget is None:
        return "no memory budget given: checkpointing and micro-batching would only cost time"
    if ctx.best_memory_bytes is not None and ctx.best_memory_bytes <= ctx.memory_budget:
        return (
            f"the current best fits the budget ({ctx.best_memory_bytes / 2**20:.0f} of "
            f"{ctx.memory_budget / 2**20:.0f} MiB): checkpointing would only add recompute"
        )
    candidates = [
        Candidate("checkpointing:full", ctx.best.replace(checkpointing__mode="full")),
        Candidate(
            "checkpointing:every_2nd",
            ctx.best.replace(checkpointing__mode="selective", checkpointing__every_n=2),
        ),
    ]
    if ctx.micro_batches is not None:
        for split in (2, 4, 8):
            if ctx.recipe.batch_size % split == 0:
                candidates.append(
                    Candidate(
                        f"micro-batch {ctx.recipe.batch_size // split} x{split}",
                        ctx.best.replace(accumulation__steps=split),
                        batches=ctx.micro_batches(split),
                    )
                )
    return candidates


def dynamic_batching_stage(ctx: StageContext) -> list[Candidate] | str:
    if ctx.recipe.lengths is None or ctx.bucketed_batches is None:
        return "the recipe gives no per-sample lengths"
    return [
        Candidate(
            "length buckets",
            ctx.best.replace(data__bucketing=True),
            batches=ctx.bucketed_batches(),
        )
    ]


#: PowerSGD's plain all-reduce steps while tuning: torch's minimum, so that the measured steps
#: are compressed ones. A real run may want a longer warm-up (docs/distributed.md).
TUNING_POWERSGD_WARMUP = 2
#: DDP bucket sizes tried around torch's 25 MiB default: fewer, larger all-reduces amortize
#: per-call latency; smaller ones start communicating earlier in backward.
BUCKET_CAPS_MB = (5.0, 100.0)


def _ddp_only(ctx: StageContext) -> str | None:
    if ctx.world_size <= 1:
        return "single process: run under torchrun --nproc-per-node N to tune DDP communication"
    if ctx.best.distributed.strategy != "ddp":
        return "strategy = 'fsdp': FSDP reduce-scatters without DDP's hooks and buckets"
    return None


def comm_hook_stage(ctx: StageContext) -> list[Candidate] | str:
    skip = _ddp_only(ctx)
    if skip:
        return skip
    candidates = [
        Candidate("comm_hook:fp16", ctx.best.replace(distributed__comm_hook="fp16")),
        Candidate(
            "comm_hook:powersgd",
            ctx.best.replace(
                distributed__comm_hook="powersgd",
                distributed__powersgd_warmup=TUNING_POWERSGD_WARMUP,
            ),
        ),
    ]
    if ctx.backend == "nccl":  # torch refuses bf16 all-reduce on gloo
        candidates.append(
            Candidate("comm_hook:bf16", ctx.best.replace(distributed__comm_hook="bf16"))
        )
    return candidates


def bucket_stage(ctx: StageContext) -> list[Candidate] | str:
    skip = _ddp_only(ctx)
    if skip:
        return skip
    current = ctx.best.distributed.bucket_cap_mb
    gradient_mb = sum(p.numel() * p.element_size() for p in ctx.recipe.model().parameters()) / 2**20
    # Caps at least as large as all the gradients bucket them alike: nothing to measure there.
    caps = [
        cap
        for cap in BUCKET_CAPS_MB
        if cap != current and not (cap >= gradient_mb and current >= gradient_mb)
    ]
    if not caps:
        tried = ", ".join(f"{cap:g}" for cap in BUCKET_CAPS_MB)
        return (
            f"the gradients ({gradient_mb:.1f} MiB) fit one bucket at the current {current:g} MiB "
            f"and at every cap tried ({tried} MiB): the bucket size changes nothing here"
        )
    return [
        Candidate(f"bucket_cap_mb:{cap:g}", ctx.best.replace(distributed__bucket_cap_mb=cap))
        for cap in caps
    ]


#: Stage name -> function, in the order the article applies them.
STAGES: dict[str, Callable[[StageContext], list[Candidate] | str]] = {
    "precision": precision_stage,
    "memory_format": memory_format_stage,
    "compile": compile_stage,
    "memory": memory_stage,
    "dynamic_batching": dynamic_batching_stage,
    "comm_hook": comm_hook_stage,
    "ddp_buckets": bucket_stage,
}
