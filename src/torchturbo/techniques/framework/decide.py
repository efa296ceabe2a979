"""The tuner's decision rules, as pure functions of measured numbers.

**Is it faster?** A candidate and the current best are timed in paired rounds on the same batches
(``measure.paired``); each round gives one throughput ratio. On the logs of those ratios the
rule is a one-sided Student t interval, checked after every round from the third on (sequential
testing: a large effect is decided in three rounds, a small one gets more, a null one stops once
it is clear that any gain is below ``WORTH_MEASURING``):

* **faster** when the lower bound at ``FASTER_CONFIDENCE`` clears ``MIN_GAIN``;
* **not faster** when the upper bound at ``FUTILITY_CONFIDENCE`` is below ``WORTH_MEASURING``;
* otherwise **undecided**. A comparison that ends undecided (the budget, or the last round) is
  reported as undecided, with its estimate and the rounds it would need (:func:`rounds_to_decide`),
  never as rejected: "not faster" is said only when the measurement excludes a gain worth having.

The interval's width is what the report calls the noise. Checking after every round inflates the
false-adoption rate of a single test; 99.9% per look, the 2% margin and a floor on the spread
keep an A/A comparison (a config against itself) adopted in well under 1% of runs, for normal,
heavy-tailed and outlier-ridden timing noise alike (tests/test_decide.py simulates them).

A measured candidate replaces the current best only when it is faster (as above), its loss over
the first steps (same initial weights, same batches) is finite and within ``loss_tolerance`` of
the fp32 baseline's, its memory fits the budget when one is given, and the planned job is
faster with it: its one-time costs (compile, recompiles, first-step warm-up) plus planned steps
x its step time beat the same sum of the current best (``job_times``). Keeping these apart from
the measuring lets the tests drive them with injected numbers.

Every verdict of the search is ruled here: a candidate against the best (:func:`judge`), an
alternative against its lever's leader (:func:`judge_against_leader`), two alternatives raced
head to head (:func:`head_to_head_decided`, :func:`order_known`, :func:`judge_race`), and the
chosen config against the baseline at the end (:func:`judge_confirmation`, :func:`holds_alone`).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from torchturbo.output.tables import format_bytes

#: A gain must clear this margin too: 2% is the drift of a quiet machine between runs.
MIN_GAIN = 0.02
#: Below this a gain is not worth more rounds: measuring stops once it is clear it is smaller.
WORTH_MEASURING = 0.05
FASTER_CONFIDENCE = 0.999
FUTILITY_CONFIDENCE = 0.95
#: Rounds before any decision: a spread needs at least three points.
MIN_ROUNDS = 3
#: The smallest spread of log-ratios believed: paired rounds on a quiet machine scatter by ~1%,
#: and two rounds that agree by chance must not make the interval collapse.
MIN_SPREAD = 0.01

# One-sided Student t quantiles by degrees of freedom 1..30 (scipy.stats.t.ppf); beyond 30 the
# last entry errs on the side of caution. Tabulated to keep scipy out of the dependencies.
_T_QUANTILES = {
    0.999: (
        318.309, 22.327, 10.215, 7.173, 5.893, 5.208, 4.785, 4.501, 4.297, 4.144,
        4.025, 3.930, 3.852, 3.787, 3.733, 3.686, 3.646, 3.610, 3.579, 3.552,
        3.527, 3.505, 3.485, 3.467, 3.450, 3.435, 3.421, 3.408, 3.396, 3.385,
    ),
    0.95: (
        6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812,
        1.796, 1.782, 1.771, 1.761, 1.753, 1.746, 1.740, 1.734, 1.729, 1.725,
        1.721, 1.717, 1.714, 1.711, 1.708, 1.706, 1.703, 1.701, 1.699, 1.697,
    ),
}  # fmt: skip

Decision = Literal["faster", "not faster", "undecided"]


def t_quantile(confidence: float, df: int) -> float:
    table = _T_QUANTILES[confidence]
    return table[min(max(df, 1), len(table)) - 1]


@dataclass(frozen=True)
class RatioEstimate:
    """Per-round throughput ratios summarised: the centre, the decision interval, the verdict."""

    ratio: float
    low: float
    high: float
    rounds: int
    decision: Decision
    #: The one-sided upper bound at ``FUTILITY_CONFIDENCE``: above this the ratio is unlikely.
    #: A confirmation whose plausible best is below the searched gain contradicts the search.
    plausible_high: float = math.inf

    @property
    def noise(self) -> float:
        """Relative half-width of the interval: the ratio is known to within this factor."""
        return self.high / self.ratio - 1


def estimate(ratios: Sequence[float], *, final: bool = False) -> RatioEstimate:
    """The geometric mean of ``ratios`` with its interval and decision (module docstring).

    ``final``: undecided reads as "not faster" (a comparison stopped because it was hopeless,
    or a confirmation, which only asks whether the gain held).
    """
    if not ratios or any(not (r > 0 and math.isfinite(r)) for r in ratios):
        raise ValueError(f"estimate(ratios={list(ratios)!r}) needs positive, finite ratios")
    logs = [math.log(r) for r in ratios]
    n = len(logs)
    centre = statistics.fmean(logs)
    spread = max(statistics.stdev(logs) if n > 1 else 0.0, MIN_SPREAD)
    error = spread / math.sqrt(n) * _correlation_factor(logs, centre)
    faster_low = centre - t_quantile(FASTER_CONFIDENCE, n - 1) * error
    futile_high = centre + t_quantile(FUTILITY_CONFIDENCE, n - 1) * error
    decision: Decision = "undecided"
    if n >= MIN_ROUNDS and faster_low > math.log1p(MIN_GAIN):
        decision = "faster"
    elif (n >= MIN_ROUNDS and futile_high < math.log1p(WORTH_MEASURING)) or final:
        decision = "not faster"
    width = t_quantile(FASTER_CONFIDENCE, n - 1) * error
    return RatioEstimate(
        ratio=math.exp(centre),
        low=_exp(centre - width),
        high=_exp(centre + width),
        rounds=n,
        decision=decision,
        plausible_high=_exp(futile_high),
    )


def rounds_to_decide(speed: RatioEstimate, ratios: Sequence[float]) -> int | None:
    """About how many rounds in all would decide an undecided comparison, were the ratio and
    its spread to stay as measured: the fewer of those that let the interval clear ``MIN_GAIN``
    (a gain) and those that bring it below ``WORTH_MEASURING`` (none worth having). None for a
    ratio exactly on a threshold."""
    if len(ratios) < 2:
        return MIN_ROUNDS
    logs = [math.log(r) for r in ratios]
    centre = statistics.fmean(logs)
    spread = max(statistics.stdev(logs), MIN_SPREAD) * _correlation_factor(logs, centre)
    needs = []
    for margin, confidence in (
        (centre - math.log1p(MIN_GAIN), FASTER_CONFIDENCE),
        (math.log1p(WORTH_MEASURING) - centre, FUTILITY_CONFIDENCE),
    ):
        if margin > 0:
            needs.append(math.ceil((t_quantile(confidence, 30) * spread / margin) ** 2))
    if not needs:
        return None
    return max(MIN_ROUNDS, min(needs), speed.rounds + 1)


def _correlation_factor(logs: Sequence[float], centre: float) -> float:
    """How much wider the interval must be when consecutive rounds err alike (load that lasts
    several rounds): ``sqrt((1 + r) / (1 - r))`` for a lag-1 autocorrelation r > 0, else 1."""
    if len(logs) < MIN_ROUNDS:
        return 1.0
    deviations = [x - centre for x in logs]
    variance = sum(d * d for d in deviations)
    if variance == 0:
        return 1.0
    r = sum(a * b for a, b in itertools.pairwise(deviations)) / variance
    r = min(max(r, 0.0), 0.9)
    return math.sqrt((1 + r) / (1 - r))


def _exp(x: float) -> float:
    """exp that saturates to 0 or inf instead of overflowing (a wild first round)."""
    return math.exp(max(min(x, 700.0), -700.0))


@dataclass(frozen=True)
class Parity:
    """Loss of a candidate against the fp32 baseline over the same first steps."""

    reference_loss: float
    loss: float
    relative_diff: float
    finite: bool
    ok: bool


def loss_parity(reference: Sequence[float], candidate: Sequence[float], tolerance: float) -> Parity:
    """Compare mean losses over the steps both curves have (at least one)."""
    steps = min(len(reference), len(candidate))
    if steps == 0:
        raise ValueError("loss parity needs at least one step of each curve")
    ref = sum(reference[:steps]) / steps
    got = sum(candidate[:steps]) / steps
    finite = all(math.isfinite(x) for x in candidate[:steps])
    diff = abs(got - ref) / abs(ref) if ref != 0 else abs(got)
    if not finite:
        diff = math.inf
    return Parity(ref, got, diff, finite, finite and diff <= tolerance)


def break_even_steps(one_time_s: float, best_step_s: float, ratio: float) -> float:
    """Steps after which ``one_time_s`` more of one-time cost is repaid by a candidate
    ``ratio`` times the best's throughput, whose steps take ``best_step_s``; inf if never."""
    if one_time_s <= 0:
        return 0.0
    saving = best_step_s * (1 - 1 / ratio) if ratio > 0 else -math.inf
    return one_time_s / saving if saving > 0 else math.inf


