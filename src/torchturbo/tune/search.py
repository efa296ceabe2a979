"""The tuner: stage by stage, measure candidates against the current best, keep what helps.

The article's closing advice ("apply one or two changes at a time and measure the real effect")
as a procedure. Every candidate trains a fresh model from the recipe's initial weights on the same
fixed batches as the baseline, interleaved with the current best (see ``bench.Trial``); the rules
that adopt or reject it are in ``decide.py``. A candidate that raises is rejected with its error
and the run goes on. The time budget is checked before each candidate; a final confirmation run
re-measures the chosen configuration against the fp32 baseline.

Under torchrun every rank runs the tuner: every trial is a DDP/FSDP trial, all ranks measure,
and every branch taken on a measurement (time left, the speed probe, a failure, the verdict)
follows rank 0's value (``distributed.consensus``), so the ranks' collectives keep pairing up and
all ranks end with rank 0's config. A failure must happen on every rank alike (a technique that
does not apply); one that strikes one rank inside a collective stops the run (torchrun ends the
other ranks when one fails; the process group's timeout bounds a wait).
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from torchturbo.bench import Trial, fixed_batches, start_trial
from torchturbo.config import TurboConfig
from torchturbo.data.bucketing import BucketBatchSampler
from torchturbo.data.loader import LoaderTuning, describe, tune_loader
from torchturbo.distributed.consensus import agree, any_rank
from torchturbo.distributed.launch import current_env
from torchturbo.engine import resolve_device
from torchturbo.measure.breakdown import PhaseRecorder
from torchturbo.measure.timing import (
    Timing,
    measure_interleaved,
    noise_band,
    paired_noise,
    time_once,
)
from torchturbo.oom import split_batch
from torchturbo.recipe import Recipe
from torchturbo.system import summary
from torchturbo.techniques.memory_format import has_2d_convolutions
from torchturbo.tune.decide import break_even_steps, judge, loss_parity
from torchturbo.tune.stages import STAGES, Candidate, StageContext

#: Steps whose losses are compared for parity: enough to see a broken technique, few enough
#: that fp32/bf16 rounding has not yet compounded into divergent trajectories.
PARITY_STEPS = 6
#: Distinct batches every trial cycles through.
NUM_BATCHES = 8
#: Time set aside for a compile candidate's compilation: a ResNet-sized model took 20-60 s on a
#: 2-core CPU (the vision workload); starting one with less left would overrun the budget.
COMPILE_ALLOWANCE_S = 45.0
#: A candidate whose steady step is this many times slower than the best's is rejected at
#: once: fp16 on a CPU without fp16 units runs ~50x slower, and measuring it would eat the budget.
SLOW_FACTOR = 5.0
#: Steps timed one by one for that probe (the fastest counts: robust to a stray slow step).
PROBE_STEPS = 3
#: Batches timed per loader setting: enough for a steady rate, cheap next to the tuning budget.
LOADER_BATCHES = 8


@dataclass(frozen=True, kw_only=True)
class TuneOptions:
    time_budget_s: float = 300.0
    memory_budget: int | None = None
    planned_steps: int = 10_000
    loss_tolerance: float = 0.05
    device: str | None = None
    warmup: int = 2
    repeats: int = 5
    steps_per_repeat: int = 2
    confirm_repeats: int = 9

    def __post_init__(self) -> None:
        checks = {
            "time_budget_s": self.time_budget_s > 0,
            "planned_steps": self.planned_steps >= 1,
            "loss_tolerance": 0 < self.loss_tolerance < 1,
            "repeats": self.repeats >= 2 and self.confirm_repeats >= 2,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"{name} = {getattr(self, name)!r} is out of range")
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise ValueError(f"memory budget {self.memory_budget} bytes is not positive")


@dataclass
class _Incumbent:
    name: str
    config: TurboConfig
    trial: Trial
    first_step_s: float
    memory_bytes: int | None


@dataclass
class _Run:
    recipe: Recipe
    options: TuneOptions
    device: torch.device
    batches: list[Any]
    started: float
    say: Callable[[str, str, float], None]
    candidates: list[dict[str, Any]] = field(default_factory=list)
    stages: list[dict[str, Any]] = field(default_factory=list)
    adopted: list[str] = field(default_factory=list)

    def time_left(self) -> float:
        return self.options.time_budget_s - (time.perf_counter() - self.started)


def tune(
    recipe: Recipe,
    options: TuneOptions | None = None,
    *,
    stages: Mapping[str, Callable[[StageContext], list[Candidate] | str]] | None = None,
    on_progress: Callable[[str, str, float], None] | None = None,
) -> tuple[TurboConfig, dict[str, Any]]:
    """Tune ``recipe``; returns the chosen config and the results (see tune/report.py)."""
    options = options or TuneOptions()
    device = resolve_device(options.device or "auto")
    run = _Run(
        recipe=recipe,
        options=options,
        device=device,
        batches=fixed_batches(recipe, NUM_BATCHES),
        started=time.perf_counter(),
        say=on_progress or (lambda stage, candidate, left: None),
    )
    run.say("baseline", "fp32 eager", run.time_left())
    base_config = TurboConfig(device=str(device))
    baseline_trial, first = start_trial(recipe, base_config, run.batches)
    baseline = _Incumbent("baseline", base_config, baseline_trial, first, None)
    for _ in range(PARITY_STEPS):
        baseline_trial.step()
    baseline.memory_bytes = agree(baseline_trial.memory_footprint()[0])
    reference = baseline_trial.loss_curve()[:PARITY_STEPS]
    best = baseline
    try:
        loader = _loader_stage(run, baseline)
        if loader.input_bound:
            best.config = best.config.replace(data=loader.chosen)
            run.adopted.append(f"loader: {describe(loader.chosen)}")
        run.stages.append(
            _stage_row("data_loader", run.adopted[-1] if run.adopted else None, best, None)
        )
        for stage_name, stage in (stages or STAGES).items():
            best = _run_stage(run, stage_name, stage, best, reference)
        run.say("confirmation", best.name, run.time_left())
        results = _confirm(run, baseline, best)
        results["loader"] = {
            "verdict": "input-bound" if loader.input_bound else "compute-bound",
            "reason": loader.reason,
            "chosen": loader.chosen.__dict__ if loader.input_bound else None,
        }
    finally:
        for incumbent in {id(baseline): baseline, id(best): best}.values():
            incumbent.trial.close()
    return best.config, results


def _loader_stage(run: _Run, baseline: _Incumbent) -> LoaderTuning:
    """Measure the recipe's loader settings against the compute step: the data stage.

    Trials train on pre-collated batches, so the loader's setting changes no trial; it only
    matters when loading is slower than the step (input-bound), and then goes into the config.
    """
    run.say("data_loader", "measuring loader settings", run.time_left())
    (timing,) = measure_interleaved(
        {"baseline": baseline.trial.step}, device=run.device, warmup=1, repeats=3
    ).values()
    baseline.trial.step_seconds = timing.median
    recipe = run.recipe
    tuning = tune_loader(
        recipe.dataset,
        recipe.batch_size,
        collate_fn=recipe.collate,
        device=run.device,
        batches=LOADER_BATCHES,
        warmup_batches=2,
        repeats=2,
        step_seconds=timing.median,
    )
    return agree(tuning)


def _context(run: _Run, best: _Incumbent) -> StageContext:
    recipe = run.recipe
    env = current_env()
    return StageContext(
        recipe=recipe,
        best=best.config,
        device=run.device,
        has_convolutions=has_2d_convolutions(recipe.model()),
        best_memory_bytes=best.memory_bytes,
        memory_budget=run.options.memory_budget,
        world_size=env.world_size,
        backend=env.backend,
        micro_batches=lambda split: _split_batches(run.batches, split),
        bucketed_batches=(lambda: _bucketed_batches(recipe)) if recipe.lengths else None,
    )


def _run_stage(
    run: _Run,
    stage_name: str,
    stage: Callable[[StageContext], list[Candidate] | str],
    best: _Incumbent,
    reference: list[float],
) -> _Incumbent:
    proposed = stage(_context(run, best))
    if isinstance(proposed, str):
        run.stages.append(_stage_row(stage_name, None, best, proposed))
        return best
    must_be_faster = not (
        stage_name == "memory"
        and run.options.memory_budget is not None
        and (best.memory_bytes or 0) > run.options.memory_budget
    )
    winners: list[tuple[float, _Incumbent]] = []
    for candidate in proposed:
        run.say(stage_name, candidate.name, run.time_left())
        row, incumbent, ratio = _try(run, stage_name, candidate, best, reference, must_be_faster)
        run.candidates.append(row)
        if incumbent is not None:
            winners.append((ratio, incumbent))
    if not winners:
        run.stages.append(_stage_row(stage_name, None, best, None))
        return best
    winners.sort(key=lambda pair: pair[0], reverse=True)
    chosen = winners[0][1]
    for _, loser in winners[1:]:
        loser.trial.close()
    for row in run.candidates:
        if (
            row["stage"] == stage_name
            and row["verdict"] == "adopted"
            and row["name"] != chosen.name
        ):
            row["verdict"] = "kept"
            row["reason"] += f"; {chosen.name} was faster in this stage"
    if best.name != "baseline":
        best.trial.close()
    run.adopted.append(chosen.name)
    run.stages.append(_stage_row(stage_name, chosen.name, chosen, None))
    return chosen


def _stage_row(
    stage: str, chosen: str | None, best: _Incumbent, skipped: str | None
) -> dict[str, Any]:
    return {
        "stage": stage,
        "best": chosen,
        "throughput": _throughput(best.trial),
        "memory_bytes": best.memory_bytes,
        "skipped_reason": skipped,
    }


def _throughput(trial: Trial) -> float | None:
    steps = trial.step_seconds
    return None if steps is None else trial.mean_count() / steps


def _try(
    run: _Run,
    stage: str,
    candidate: Candidate,
    best: _Incumbent,
    reference: list[float],
    must_be_faster: bool,
) -> tuple[dict[str, Any], _Incumbent | None, float]:
    row: dict[str, Any] = {
        "stage": stage,
        "name": candidate.name,
        "config": candidate.config.to_dict(),
        "throughput": None,
        "ratio": None,
        "noise": None,
        "step_ms": None,
        "memory_bytes": None,
        "one_time_s": None,
        "break_even_steps": None,
        "parity": None,
        "comm_bytes_per_step": None,
    }
    estimate = 3 * (best.trial.step_seconds or 0.1) * _steps_per_measurement(run.options)
    if candidate.config.compile.mode != best.config.compile.mode:
        estimate += COMPILE_ALLOWANCE_S
    left, estimate = agree((run.time_left(), estimate))
    if left < estimate:
        row.update(verdict="skipped", reason=f"time budget: {left:.0f} s left")
        return row, None, 0.0
    trial = None
    error: Exception | None = None
    try:
        trial, first = start_trial(
            candidate.recipe or run.recipe, candidate.config, _batches(candidate, best)
        )
        # The parity steps double as a cheap speed probe: a candidate far slower than the best
        # (fp16 without fp16 units) is rejected before the interleaved measurement.
        probe = min(time_once(trial.step, run.device) for _ in range(PROBE_STEPS))
        probe, best_step = agree((probe, best.trial.step_seconds))
        if best_step and probe > SLOW_FACTOR * best_step:
            trial.close()
            row.update(
                verdict="rejected",
                reason=f"not faster: its fastest of {PROBE_STEPS} steps took "
                f"{probe / best_step:.1f}x the current best's step, so it was not "
                "measured further",
            )
            return row, None, 0.0
        while len(trial.losses) < _parity_len(candidate):
            trial.step()
        trial.align_with(best.trial)
        timings = measure_interleaved(
            {"best": best.trial.step, "candidate": trial.step},
            device=run.device,
            warmup=run.options.warmup,
            repeats=run.options.repeats,
            steps_per_repeat=run.options.steps_per_repeat,
        )
        best.trial.step_seconds = timings["best"].median
        trial.step_seconds = timings["candidate"].median
        memory_bytes = trial.memory_footprint()[0]
    except Exception as err:  # a technique that fails on this model is a finding, not a crash
        error = err
    if any_rank(error is not None, run.device):
        if trial is not None:
            trial.close()
        message = f"{type(error).__name__}: {error}" if error else "it failed on another rank"
        row.update(verdict="rejected", reason=agree(f"error: {message}"[:500]))
        return row, None, 0.0
    assert trial is not None
    throughput = trial.mean_count() / timings["candidate"].median
    ratio = throughput / (best.trial.mean_count() / timings["best"].median)
    noise = _noise(
        timings["candidate"], timings["best"], same_batches=trial.batches is best.trial.batches
    )
    one_time = max(0.0, first - timings["candidate"].median)
    break_even = break_even_steps(one_time, timings["best"].median, timings["candidate"].median)
    parity = loss_parity(
        reference, _window_losses(trial, candidate.config), run.options.loss_tolerance
    )
    verdict = judge(
        ratio=ratio,
        noise=noise,
        parity=parity,
        memory_bytes=memory_bytes,
        memory_budget=run.options.memory_budget,
        break_even=break_even,
        planned_steps=run.options.planned_steps,
        tolerance=run.options.loss_tolerance,
        must_be_faster=must_be_faster,
    )
    row.update(
        throughput=throughput,
        ratio=ratio,
        noise=noise,
        step_ms=timings["candidate"].median * 1e3,
        memory_bytes=memory_bytes,
        one_time_s=one_time,
        break_even_steps=None if break_even == float("inf") else break_even,
        parity=dataclasses.asdict(parity),
        comm_bytes_per_step=(trial.comm_per_step() or (None,))[0],
        verdict="adopted" if verdict.adopt else "rejected",
        reason=verdict.reason,
    )
    row, adopt = agree((row, verdict.adopt))
    if not adopt:
        trial.close()
        return row, None, row["ratio"]
    incumbent = _Incumbent(candidate.name, candidate.config, trial, first, row["memory_bytes"])
    return row, incumbent, row["ratio"]


def _noise(candidate: Timing, best: Timing, *, same_batches: bool) -> float:
    """The ratio's noise: paired round by round when both trained the same batches in step
    (``Trial.align_with``), which cancels differences in batch cost; else the larger spread."""
    return paired_noise(candidate, best) if same_batches else noise_band([candidate, best])


def _steps_per_measurement(options: TuneOptions) -> int:
    return 2 * (options.warmup + options.repeats * options.steps_per_repeat) + PARITY_STEPS


def _parity_len(candidate: Candidate) -> int:
    return PARITY_STEPS * candidate.config.accumulation.steps


def _batches(candidate: Candidate, best: _Incumbent) -> list[Any]:
    """The candidate's own batches (micro-batches, length buckets), else the best's: a later
    stage must not drop the batching an earlier one adopted, or it would be timed on the
    padded batches against a best on bucketed ones."""
    return candidate.batches if candidate.batches is not None else best.trial.batches


def _window_losses(trial: Trial, config: TurboConfig) -> list[float]:
    """Per optimizer step losses: micro-batch losses averaged over each accumulation window."""
    losses = trial.loss_curve()
    steps = config.accumulation.steps
    return [sum(losses[i : i + steps]) / steps for i in range(0, len(losses) - steps + 1, steps)]


def _split_batches(batches: list[Any], split: int) -> list[Any]:
    """Each batch cut into ``split`` equal micro-batches, as the engine's OOM path cuts them."""
    return [piece for batch in batches for piece in split_batch(batch, split)]


