"""The tuner's results as frozen records, built in one place and turned into JSON at the end.

An :class:`Outcome` is one candidate's fate, decided once: adopted, rejected (the rule and its
numbers), undecided (measured, but stopped before the rule decided: its estimate and what it
would need), not measured (the budget, with the estimate it needed) or not applicable (the fact).
A measured candidate carries the one :class:`Comparison` that decided it, so every table of the
report shows the same ratio and interval for the same config. :class:`TuneResult` is the run.

``to_dict`` flattens a comparison into its candidate's row (``ratio``, ``noise``, ``step_ms`` ...)
because that is what the report's tables read and what results.json has always held;
``outcome_from_dict`` reads a row back for a resumed run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from torchturbo.measure.paired import Round
from torchturbo.techniques.framework.decide import Parity, RatioEstimate, job_times

#: "reference" is the baseline's row: what every other config is measured against.
State = Literal["reference", "adopted", "rejected", "undecided", "not measured", "not applicable"]
STATES: tuple[str, ...] = (
    "reference",
    "adopted",
    "rejected",
    "undecided",
    "not measured",
    "not applicable",
)


def left_out_for_time(verdict: object, reason: object) -> bool:
    """A row the budget left unmeasured ("budget: needs ~40 s, 12 s left"), not one left out
    because it could not pay back on the job or did not apply: only these a larger budget
    would measure."""
    return verdict == "not measured" and str(reason or "").startswith("budget")


@dataclass(frozen=True, kw_only=True)
class Comparison:
    """A config timed against a reference in paired rounds of one run."""

    #: The name of the reference: "fp32 eager", or the best config of the time.
    against: str
    speed: RatioEstimate
    steps_per_round: int
    #: Median seconds per step of each side, and samples (or tokens) per second.
    step_ms: float
    reference_step_ms: float
    throughput: float
    reference_throughput: float
    #: The candidate's seconds per step in each round, in milliseconds.
    step_samples_ms: tuple[float, ...] = ()
    #: Each round's throughput ratio: what ``speed`` was estimated from.
    ratios: tuple[float, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "against": self.against,
            "ratio": self.speed.ratio,
            "ratio_low": self.speed.low,
            "ratio_high": self.speed.high,
            "ratio_plausible_high": self.speed.plausible_high,
            "noise": self.speed.noise,
            "rounds": self.speed.rounds,
            "decision": self.speed.decision,
            "steps_per_round": self.steps_per_round,
            "step_ms": self.step_ms,
            "reference_step_ms": self.reference_step_ms,
            "throughput": self.throughput,
            "reference_throughput": self.reference_throughput,
            "step_samples_ms": list(self.step_samples_ms),
            "ratios": list(self.ratios),
        }


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """What became of one candidate (see the module docstring)."""

    stage: str
    name: str
    config: dict[str, Any]
    verdict: State
    reason: str
    comparison: Comparison | None = None
    memory_bytes: int | None = None
    one_time_s: float | None = None
    break_even_steps: float | None = None
    #: Seconds of the planned job with this candidate and with the best it was measured against
    #: (one-time costs + planned steps x step time, ``decide.job_times``).
    job_s: float | None = None
    reference_job_s: float | None = None
    #: The cold compile's one-time seconds, when ``one_time_s`` is the warm-cache cost (the
    #: job loads the compile cache tuning filled); None otherwise.
    cold_one_time_s: float | None = None
    #: Graphs torch.compile built while it was measured (1 = no recompile); None: not compiled.
    compiled_graphs: int | None = None
    parity: Parity | None = None
    comm_bytes_per_step: int | None = None
    #: Per optimizer step losses of the candidate's first steps.
    loss_curve: tuple[float, ...] = ()
    #: The prior that ordered the work (``techniques.framework.levers``) and the seconds it was
    #: estimated to cost; None where there was none.
    expected_gain: float | None = None
    estimate_s: float | None = None
    #: Seconds its measurement took (the cost of the decision), and the samples or tokens
    #: (``Recipe.count_unit``) its steps held on average: with dynamic batching, the real tokens
    #: per step the job will train.
    spent_s: float | None = None
    count_per_step: float | None = None
    #: Its throughput over the best it was proposed on where it was raced against its lever's
    #: leader (``fastest_fit._challenge``): the leader's ratio times its own; None where its own
    #: ratio is against that best. Kept in results.json, so that a rerun that reuses it expects
    #: what the search measured.
    over_best: float | None = None
    #: Taken from a previous run's results.json in the same --out instead of measured again.
    reused: bool = False
    #: The paired rounds its comparison was read from (kept in memory, not written): the time
    #: held back for a confirmation that will not run goes on from them (``run``).
    rounds: tuple[Round, ...] = dataclasses.field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.verdict not in STATES:
            raise ValueError(f"Outcome.verdict = {self.verdict!r}: expected one of {STATES}")

    def to_dict(self) -> dict[str, Any]:
        row: dict[str, Any] = {
            "stage": self.stage,
            "name": self.name,
            "config": self.config,
            "verdict": self.verdict,
            "reason": self.reason,
            **_empty_comparison(),
            "memory_bytes": self.memory_bytes,
            "one_time_s": self.one_time_s,
            "break_even_steps": self.break_even_steps,
            "job_s": self.job_s,
            "reference_job_s": self.reference_job_s,
            "compiled_graphs": self.compiled_graphs,
            "cold_one_time_s": self.cold_one_time_s,
            "parity": None if self.parity is None else dataclasses.asdict(self.parity),
            "comm_bytes_per_step": self.comm_bytes_per_step,
            "loss_curve": list(self.loss_curve),
            "expected_gain": self.expected_gain,
            "estimate_s": self.estimate_s,
            "spent_s": self.spent_s,
            "count_per_step": self.count_per_step,
            "over_best": self.over_best,
            "reused": self.reused,
        }
        if self.comparison is not None:
            row.update(self.comparison.to_dict())
        return row


def _empty_comparison() -> dict[str, Any]:
    return {
        "against": None,
        "ratio": None,
        "ratio_low": None,
        "ratio_high": None,
        "ratio_plausible_high": None,
        "noise": None,
        "rounds": None,
        "decision": None,
        "steps_per_round": None,
        "step_ms": None,
        "reference_step_ms": None,
        "throughput": None,
        "reference_throughput": None,
        "step_samples_ms": [],
        "ratios": [],
    }


def outcome_from_dict(row: dict[str, Any]) -> Outcome:
    """A candidate row of a previous results.json, marked as reused."""
    comparison = None
    if row.get("ratio") is not None:
        speed = RatioEstimate(
            ratio=row["ratio"],
            low=row["ratio_low"],
            high=row["ratio_high"],
            rounds=row["rounds"],
            decision=row["decision"],
            plausible_high=row.get("ratio_plausible_high") or row["ratio_high"],
        )
        comparison = Comparison(
            against=row["against"],
            speed=speed,
            steps_per_round=row["steps_per_round"],
            step_ms=row["step_ms"],
            reference_step_ms=row["reference_step_ms"],
            throughput=row["throughput"],
            reference_throughput=row["reference_throughput"],
            step_samples_ms=tuple(row.get("step_samples_ms") or ()),
            ratios=tuple(row.get("ratios") or ()),
        )
    parity = row.get("parity")
    return Outcome(
        stage=row["stage"],
        name=row["name"],
        config=row["config"],
        verdict=row["verdict"],
        reason=row["reason"],
        comparison=comparison,
        memory_bytes=row.get("memory_bytes"),
        one_time_s=row.get("one_time_s"),
        break_even_steps=row.get("break_even_steps"),
        job_s=row.get("job_s"),
        reference_job_s=row.get("reference_job_s"),
        compiled_graphs=row.get("compiled_graphs"),
        cold_one_time_s=row.get("cold_one_time_s"),
        parity=None if parity is None else Parity(**parity),
        comm_bytes_per_step=row.get("comm_bytes_per_step"),
        loss_curve=tuple(row.get("loss_curve") or ()),
        expected_gain=row.get("expected_gain"),
        estimate_s=row.get("estimate_s"),
        spent_s=row.get("spent_s"),
        count_per_step=row.get("count_per_step"),
        over_best=row.get("over_best"),
        reused=True,
    )


def _times(steps: int, per_step: float | None) -> float | None:
    return None if per_step is None else steps * per_step


ConfirmationState = Literal[
    "not needed",
    "confirmed",
    "consistent",
    "dropped",
    "reverted",
    "fits",
    "interrupted",
    "unconfirmed",
]


@dataclass(frozen=True, kw_only=True)
class Confirmation:
    """The chosen config against the baseline, measured again at the end.

    ``not needed``: nothing was adopted, the chosen config is the baseline (1.00x by definition).
    ``confirmed``: faster than the baseline beyond the noise. ``consistent``: not decided (a
    noisy machine, a small budget), but no slower than the baseline and within the noise of what
    the search measured: kept, and the report says it is unconfirmed. ``dropped``: it was not, the
    adoptions in ``dropped`` failed when re-measured alone against the baseline and were removed,
    and the rest was confirmed. ``reverted``: nothing could be confirmed, the baseline is kept.
    ``fits``: the baseline does not fit the memory budget, so the adoption that made the step fit
    is kept whatever its speed (``comparison`` is its own measurement against the baseline);
    adoptions after it that the confirmation contradicted are in ``dropped``. ``interrupted``:
    a stop signal or Ctrl-C ended the run before the confirmation; the search's pick is kept,
    unconfirmed, and the rows are each adoption's own measurement. ``unconfirmed``: nothing was
    adopted until the time held back for the confirmation went to an undecided candidate, which
    its own paired measurement against the baseline adopted; kept, its rows that measurement.
    """

    state: ConfirmationState
    comparison: Comparison | None
    dropped: tuple[str, ...] = ()
    note: str = ""
    #: The incremental table: the baseline, then each kept adoption, every figure from the
    #: confirmation's own rounds (a row's ratio is its throughput over the row above's).
    rows: tuple[dict[str, Any], ...] = ()

    @property
    def ratio(self) -> float:
        return 1.0 if self.comparison is None else self.comparison.speed.ratio

    def to_dict(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "dropped": list(self.dropped),
            "note": self.note,
            "rows": list(self.rows),
            **(_empty_comparison() if self.comparison is None else self.comparison.to_dict()),
        }


@dataclass(frozen=True, kw_only=True)
class TuneResult:
    """One tuning run: what was measured, what was chosen, and on what."""

    recipe: str
    device: str
    processes: int
    torch: str
    date: str
    unit: str
    #: The fp32 eager baseline's row (verdict "reference"), and its own step time and throughput.
    baseline: Outcome
    baseline_step_ms: float
    baseline_throughput: float
    candidates: tuple[Outcome, ...]
    adopted: tuple[str, ...]
    confirmation: Confirmation
    facts: dict[str, Any]
    loader: dict[str, Any] | None
    time_budget_s: float
    elapsed_s: float
    memory_budget_bytes: int | None
    #: The batch finder's choice (``tune.batch.choice.BatchChoice.to_dict``); None without
    #: --find-batch.
    batch: dict[str, Any] | None = None
    planned_steps: int
    loss_tolerance: float
    #: Who set ``planned_steps`` ("the Trainer's max_steps=500", "--planned-steps") and whether
    #: it is an assumption (nothing said how long the job is).
    planned_steps_source: str = ""
    planned_steps_assumed: bool = False
    #: One-time seconds (first steps beyond steady ones) of the baseline and of the chosen config.
    baseline_one_time_s: float = 0.0
    best_one_time_s: float = 0.0
    #: Seconds the candidates left unmeasured for lack of time were estimated to need.
    unmeasured_s: float
    #: The results.json a resumed run took candidates from; None for a fresh run.
    reused_from: str | None
    #: Why a previous results.json was or was not reused ("" when there was none).
    reuse_note: str
    breakdown: dict[str, dict[str, float]]
    loss_curves: dict[str, list[float]]
    system: dict[str, str]
    fingerprint: dict[str, Any] = field(default_factory=dict)
    #: The baseline step's memory estimate made before it ran, with the footprint then measured
    #: and its relative error (``search._estimate_record``).
    memory_estimate: dict[str, Any] = field(default_factory=dict)
    #: Said before the search when the budget could not measure every candidate expected to
    #: gain much, with the budget that would ("" when it could).
    budget_note: str = ""
    #: Samples or tokens (``unit``) per step of fp32 eager and of the chosen config: with dynamic
    #: batching the chosen config's are the real tokens its steps hold on average.
    baseline_count_per_step: float | None = None
    best_count_per_step: float | None = None

    def job(self) -> dict[str, Any]:
        """The planned job timed with fp32 eager and with the chosen config: one-time costs plus
        planned steps x step time, step times from the confirmation's rounds when there was one
        (the chosen config's step is the baseline's over the confirmed ratio: same work)."""
        c = self.confirmation.comparison
        step_s = (c.reference_step_ms if c is not None else self.baseline_step_ms) / 1e3
        job = job_times(
            steps=self.planned_steps,
            best_step_s=step_s,
            ratio=self.confirmation.ratio,
            best_one_time_s=self.baseline_one_time_s,
            one_time_s=self.best_one_time_s if c is not None else self.baseline_one_time_s,
        )
        return {
            "steps": self.planned_steps,
            "source": self.planned_steps_source,
            "assumed": self.planned_steps_assumed,
            "baseline_s": job.best_s,
            "best_s": job.candidate_s,
            "baseline_one_time_s": self.baseline_one_time_s,
            "best_one_time_s": self.best_one_time_s if c is not None else self.baseline_one_time_s,
            # What the job trains: its steps hold these on average, each way.
            "baseline_count": _times(self.planned_steps, self.baseline_count_per_step),
            "best_count": _times(
                self.planned_steps,
                self.best_count_per_step if c is not None else self.baseline_count_per_step,
            ),
        }

    def to_dict(self) -> dict[str, Any]:
        confirmation = self.confirmation.comparison
        baseline = self.baseline.to_dict()
        baseline.update(step_ms=self.baseline_step_ms, throughput=self.baseline_throughput)
        return {
            "recipe": self.recipe,
            "device": self.device,
            "processes": self.processes,
            "torch": self.torch,
            "date": self.date,
            "unit": self.unit,
            # From the confirmation's rounds when there was one, as the tables are.
            "baseline_throughput": (
                self.baseline_throughput
                if confirmation is None
                else confirmation.reference_throughput
            ),
            "best_throughput": (
                self.baseline_throughput if confirmation is None else confirmation.throughput
            ),
            "confirmed_ratio": self.confirmation.ratio,
            "confirmation": self.confirmation.to_dict(),
            "time_budget_s": self.time_budget_s,
            "elapsed_s": self.elapsed_s,
            "memory_budget_bytes": self.memory_budget_bytes,
            "batch": self.batch,
            "planned_steps": self.planned_steps,
            "planned_steps_source": self.planned_steps_source,
            "planned_steps_assumed": self.planned_steps_assumed,
            "job": self.job(),
            "loss_tolerance": self.loss_tolerance,
            "candidates": [baseline, *(c.to_dict() for c in self.candidates)],
            "adopted": list(self.adopted),
            "unmeasured_s": self.unmeasured_s,
            "reused_from": self.reused_from,
            "reuse_note": self.reuse_note,
            "facts": self.facts,
            "loader": self.loader,
            "breakdown": self.breakdown,
            "loss_curves": self.loss_curves,
            "system": self.system,
            "fingerprint": self.fingerprint,
            "memory_estimate": self.memory_estimate,
            "budget_note": self.budget_note,
        }
