"""``diagnose``: the order of the doctor's work, from static inspection to the 15 judgments.

1. static: a fresh model on the device reads its Conv→BN pairs, alignment, dtypes, blocks, FLOPs
   and activation bytes over one forward on a sample batch; Conv→BN folding is timed on it in
   eval mode before it is freed;
2. profile: a fresh model trained through ``Turbo`` on the loader (breakdown, operators, peak
   memory, batch shapes, optional trace);
3. quick gains: the config against its bf16 / channels_last variants, interleaved;
4. the loader, dataset and batch shapes are read, and the items judged (``checklist``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from torchturbo.base.device import to_device
from torchturbo.config import CompileConfig, Precision, PrecisionConfig, TurboConfig
from torchturbo.data.bucketing import padding_fractions
from torchturbo.data.loader import build_loader
from torchturbo.distributed.launch import current_env
from torchturbo.doctor.checklist import judge
from torchturbo.doctor.data_facts import (
    dataset_facts,
    loader_facts,
    varying_shapes,
)
from torchturbo.doctor.diagnosis import Diagnosis
from torchturbo.doctor.findings import Findings
from torchturbo.doctor.gains import Gain, fold_gain, measure_variants
from torchturbo.doctor.levers import with_measurements
from torchturbo.doctor.model_facts import ModelFacts, inspect_model
from torchturbo.doctor.profiling import profile_training
from torchturbo.engine import resolve_device
from torchturbo.measure.footprint import MemoryEstimate
from torchturbo.recipe import Recipe
from torchturbo.reliability.guard import call_loss_fn
from torchturbo.techniques import registry
from torchturbo.techniques.framework.facts import Facts, gather
from torchturbo.trials.memory_estimate import estimate_recipe_memory
from torchturbo.trials.trial import fixed_batches

#: Batches the quick comparisons cycle through.
_SAMPLE_BATCHES = 2


def diagnose(
    recipe: Recipe,
    *,
    config: TurboConfig | None = None,
    loader: DataLoader | None = None,
    device: str | None = None,
    trace_dir: Path | None = None,
    profile_steps: int = 5,
    on_progress: Callable[[str], None] | None = None,
) -> Diagnosis:
    """Run the article's checklist on ``recipe``: inspect, profile, measure, judge.

    ``config`` is the configuration to diagnose (default: the fp32 baseline); ``loader`` the
    loader to judge (default: one built from ``config.data`` over the recipe's dataset);
    ``device`` overrides ``config.device``; with ``trace_dir`` a Chrome/Perfetto trace of the
    profiled steps is written there. ``profile_steps`` steps are timed for the breakdown and as
    many profiled, after warm-up. ``on_progress`` is told what runs now (for a status line).
    Process-wide switches the engine sets (cudnn.benchmark) are restored afterwards.
    """
    if isinstance(profile_steps, bool) or not isinstance(profile_steps, int) or profile_steps < 1:
        raise ValueError(f"profile_steps={profile_steps!r} is invalid: expected an int >= 1")
    begin = time.perf_counter()
    say = on_progress or (lambda message: None)
    config = config or TurboConfig()
    if device is not None:
        config = config.replace(device=device)
    run_device = resolve_device(config.device)
    if loader is None:
        loader = build_loader(
            recipe.dataset,
            batch_size=recipe.batch_size,
            config=config.data,
            device=run_device,
            collate_fn=recipe.collate_fn(),
            seed=recipe.seed,
        )
    saved_benchmark = torch.backends.cudnn.benchmark
    try:
        say("1/4 inspecting the model")
        batches = fixed_batches(recipe, _SAMPLE_BATCHES)
        facts, fold, machine = _inspect(recipe, batches, run_device, say)
        say("2/4 estimating the memory of a step")
        memory, memory_note = _memory_estimate(recipe, batches[0], run_device)
        say(f"3/4 profiling {2 * profile_steps + 3} training steps")
        trace = Path(trace_dir) if trace_dir is not None else None
        profile = profile_training(recipe, config, loader, steps=profile_steps, trace_dir=trace)
        variant, reason = _precision_variant(config, run_device, machine)
        speedups, comparison_error = None, None
        say("4/4 timing variants side by side")
        try:
            speedups = _measure_variants(recipe, config, facts, variant, batches)
        except RuntimeError as err:  # e.g. an op without a bf16 kernel: report it, go on
            comparison_error = f"the quick comparison of variants failed: {err}"
    finally:
        torch.backends.cudnn.benchmark = saved_benchmark
    findings = Findings(
        recipe=recipe,
        config=config,
        device=run_device,
        model=facts,
        loader=loader_facts(loader),
        dataset=dataset_facts(loader.dataset),
        profile=profile,
        varying=varying_shapes(profile.shapes),
        speedups=speedups,
        precision_variant=variant,
        precision_reason=reason,
        comparison_error=comparison_error,
        fold=fold,
        padding=(
            padding_fractions(recipe.lengths, recipe.batch_size, recipe.seed)
            if recipe.lengths is not None
            else None
        ),
        logits_bytes=machine.logits_bytes,
    )
    return Diagnosis(
        workload=recipe.name,
        device=str(run_device),
        items=judge(findings),
        breakdown=profile.breakdown,
        top_operators=profile.top_operators,
        peak_memory_bytes=profile.peak.peak_bytes,
        peak_memory_kind=profile.peak.kind,
        bound=findings.bound,
        trace_path=profile.trace_path,
        elapsed_s=time.perf_counter() - begin,
        processes=current_env().world_size,
        comm_bytes_per_step=profile.comm_bytes_per_step,
        comm_seconds_per_step=profile.comm_seconds_per_step,
        levers=with_measurements(
            registry.ranked_levers(replace(machine, device_busy=profile.device_busy)), speedups
        ),
        memory_estimate=memory,
        memory_estimate_note=memory_note,
        device_busy=profile.device_busy,
    )


def _memory_estimate(
    recipe: Recipe, batch: Any, device: torch.device
) -> tuple[MemoryEstimate | None, str]:
    """The step's memory estimate, or None and why not (a model the hooks cannot follow is
    a finding of the diagnosis, not its end)."""
    try:
        return estimate_recipe_memory(recipe, batch, device), ""
    except Exception as err:
        return None, f"memory estimate failed: {type(err).__name__}: {err}"[:300]


def _inspect(
    recipe: Recipe, batches: list[Any], device: torch.device, say: Callable[[str], None]
) -> tuple[ModelFacts, Gain | None, Facts]:
    """Model facts, the Conv→BN folding gain and the tuner's facts (GEMM rates per precision,
    padding, convolution share) from a model that is freed on return, so that it does not count
    in the profile's peak memory."""
    model, _ = recipe.build()
    model.to(device)
    sample = to_device(batches[0], device, non_blocking=False)
    # Through the engine's call, so that a loss_fn that breaks the contract (runs backward
    # itself, returns no scalar, cannot read the batch) gets the engine's one-line error here.
    loss_fn = functools.partial(call_loss_fn, recipe.loss_fn)
    facts = inspect_model(model, loss_fn, sample)
    say("1/4 inspecting the model: GEMM rates per precision")
    machine = gather(recipe, model, batches, device, lambda: loss_fn(model, sample))
    fold = None
    if facts.conv_bn_pairs:
        say("1/4 inspecting the model: timing Conv→BatchNorm folding")
        fold = fold_gain(model, loss_fn, sample, facts.conv_bn_pairs, device)
    return facts, fold, machine