@dataclass(frozen=True)
class Job:
    """Seconds the planned job takes with the current best and with a candidate: each side's
    one-time costs plus planned steps x its step time (the candidate's step is the best's over
    the throughput ratio, so that it does the same work when its batches differ)."""

    steps: int
    best_s: float
    candidate_s: float
    extra_one_time_s: float
    break_even: float

    @property
    def faster(self) -> bool:
        return self.candidate_s < self.best_s


def job_times(
    *, steps: int, best_step_s: float, ratio: float, best_one_time_s: float, one_time_s: float
) -> Job:
    """The planned job of ``steps`` steps timed both ways (see :class:`Job`)."""
    extra = one_time_s - best_one_time_s
    return Job(
        steps=steps,
        best_s=best_one_time_s + steps * best_step_s,
        candidate_s=one_time_s + steps * best_step_s / ratio,
        extra_one_time_s=extra,
        break_even=break_even_steps(extra, best_step_s, ratio),
    )


@dataclass(frozen=True)
class Verdict:
    adopt: bool
    reason: str
    #: False when the measurement did not decide: the candidate is undecided, not rejected.
    decided: bool = True


#: An interval spanning more than this factor (two orders of magnitude) bounds nothing worth
#: printing.
WIDEST_SHOWN = 100.0


