"""The tuner's stages, in the article's order, each proposing candidates against the current best.

A stage is a plain function ``(context) -> list[Candidate] | str`` (``proposal.py``): the candidates
to measure, or the reason the whole stage does not apply. A candidate carries the gain it is
expected to bring (``techniques.framework.levers``, from facts measured in seconds), which orders
the measuring, or the fact that makes it not applicable here (bf16 without bf16 units, channels_last
without convolutions), which spares training it at all. The technique stages are declared by the
techniques themselves (``Technique.stage``, gathered by ``techniques/registry.py``); this module
adds the memory planner's, which combines several techniques, and the strategy's: DDP communication,
which is the distributed strategy's, not a model's. Stages only build configs: measuring and
deciding is ``run``'s and ``decide``'s, and the report lists the stages by rank whatever order
they were measured in. The list is read from the registry when asked (:func:`tuner_stages`).
"""

from __future__ import annotations

from collections.abc import Callable

from torchturbo.techniques import registry
from torchturbo.techniques.framework.facts import Facts
from torchturbo.techniques.framework.levers import SMALL_GAIN, Expectation
from torchturbo.techniques.framework.proposal import Candidate, StageContext, candidate
from torchturbo.techniques.framework.spec import Stage
from torchturbo.tune.memory.plan import memory_plan_stage

#: The formats the precision stage tries (the CLI says up front which of them are emulated).
PRECISION_FORMATS = ("tf32", "bf16", "fp16")


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
        candidate(
            "comm_hook:fp16",
            ctx.best.replace(distributed__comm_hook="fp16"),
            comm_hook_gain(ctx.facts, 0.5, "fp16"),
        ),
        candidate(
            "comm_hook:powersgd",
            ctx.best.replace(
                distributed__comm_hook="powersgd",
                distributed__powersgd_warmup=TUNING_POWERSGD_WARMUP,
            ),
            comm_hook_gain(ctx.facts, 0.1, "PowerSGD"),
        ),
    ]
    if ctx.backend == "nccl":  # torch refuses bf16 all-reduce on gloo
        candidates.append(
            candidate(
                "comm_hook:bf16",
                ctx.best.replace(distributed__comm_hook="bf16"),
                comm_hook_gain(ctx.facts, 0.5, "bf16"),
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
    expectation = bucket_size_gain(ctx.facts)
    return [
        candidate(
            f"bucket_cap_mb:{cap:g}", ctx.best.replace(distributed__bucket_cap_mb=cap), expectation
        )
        for cap in caps
    ]


def comm_hook_gain(facts: Facts, byte_ratio: float, name: str) -> Expectation:
    """A compressing DDP hook: the communication share shrinks by ``byte_ratio``."""
    if facts.comm_share is None:
        return Expectation(None, "single process: no gradient communication to compress")
    saved = facts.comm_share * (1 - byte_ratio)
    gain = 1 / (1 - min(saved, 0.9))
    return Expectation(
        gain,
        f"communication is {facts.comm_share:.0%} of the step; {name} sends "
        f"{byte_ratio:.0%} of the bytes",
    )


def bucket_size_gain(facts: Facts) -> Expectation:
    if facts.comm_share is None:
        return Expectation(None, "single process: no DDP buckets")
    return Expectation(SMALL_GAIN, f"communication is {facts.comm_share:.0%} of the step")


#: The strategy's stages: after every technique's (ranks 80 and 90).
STRATEGY_STAGES = (Stage("comm_hook", 80, comm_hook_stage), Stage("ddp_buckets", 90, bucket_stage))
#: The memory planner: it combines several techniques' knobs (checkpointing, accumulation,
#: activation compression), so it is the tuner's stage rather than one technique's.
PLANNER_STAGES = (Stage("memory", 60, memory_plan_stage, fits_memory=True),)


def _all() -> list[Stage]:
    """Every stage by rank: the registered techniques' as the registry has them now (a
    technique registered later is raced too), the planner's and the strategy's."""
    return sorted([*registry.stages(), *PLANNER_STAGES, *STRATEGY_STAGES], key=lambda s: s.rank)


def tuner_stages() -> dict[str, Callable[[StageContext], list[Candidate] | str]]:
    """Stage name -> function, by rank: the techniques' stages, then the strategy's."""
    return {stage.name: stage.propose for stage in _all()}


def memory_stages() -> frozenset[str]:
    """The stages whose candidates fit a memory budget (``Stage.fits_memory``)."""
    return frozenset(stage.name for stage in _all() if stage.fits_memory)


def levers() -> dict[str, str]:
    """Stage name -> the lever it pulls: stages of one lever propose alternatives
    (``Stage.lever``)."""
    return {stage.name: stage.lever or stage.name for stage in _all()}
