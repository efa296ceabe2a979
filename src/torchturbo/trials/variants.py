"""Configurations measured side by side on one recipe: :func:`compare_configs`.

It builds one :class:`~torchturbo.trials.trial.Trial` per config, times their steps interleaved
through ``measure.timing`` and returns one :class:`VariantResult` row per config: throughput and
its ratio to the baseline's, step time (median and spread), MFU, memory, loss and what could not
be applied. What ``torchturbo bench`` prints and the benchmarks write.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from torchturbo.base.device import model_device, to_device
from torchturbo.base.nhwc import has_2d_convolutions
from torchturbo.config import DataConfig, TurboConfig
from torchturbo.distributed.launch import current_env
from torchturbo.measure.flops import count_step_flops
from torchturbo.measure.peak import mfu, stated_peak
from torchturbo.measure.timing import Timing, measure_interleaved
from torchturbo.recipe import Recipe
from torchturbo.techniques import registry
from torchturbo.trials.trial import Trial, TrialBatches, start_trial


@dataclass(frozen=True)
class VariantResult:
    """One row of a comparison; ``ratio`` is throughput over the baseline's, same run."""

    variant: str
    throughput: float
    unit: str
    ratio: float
    step_ms_median: float
    step_ms_spread: float
    mfu: float | None
    peak_memory_bytes: int | None
    peak_memory_kind: str
    activation_bytes: int | None
    loss_first: float
    loss_last: float
    first_step_s: float
    notes: dict[str, str]
    #: Processes that trained together (torchrun's WORLD_SIZE); throughput counts all of them.
    processes: int = 1
    #: DDP gradient bytes this rank all-reduced per step, and the milliseconds they were in
    #: flight; None when not counted (one process, or FSDP).
    comm_bytes_per_step: int | None = None
    comm_ms_per_step: float | None = None
    #: Share of the token positions computed that were padding (None: no mask in the batches).
    padding: float | None = None
    #: The peak ``mfu`` is stated against (FLOP/s; None where none is known) and its
    #: description: the unit doing the math, measured or datasheet, emulated or not.
    mfu_peak_flops: float | None = None
    mfu_peak: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def model_flops_per_step(recipe: Recipe, batch: Any) -> int:
    """Useful FLOPs of one fp32 eager training step (forward + backward, no recompute), on the
    device the recipe builds its model on."""
    model, _ = recipe.build()
    batch = to_device(batch, model_device(model))

    def step() -> None:
        out = recipe.loss_fn(model, batch)
        (out[0] if isinstance(out, tuple) else out).backward()

    return count_step_flops(step)


def mean_flops_per_step(recipe: Recipe, batches: list[Any]) -> int:
    """FLOPs of an average step over ``batches``: counted on the first, scaled by token positions
    (padding included: it is computed) where batches differ in length. Attention's quadratic
    term is not scaled, so long-sequence batches are undercounted a little."""
    flops = model_flops_per_step(recipe, batches[0])
    positions = [_positions(batch) for batch in batches]
    sizes = [size for size in positions if size is not None]
    if len(sizes) < len(positions):
        return flops
    return round(flops * (sum(sizes) / len(sizes)) / sizes[0])


def _positions(batch: Any) -> int | None:
    mask = _mask(batch)
    return mask.numel() if mask is not None and mask.numel() else None


def _mask(batch: Any) -> torch.Tensor | None:
    """A batch's token mask (``mask``, or Hugging Face's ``attention_mask``), if it has one; a
    packed row (``position_ids`` and no mask) is all real tokens."""
    if not isinstance(batch, Mapping):
        return None
    mask = batch.get("mask", batch.get("attention_mask"))
    if mask is None and isinstance(batch.get("position_ids"), torch.Tensor):
        mask = torch.ones_like(batch["position_ids"], dtype=torch.bool)
    return mask if isinstance(mask, torch.Tensor) else None


def compare_configs(
    recipe: Recipe,
    configs: Mapping[str, TurboConfig],
    *,
    baseline: str,
    warmup: int = 2,
    repeats: int = 5,
    steps_per_repeat: int = 3,
    num_batches: int = 8,
    on_progress: Callable[[str], None] | None = None,
) -> list[VariantResult]:
    """Measure every config side by side (interleaved) and return one row per variant."""
    if baseline not in configs:
        raise ValueError(f"baseline {baseline!r} is not among the variants {list(configs)}")
    say = on_progress or (lambda message: None)
    batches_for = TrialBatches(recipe, num_batches)
    trials: dict[str, Trial] = {}
    first_step: dict[str, float] = {}
    try:
        for number, (name, config) in enumerate(configs.items(), 1):
            say(f"building {name} ({number}/{len(configs)})")
            batches = batches_for(_without_unplannable(recipe, config))
            trials[name], first_step[name] = start_trial(recipe, config, batches)
        say("warming up")
        timings = measure_interleaved(
            {name: trial.step for name, trial in trials.items()},
            device=trials[baseline].turbo.device,
            warmup=warmup,
            repeats=repeats,
            steps_per_repeat=steps_per_repeat,
            on_round=lambda done, total: say(f"timing (interleaved), round {done + 1}/{total}"),
        )
        say("counting FLOPs and memory")
        flops = {
            id(batches): mean_flops_per_step(recipe, batches)
            for batches in {id(t.batches): t.batches for t in trials.values()}.values()
        }
        return _rows(recipe, trials, timings, first_step, flops, baseline)
    finally:
        for trial in trials.values():
            trial.close()