def describe(speed: RatioEstimate) -> str:
    """``1.31x (1.12-1.52x, 5 rounds)``: the ratio with its decision interval. An interval of
    fewer than ``MIN_ROUNDS`` rounds, or one spanning more than ``WIDEST_SHOWN``, is not shown as
    a measurement (``0.91x after 2 rounds, too few to bound it``)."""
    rounds = f"{speed.rounds} round{'s' if speed.rounds != 1 else ''}"
    if speed.rounds < MIN_ROUNDS:
        return f"{speed.ratio:.2f}x after {rounds}, too few to bound it"
    if not speed.low > 0 or speed.high / speed.low > WIDEST_SHOWN:
        return f"{speed.ratio:.2f}x after {rounds}, its interval too wide to quote"
    return f"{speed.ratio:.2f}x ({speed.low:.2f}-{speed.high:.2f}x, {rounds})"


def judge(
    *,
    speed: RatioEstimate,
    parity: Parity,
    memory_bytes: int | None,
    memory_budget: int | None,
    job: Job,
    tolerance: float,
    must_be_faster: bool = True,
) -> Verdict:
    """Adopt or reject a measured candidate; the reason quotes the numbers that decided.

    ``must_be_faster=False`` is for memory candidates when the current best does not fit the
    budget: then fitting is the gain, and the slowdown is reported rather than disqualifying.
    """
    disqualified = _disqualified(parity, memory_bytes, memory_budget, tolerance)
    if disqualified is not None:
        return disqualified
    if not must_be_faster:
        return Verdict(
            True,
            f"fits the memory budget at {describe(speed)} the speed, loss within "
            f"{100 * parity.relative_diff:.1f}% of fp32",
        )
    if speed.decision == "undecided":
        return Verdict(False, f"undecided: {describe(speed)}", decided=False)
    if speed.decision != "faster":
        return Verdict(False, f"not faster: {describe_futile(speed)}")
    if not job.faster:
        return Verdict(
            False,
            f"does not pay back: {describe(speed)} faster per step, but "
            f"{job.extra_one_time_s:.1f} s more one-time cost needs {_steps(job.break_even)}; "
            f"the {job.steps:,}-step job takes {job.candidate_s:.1f} s with it, "
            f"{job.best_s:.1f} s without",
        )
    return Verdict(
        True,
        f"{describe(speed)} faster, loss within {100 * parity.relative_diff:.1f}% of fp32; "
        f"the {job.steps:,}-step job {job.best_s:.1f} s -> {job.candidate_s:.1f} s "
        f"(pays back after {_steps(job.break_even)})",
    )


