"""The tuner's data stage: is the input pipeline what limits the step, and if so, how to fix it.

Trials train on pre-collated batches, so loader settings change no trial; they matter only when
loading a batch takes longer than computing on it. A first probe times the recipe's plain loader (no
workers) over a few batches: far below the step time, the run is compute-bound and the grid of
worker settings (``tune.loader.grid.tune_loader``, seconds per setting) is not worth its time.
Only otherwise is the grid measured, when the budget allows it. A stream (an ``IterableDataset``)
gets no grid: it must split itself among workers (``torch.utils.data.get_worker_info``), else every
worker yields all of it, and whether it does cannot be seen from outside.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader, IterableDataset

from torchturbo.base.device import to_device
from torchturbo.config import DataConfig
from torchturbo.data.length import length_or_none
from torchturbo.distributed.consensus import agree
from torchturbo.measure.timing import time_once
from torchturbo.tune.loader.grid import default_candidates, describe, tune_loader
from torchturbo.tune.search.outcome import Outcome, State
from torchturbo.tune.search.state import Incumbent, Run

#: Batches the probe times (after one untimed batch).
PROBE_BATCHES = 3
#: Loading below this share of the step cannot hold training back by more than it: no grid.
COMPUTE_BOUND_SHARE = 0.1
#: Batches and rounds per setting of the grid, and the seconds a worker setting takes to start.
GRID_BATCHES = 8
GRID_REPEATS = 2
WORKER_START_S = 1.0


def loader_stage(
    run: Run, baseline: Incumbent
) -> tuple[Outcome, dict[str, Any], DataConfig | None]:
    """(the stage's outcome, the loader record of the report, the [data] settings to adopt)."""
    recipe = run.recipe
    run.say("data_loader", "timing the plain loader", run.budget.left())
    load_s = agree(_probe(run))
    step_s = run.baseline_step_s
    config = baseline.config.to_dict()
    figures = (
        f"loading a batch takes {load_s * 1e3:.1f} ms in the main process, "
        f"a step {step_s * 1e3:.0f} ms"
    )
    if agree(load_s < COMPUTE_BOUND_SHARE * step_s):
        reason = f"compute-bound: {figures}; worker settings cannot speed the step up"
        return _without_grid("compute-bound", reason, config)
    if isinstance(recipe.dataset, IterableDataset):
        reason = (
            f"a stream (IterableDataset): {figures}; each DataLoader worker yields the whole "
            "stream unless the dataset splits itself with get_worker_info(), which cannot be "
            "checked from outside, so no worker setting is tried: set [data] num_workers "
            "yourself once yours splits"
        )
        return _without_grid("stream", reason, config)
    grid = default_candidates(run.device)
    estimate = len(grid) * GRID_REPEATS * (WORKER_START_S + (GRID_BATCHES + 2) * load_s)
    free = agree(run.budget.left())
    if agree(free < estimate + step_s):
        reason = (
            f"budget: the loader grid needs ~{estimate:.0f} s, {max(free, 0):.0f} s left "
            f"({figures})"
        )
        return _without_grid(
            "not measured", reason, config, state="not measured", estimate_s=estimate
        )
    run.say("data_loader", f"measuring {len(grid)} loader settings", run.budget.left())
    tuning = agree(
        tune_loader(
            recipe.dataset,
            recipe.batch_size,
            collate_fn=recipe.collate_fn(),
            device=run.device,
            candidates=grid,
            batches=GRID_BATCHES,
            warmup_batches=2,
            repeats=GRID_REPEATS,
            step_seconds=step_s,
        )
    )
    verdict = "input-bound" if tuning.input_bound else "compute-bound"
    record: dict[str, Any] = {
        "verdict": verdict,
        "reason": tuning.reason,
        "chosen": tuning.chosen.__dict__ if tuning.input_bound else None,
    }
    name = f"loader: {describe(tuning.chosen)}"
    state: State = "adopted" if tuning.input_bound else "rejected"
    outcome = Outcome(
        stage="data_loader",
        name=name,
        config=config,
        verdict=state,
        reason=f"{verdict}: {tuning.reason}",
        estimate_s=estimate,
    )
    return outcome, record, tuning.chosen if tuning.input_bound else None


def _without_grid(
    verdict: str,
    reason: str,
    config: dict[str, Any],
    *,
    state: State = "not applicable",
    estimate_s: float | None = None,
) -> tuple[Outcome, dict[str, Any], None]:
    """The stage's result when no worker setting is tried (``state``), and why; the loader
    record's ``verdict`` says which case it was."""
    outcome = Outcome(
        stage="data_loader",
        name="loader settings",
        config=config,
        verdict=state,
        reason=reason,
        estimate_s=estimate_s,
    )
    return outcome, {"verdict": verdict, "reason": reason, "chosen": None}, None


def _probe(run: Run) -> float:
    """Seconds per batch of the recipe's loader without workers, including the device copy."""
    recipe = run.recipe
    loader = DataLoader(
        recipe.dataset,
        batch_size=recipe.batch_size,
        shuffle=not isinstance(recipe.dataset, IterableDataset),
        collate_fn=recipe.collate_fn(),
    )
    batches = iter(loader)

    def fetch() -> None:
        to_device(next(batches), run.device, non_blocking=False)

    fetch()
    size = length_or_none(loader)
    count = PROBE_BATCHES if size is None else min(PROBE_BATCHES, max(size - 1, 0))
    seconds = []
    for _ in range(count):
        try:
            seconds.append(time_once(fetch, run.device, run.clock))
        except StopIteration:  # a stream shorter than the probe
            break
    return min(seconds, default=0.0)