def _without_unplannable(recipe: Recipe, config: TurboConfig) -> TurboConfig:
    """``config``, less the dynamic batching a recipe without lengths cannot plan (its trial
    trains on the recipe's own batches, and the row's notes say why)."""
    if recipe.lengths is None and "lengths" in registry.plan_needs(config):
        return config.replace(data__batches="rows", data__max_tokens=None, data__max_shapes=None)
    return config


def padding_of(batches: list[Any]) -> float | None:
    """Padded share of the token positions in ``batches``, read from their ``mask`` or
    ``attention_mask``; None when they carry neither."""
    masks = [m for m in (_mask(batch) for batch in batches) if m is not None]
    if not masks:
        return None
    total = sum(m.numel() for m in masks)
    return 1 - sum(int(m.bool().sum()) for m in masks) / total if total else None


def _notes(recipe: Recipe, trial: Trial) -> dict[str, str]:
    """What the engine could not apply, and the [data] settings bench does not exercise."""
    notes = {k: v for k, v in trial.turbo.applied.items() if v is not None}
    data = trial.config.data
    loader = {f.name: getattr(data, f.name) for f in dataclasses.fields(data)}
    changed = [
        k for k, v in loader.items() if k in _LOADER_FIELDS and v != getattr(DataConfig(), k)
    ]
    if changed:
        settings = ", ".join(f"{k}={loader[k]}" for k in changed)
        notes["loader settings"] = (
            f"{settings}: bench trains on pre-collated batches; torchturbo doctor --config "
            "measures the loader"
        )
    if recipe.lengths is None and "lengths" in registry.plan_needs(trial.config):
        notes["batches"] = f"{data.batches}: the recipe gives no per-sample lengths to plan them by"
    if trial.position and not trial.turbo.optimizer_steps:
        notes["accumulation"] = (
            f"no optimizer step in {trial.position} micro-batches ([accumulation] steps = "
            f"{trial.config.accumulation.steps}): the loss column shows no training; "
            "give bench more --steps to see one"
        )
    return notes


#: The [data] fields that configure the DataLoader rather than the batches.
_LOADER_FIELDS = ("num_workers", "pin_memory", "persistent_workers", "prefetch_factor")


def _rows(
    recipe: Recipe,
    trials: Mapping[str, Trial],
    timings: Mapping[str, Timing],
    first_step: Mapping[str, float],
    flops: Mapping[int, int],
    baseline: str,
) -> list[VariantResult]:
    throughput = {n: t.mean_count() / timings[n].median for n, t in trials.items()}
    rows = []
    for name, trial in trials.items():
        device = trial.turbo.device
        fmt, why = row_format(trial)
        peak = stated_peak(device, fmt)
        curve = trial.loss_curve()  # before the memory probe, so every row ends on one step
        memory_bytes, memory_kind = trial.memory_footprint()
        comm = trial.comm_per_step()
        rows.append(
            VariantResult(
                variant=name,
                throughput=throughput[name],
                unit=f"{recipe.count_unit}/s",
                ratio=throughput[name] / throughput[baseline],
                step_ms_median=timings[name].median * 1e3,
                step_ms_spread=timings[name].spread,
                mfu=None
                if peak.flops is None
                else mfu(flops[id(trial.batches)], timings[name].median, peak.flops),
                peak_memory_bytes=memory_bytes,
                peak_memory_kind=memory_kind,
                activation_bytes=trial.activation_bytes(),
                loss_first=curve[0],
                loss_last=curve[-1],
                first_step_s=first_step[name],
                notes=_notes(recipe, trial),
                padding=padding_of(trial.batches),
                processes=current_env().world_size,
                comm_bytes_per_step=None if comm is None else comm[0],
                comm_ms_per_step=None if comm is None or comm[1] is None else comm[1] * 1e3,
                mfu_peak_flops=peak.flops,
                mfu_peak=peak.describe() + (f" ({why})" if why else ""),
            )
        )
    return rows


def row_format(trial: Trial) -> tuple[str, str]:
    """The number format of the unit doing most of a trial's maths, and why where that is not
    its precision: fp8 where float8 applied; tf32 for an fp32 model with convolutions on CUDA,
    where cuDNN runs them as TF32 by default (against the fp32 CUDA-core peak such a row could
    show far above 100%)."""
    if trial.turbo.applied.get("float8", "not requested") is None:
        return "fp8", "its Linear layers run in fp8"
    dtype = trial.config.precision.dtype
    tf32_convolutions = trial.turbo.device.type == "cuda" and torch.backends.cudnn.allow_tf32
    if dtype == "fp32" and tf32_convolutions and has_2d_convolutions(trial.model):
        return "tf32", "cuDNN runs fp32 convolutions as TF32: torch.backends.cudnn.allow_tf32"
    return dtype, ""