def _disqualified(
    parity: Parity, memory_bytes: int | None, memory_budget: int | None, tolerance: float
) -> Verdict | None:
    """The rejection of a candidate whose loss strays or whose step is over the budget."""
    if not parity.finite:
        return Verdict(False, "loss parity: the loss became non-finite")
    if not parity.ok:
        return Verdict(
            False,
            f"loss parity: {100 * parity.relative_diff:.1f}% from fp32 > "
            f"{100 * tolerance:.1f}% tolerance ({parity.loss:.4f} vs {parity.reference_loss:.4f})",
        )
    if memory_budget is not None and memory_bytes is not None and memory_bytes > memory_budget:
        return Verdict(
            False, f"memory: {format_bytes(memory_bytes)} > budget {format_bytes(memory_budget)}"
        )
    return None


def judge_against_leader(
    *,
    speed: RatioEstimate,
    parity: Parity,
    memory_bytes: int | None,
    memory_budget: int | None,
    job: Job,
    tolerance: float,
    leader: str,
) -> Verdict:
    """Adopt an alternative of a lever in place of its ``leader`` (already faster than the best)
    when its job is the shorter at the measured ratio, one-time costs included: a race between
    two qualified alternatives picks one either way, and one within the noise of the other will
    do (:func:`head_to_head_decided` ends the rounds)."""
    disqualified = _disqualified(parity, memory_bytes, memory_budget, tolerance)
    if disqualified is not None:
        return disqualified
    jobs = (
        f"the {job.steps:,}-step job takes {job.candidate_s:.1f} s with it, {job.best_s:.1f} s "
        f"with {leader}, one-time costs included"
    )
    if job.faster:
        return Verdict(True, f"ahead of {leader} head to head: {describe(speed)}; {jobs}")
    return Verdict(False, f"{leader} stays ahead: this measured {describe(speed)}; {jobs}")


def _steps(break_even: float) -> str:
    return "never" if break_even == math.inf else f"{break_even:,.0f} steps"


