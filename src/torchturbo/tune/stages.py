"""The tuner's stages, in the article's order, each proposing candidates against the current best.

A stage is a plain function ``(context) -> list[Candidate] | str``: the candidates to measure, or
the reason the whole stage does not apply. A candidate carries the gain it is expected to bring
(``torchturbo.levers``, from facts measured in seconds), which orders the measuring, or the fact
that makes it not applicable here (bf16 without bf16 units, channels_last without convolutions),
which spares training it at all. Stages only build configs: measuring and deciding is
``search.py``'s, and the report lists the stages in this order whatever order they were measured in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from torchturbo import levers
from torchturbo.config import TurboConfig
from torchturbo.facts import Facts
from torchturbo.recipe import Recipe
from torchturbo.techniques.float8 import ALIGNMENT, convertible_linears, float8_unavailable
from torchturbo.techniques.optimizer import IMPLEMENTATIONS, implementation_unsupported


@dataclass(frozen=True)
class Candidate:
    """One configuration to try.

    ``expected_gain`` (None: no prior) orders the work; ``not_applicable`` says why it cannot
    help here, and then it is reported, not trained. ``batching`` names batches other than the
    current best's: "buckets" (length buckets) or "split:N" (each batch cut into N micro-batches).
    ``batches`` and ``recipe`` override the batches and the recipe outright (tests inject
    techniques this way).
    """

    name: str
    config: TurboConfig
    expected_gain: float | None = None
    not_applicable: str | None = None
    evidence: str = ""
    batching: str | None = None
    batches: list[Any] | None = None
    recipe: Recipe | None = None


@dataclass
class StageContext:
    """What stages may read: the recipe, the current best, and facts measured so far."""

    recipe: Recipe
    best: TurboConfig
    device: torch.device
    facts: Facts
    best_memory_bytes: int | None
    memory_budget: int | None
    world_size: int = 1
    #: The process group's backend under torchrun ("nccl", "gloo"), None in one process.
    backend: str | None = None
    #: The current best's batch size per step (after any micro-batching).
    batch_size: int | None = None
    notes: dict[str, str] = field(default_factory=dict)

    @property
    def has_convolutions(self) -> bool:
        return self.facts.has_convolutions


def _candidate(
    name: str, config: TurboConfig, expectation: levers.Expectation, **kw: Any
) -> Candidate:
    if expectation.applicable:
        return Candidate(name, config, expectation.gain, evidence=expectation.evidence, **kw)
    return Candidate(name, config, not_applicable=expectation.evidence, **kw)


#: The formats the precision stage tries (the CLI says up front which of them are emulated).
PRECISION_FORMATS = ("tf32", "bf16", "fp16")


def precision_stage(ctx: StageContext) -> list[Candidate] | str:
    # A precision whose matrix products are no faster than fp32's here (TF32 on a CPU, bf16 or
    # fp16 without native units) is decided by that micro-benchmark, not by training.
    return [
        _candidate(
            "bf16",
            ctx.best.replace(precision__dtype="bf16"),
            levers.precision(ctx.facts, "bf16"),
        ),
        _candidate(
            "fp16+scaler",
            ctx.best.replace(precision__dtype="fp16"),
            levers.precision(ctx.facts, "fp16"),
        ),
        _candidate(
            "tf32",
            ctx.best.replace(precision__dtype="tf32"),
            levers.precision(ctx.facts, "tf32"),
        ),
    ]


def float8_stage(ctx: StageContext) -> list[Candidate] | str:
    # On top of the best precision (bf16 where it won): Linear matmuls in fp8, judged by the
    # same speed and loss-parity rules as bf16.
    # A returned string is the stage's "not applicable" fact, reported without training.
    unavailable = float8_unavailable(ctx.device)
    if unavailable:
        return unavailable
    if not convertible_linears(ctx.recipe.model()):
        return f"no nn.Linear has both dimensions divisible by {ALIGNMENT}, as fp8 matmuls need"
    return [
        _candidate("float8", ctx.best.replace(precision__float8=True), levers.float8(ctx.facts))
    ]


def memory_format_stage(ctx: StageContext) -> list[Candidate] | str:
    expectation = levers.channels_last(ctx.facts)
    layout = ctx.best.replace(memory_format__channels_last=True)
    candidates = [_candidate("channels_last", layout, expectation)]
    if ctx.device.type == "cuda" and expectation.applicable:
        # cuDNN autotuning re-runs for every new input shape: only where shapes are fixed.
        tuned = layout.replace(backend__cudnn_benchmark=True)
        if ctx.facts.shapes_vary:
            why = "batch shapes vary: cuDNN would autotune again for every new shape"
            candidates.append(Candidate("channels_last+cudnn_benchmark", tuned, not_applicable=why))
        else:
            candidates.append(
                Candidate(
                    "channels_last+cudnn_benchmark",
                    tuned,
                    expectation.gain,
                    evidence=expectation.evidence,
                )
            )
    return candidates


def compile_stage(ctx: StageContext) -> list[Candidate] | str:
    modes = ["default"]
    if ctx.device.type == "cuda":
        # CUDA graphs (reduce-overhead) remove launch overhead; max-autotune-no-cudagraphs
        # searches matmul/conv kernels. On CPU neither applies, and each compile costs minutes.
        modes += ["reduce-overhead", "max-autotune-no-cudagraphs"]
    expectation = levers.compile_(ctx.facts)
    # Varying batch shapes (text lengths) compile once with dynamic shapes: left to torch, a
    # new length recompiles (specialised, then dynamic), a one-time cost paid again in the job.
    dynamic = True if ctx.facts.shapes_vary else None
    return [
        _candidate(
            f"compile:{m}", ctx.best.replace(compile__mode=m, compile__dynamic=dynamic), expectation
        )
        for m in modes
    ]


def optimizer_stage(ctx: StageContext) -> list[Candidate] | str:
    # The user's optimizer rebuilt with foreach/fused where its class and the device allow it.
    _, optimizer = ctx.recipe.build()
    current = ctx.best.optimizer.implementation
    candidates, skipped = [], []
    for implementation in IMPLEMENTATIONS:
        if implementation == current:
            continue
        reason = implementation_unsupported(optimizer, implementation, ctx.device)
        if implementation == "foreach" and ctx.device.type == "cuda" and current == "as_built":
            # Left at foreach=None, torch already runs foreach when all parameters are on CUDA.
            reason = "torch already uses foreach on CUDA"
        if reason:
            skipped.append(f"{implementation}: {reason}")
        else:
            config = ctx.best.replace(optimizer__implementation=implementation)
            expectation = levers.optimizer(ctx.facts, implementation)
            candidates.append(_candidate(f"optimizer:{implementation}", config, expectation))
    return candidates or "; ".join(skipped)


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
    batch_size = ctx.batch_size or ctx.recipe.batch_size
    for split in (2, 4, 8):
        if batch_size % split == 0:
            candidates.append(
                Candidate(
                    f"micro-batch {batch_size // split} x{split}",
                    ctx.best.replace(accumulation__steps=split),
                    batching=f"split:{split}",
                )
            )
    return candidates


def dynamic_batching_stage(ctx: StageContext) -> list[Candidate] | str:
    if ctx.best.data.bucketing:
        return "the current best already trains on length buckets"
    return [
        _candidate(
            "length buckets",
            ctx.best.replace(data__bucketing=True),
            levers.length_buckets(ctx.facts),
            batching="buckets",
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
        _candidate(
            "comm_hook:fp16",
            ctx.best.replace(distributed__comm_hook="fp16"),
            levers.comm_hook(ctx.facts, 0.5, "fp16"),
        ),
        _candidate(
            "comm_hook:powersgd",
            ctx.best.replace(
                distributed__comm_hook="powersgd",
                distributed__powersgd_warmup=TUNING_POWERSGD_WARMUP,
            ),
            levers.comm_hook(ctx.facts, 0.1, "PowerSGD"),
        ),
    ]
    if ctx.backend == "nccl":  # torch refuses bf16 all-reduce on gloo
        candidates.append(
            _candidate(
                "comm_hook:bf16",
                ctx.best.replace(distributed__comm_hook="bf16"),
                levers.comm_hook(ctx.facts, 0.5, "bf16"),
            )
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
    expectation = levers.bucket_size(ctx.facts)
    return [
        _candidate(
            f"bucket_cap_mb:{cap:g}", ctx.best.replace(distributed__bucket_cap_mb=cap), expectation
        )
        for cap in caps
    ]


#: Stage name -> function, in the order the article applies them.
STAGES: dict[str, Callable[[StageContext], list[Candidate] | str]] = {
    "precision": precision_stage,
    "float8": float8_stage,
    "memory_format": memory_format_stage,
    "compile": compile_stage,
    "optimizer": optimizer_stage,
    "memory": memory_stage,
    "dynamic_batching": dynamic_batching_stage,
    "comm_hook": comm_hook_stage,
    "ddp_buckets": bucket_stage,
}