def _bucketed_batches(recipe: Recipe) -> list[Any]:
    """Bucketed batches with the same token budget as the recipe's random batches."""
    assert recipe.lengths is not None
    lengths = list(recipe.lengths)
    mean_length = sum(lengths) / len(lengths)
    budget = max(int(recipe.batch_size * mean_length), max(lengths))
    sampler = BucketBatchSampler(lengths, max_tokens=budget, seed=recipe.seed)
    collate = recipe.collate
    batches = []
    for indices in sampler:
        samples = [recipe.dataset[i] for i in indices]
        batches.append(collate(samples) if collate else torch.utils.data.default_collate(samples))
        if len(batches) == NUM_BATCHES:
            break
    return batches


def _confirm(run: _Run, baseline: _Incumbent, best: _Incumbent) -> dict[str, Any]:
    """Re-measure the chosen config against the baseline with more repeats, then report.

    When nothing was adopted the best *is* the baseline trial: it is timed once, and the ratio is
    1 by definition (interleaving a trial with itself would time different batches).
    """
    variants = {"baseline": baseline.trial.step}
    if best is not baseline:
        best.trial.align_with(baseline.trial)
        variants["best"] = best.trial.step
    timings = measure_interleaved(
        variants,
        device=run.device,
        warmup=1,
        repeats=run.options.confirm_repeats,
        steps_per_repeat=run.options.steps_per_repeat,
    )
    timings.setdefault("best", timings["baseline"])
    base_tp = baseline.trial.mean_count() / timings["baseline"].median
    best_tp = best.trial.mean_count() / timings["best"].median
    return {
        "recipe": run.recipe.name,
        "device": str(run.device),
        "processes": current_env().world_size,
        "torch": torch.__version__,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "unit": f"{run.recipe.count_unit}/s",
        "baseline_throughput": base_tp,
        "best_throughput": best_tp,
        "confirmed_ratio": best_tp / base_tp,
        "confirmation": {
            "baseline_step_ms": timings["baseline"].median * 1e3,
            "best_step_ms": timings["best"].median * 1e3,
            "noise": _noise(
                timings["best"],
                timings["baseline"],
                same_batches=best.trial.batches is baseline.trial.batches,
            ),
            "repeats": run.options.confirm_repeats,
        },
        "time_budget_s": run.options.time_budget_s,
        "elapsed_s": time.perf_counter() - run.started,
        "memory_budget_bytes": run.options.memory_budget,
        "planned_steps": run.options.planned_steps,
        "loss_tolerance": run.options.loss_tolerance,
        "stages": run.stages,
        "candidates": [_baseline_row(baseline, timings["baseline"].median), *run.candidates],
        "adopted": run.adopted,
        "breakdown": {
            "baseline": _breakdown(baseline.trial),
            "best": _breakdown(best.trial),
        },
        "loss_curves": {
            "baseline": _window_losses(baseline.trial, baseline.config),
            "best": _window_losses(best.trial, best.config),
        },
        "loader": None,
        "system": summary(),
    }


def _baseline_row(baseline: _Incumbent, step_s: float) -> dict[str, Any]:
    return {
        "stage": "baseline",
        "name": "fp32 eager",
        "config": baseline.config.to_dict(),
        "throughput": baseline.trial.mean_count() / step_s,
        "ratio": 1.0,
        "noise": None,
        "step_ms": step_s * 1e3,
        "memory_bytes": baseline.memory_bytes,
        "one_time_s": None,
        "break_even_steps": None,
        "parity": None,
        "comm_bytes_per_step": (baseline.trial.comm_per_step() or (None,))[0],
        "verdict": "kept",
        "reason": "the reference every candidate is measured against",
    }


def _breakdown(trial: Trial, steps: int = 3) -> dict[str, float]:
    """Seconds per step by phase, from a few steps with a syncing PhaseRecorder."""
    recorder = PhaseRecorder(trial.turbo.device)
    previous, trial.turbo.recorder = trial.turbo.recorder, recorder
    try:
        for _ in range(steps):
            trial.step()
    finally:
        trial.turbo.recorder = previous
    return {phase: seconds / steps for phase, seconds in recorder.totals().items()}