def describe_futile(speed: RatioEstimate) -> str:
    """``0.94x in 3 rounds: gains less than 5% (at most 1.01x at 95% confidence)``: a "not
    faster" decision with the bound that decided it, not the 99.9% interval an adoption must
    clear (which may still reach past 1.25x when the 95% bound is below 1.05x)."""
    rounds = f"{speed.rounds} round{'s' if speed.rounds != 1 else ''}"
    bound = f"at most {speed.plausible_high:.2f}x at {FUTILITY_CONFIDENCE:.0%} confidence"
    if speed.plausible_high >= 1 + WORTH_MEASURING:  # stopped as hopeless: every round far slower
        return f"{speed.ratio:.2f}x in {rounds}, each round far slower"
    if speed.plausible_high < 1:
        return f"{speed.ratio:.2f}x in {rounds}: is slower ({bound})"
    return f"{speed.ratio:.2f}x in {rounds}: gains less than {WORTH_MEASURING:.0%} ({bound})"


def head_to_head_decided(ratios: Sequence[float]) -> bool:
    """Two configs raced for the faster: either is faster beyond the noise, or each is "not
    faster" than the other (within ``WORTH_MEASURING`` both ways, so either will do)."""
    ahead = estimate(ratios)
    behind = estimate([1 / r for r in ratios])
    if "faster" in (ahead.decision, behind.decision):
        return True
    return ahead.decision == behind.decision == "not faster"


def order_known(
    lead: RatioEstimate, lead_job_s: float, rival: RatioEstimate, rival_job_s: float
) -> bool | None:
    """Whether ``rival`` is ahead of ``lead``, when their measurements against the same best
    already tell: their intervals apart, and the one faster per step also the one whose job is
    shorter (one-time costs included). None when only a race can tell."""
    apart = rival.high < lead.low or rival.low > lead.high
    ahead = rival.ratio > lead.ratio
    quicker = rival_job_s <= lead_job_s
    return ahead if apart and ahead == quicker else None


def judge_race(
    job: Job,
    forward: RatioEstimate,
    forward_ratios: Sequence[float],
    backward: RatioEstimate,
    backward_ratios: Sequence[float],
) -> tuple[bool, str]:
    """(whether the challenger wins, why) after a head-to-head race: ``job`` and ``forward`` are
    the challenger against the leader, ``backward`` the same rounds read the other way. The
    winner makes the job faster: with equal one-time costs the faster step, else the one whose
    one-time cost its steps repay. Why is said by the loser's figures against the winner (those
    its row shows)."""
    wins = job.faster
    beaten, beaten_ratios = (backward, backward_ratios) if wins else (forward, forward_ratios)
    if wins != (forward.ratio > 1):  # the one-time costs decided
        return wins, (
            f"makes the {job.steps:,}-step job faster ({min(job.best_s, job.candidate_s):.0f} s "
            f"against {max(job.best_s, job.candidate_s):.0f} s, one-time costs included)"
        )
    if beaten.high < 1:
        return wins, "is faster"
    if head_to_head_decided(beaten_ratios):
        return wins, f"is ahead, and within {WORTH_MEASURING:.0%} either way"
    return wins, "is ahead, not beyond the noise"


Confirmed = Literal["confirmed", "consistent", "contradicted"]


def confirmation_target(searched: float, must_fit: bool) -> float:
    """The ratio over the baseline a confirmation checks for: what the search's adoptions
    multiply to, and at least 1 unless the baseline does not fit the memory budget (then a slower
    config that fits is the point)."""
    return searched if must_fit else max(searched, 1.0)


def judge_confirmation(speed: RatioEstimate, target: float) -> Confirmed:
    """The chosen config against the baseline: confirmed when faster beyond the noise,
    consistent while ``target`` is still plausible (the rounds could not decide it), contradicted
    once it is not."""
    if speed.decision == "faster":
        return "confirmed"
    if speed.plausible_high >= target:
        return "consistent"
    return "contradicted"


def holds_alone(speed: RatioEstimate) -> bool:
    """An adoption re-measured alone against the baseline (after the whole was contradicted), or
    the survivors together: kept only when faster beyond the noise."""
    return speed.decision == "faster"