def _precision_variant(
    config: TurboConfig, device: torch.device, machine: Facts
) -> tuple[Precision | None, str]:
    """The low precision worth timing against the config on this device, or why there is none:
    the tuner's facts decide, so that a CPU emulating bf16 is not timed at 0.05x."""
    if config.precision.dtype in ("bf16", "fp16"):
        return None, f"already {config.precision.dtype}"
    if device.type not in ("cpu", "cuda"):
        return None, f"no quick precision comparison on {device.type}"
    candidates: tuple[Precision, ...] = ("bf16", "fp16") if device.type == "cuda" else ("bf16",)
    # The precision technique's levers are labelled by their dtype (the doctor's ranking).
    expectations = {name: registry.lever(name).expect(machine) for name in candidates}
    usable = [name for name, expectation in expectations.items() if expectation.applicable]
    if usable:
        return usable[0], ""
    return None, expectations[candidates[0]].evidence


def _measure_variants(
    recipe: Recipe,
    config: TurboConfig,
    facts: ModelFacts,
    precision: Precision | None,
    batches: list[Any],
) -> dict[str, Gain] | None:
    """Time the config against its bf16 and channels_last variants, where they apply, and
    channels_last on top of bf16 against bf16.

    Compilation would take longer than the whole diagnosis, so a compiled config is compared
    in eager mode: the ratios then describe eager execution.
    """
    base = config.replace(compile=CompileConfig()) if config.compile.mode != "off" else config
    variants: dict[str, tuple[TurboConfig, str | None]] = {"config": (base, None)}
    if precision is not None:
        variants[precision] = (base.replace(precision=PrecisionConfig(dtype=precision)), "config")
    if facts.has_conv2d and not config.memory_format.channels_last:
        layout = base.replace(memory_format__channels_last=True)
        variants["channels_last"] = (layout, "config")
        if precision is not None:
            both = layout.replace(precision=PrecisionConfig(dtype=precision))
            variants[f"{precision}+channels_last"] = (both, precision)
    if len(variants) == 1:
        return None
    note = "eager, without compile" if base is not config else ""
    return measure_variants(recipe, variants, batches, note=note)
