"""Tuning inside the run (``[tune] in_run``): the job's own steps are the measurement.

**Where the run starts.** Before the first step, :func:`start_from_facts` lets facts measured in
seconds choose the starting configuration: each tuner stage whose prior is such a fact
(``Stage.from_facts``: a precision's matrix-product rate here, the padding the data's lengths
imply, the LM head's logits against what a two-sample forward holds) proposes its candidates,
and the one expected to gain most, by at least ``START_GAIN``, is taken, unless the user's
config already sets that technique. So the job starts where the trainer's obvious setting would
(bf16 where bf16 is measured fast, length buckets where lengths pad heavily), or further.

**Measured on real steps.** :class:`InRunTuner` then measures, on the job's own steps, each
choice the host can switch per window (``registry.switchable_per_step``: step hooks, process-wide
switches, transforms with a ``toggle``): those started, and the trials, choices the facts
expected a gain of under ``START_GAIN``. Accumulation windows alternate between the run's config
with the choice and without it, in the order ABBA, and each pair gives a ratio. Every measured
window trains the model. Before the side that has not trained yet first does, both sides'
losses on the same batch must agree within ``LOSS_TOLERANCE``. Consecutive batches differ, and
a step's seconds are not proportional to its work (the elements of the batch's largest tensor:
padded tokens, pixels), so each window is scaled by a cost model fitted to every timed window of
the comparison, seconds = a + b x work (:func:`cost_model`), before the sides are compared. The
ratios are judged by the tuner's rules (``framework.decide.estimate``): faster keeps the choice,
not faster drops it, and undecided (the slower side may use at most ``[tune] measure_share`` of
the job's steps) keeps what the facts chose.

**The batch plan, on chunks of the epoch.** A plan cannot switch per window: it decides which
samples share a batch. A host that batches its epochs by chunks (``data/chunked_plan.py``: the
engine, in one process, on a map-style dataset with lengths) passes ``measure_plan``: a plan
the facts expect less than ``PLAN_MEASURED_BELOW`` of is then measured on whole chunks of the
epoch, each batched by the plan or by the user's rows as :meth:`InRunTuner.draw` names it when
the loader reaches it, the sides ABBA once no window comparison or build runs; pairs of chunks
are compared on seconds per real token (:class:`ChunkClock`). Every sample is still trained once
per epoch and each chunk keeps the user's real tokens per step; once decided, the rest of the
epoch is batched by the verdict. Elsewhere, and where the facts expect more, the plan stays as
they chose it.

**torch.compile, built aside.** A host that can (the engine, in one process) passes
``build_aside``: the choices whose cold cost must stay off the critical path
(``Technique.built_aside``: a compile) are then trials too. Once
the other comparisons are decided, and where the job's steps left would save more than the build
is expected to take (:meth:`InRunTuner.to_build`), the host compiles a copy of the model in a
background thread (``engine/build_aside.py``); the comparison waits until the build is done and
is then measured like any other, its transform switched by its toggle.

Under torchrun every rank runs the same sides and the windows' costs are the slowest rank's
(one all-reduce per measured window), so every rank decides alike. The hosts (``Turbo``,
``TurboLightningCallback``, ``TurboTrainer``) call :func:`start`, compose ``composed_config()``
and run each window on the config their :class:`WindowClock` opens it with.

Written here rather than taken from a library: no tuner we know of measures on the job's own
steps (DeepSpeed's autotuner runs separate trials; Lightning's and Accelerate's finders only
shrink the batch on out-of-memory).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
import time
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

from torchturbo.base.nested import iter_tensors
from torchturbo.config import TurboConfig
from torchturbo.data.chunked_plan import MEASURE_BATCHES, Chunk, Draw
from torchturbo.engine.build_aside import Build
from torchturbo.measure.timing import sync
from torchturbo.output.results_file import write_atomic, write_results
from torchturbo.recipe import Recipe
from torchturbo.techniques import registry
from torchturbo.techniques.framework.decide import (
    MIN_ROUNDS,
    RatioEstimate,
    describe,
    estimate,
    loss_parity,
    rounds_to_decide,
)
from torchturbo.techniques.framework.facts import Facts, before_training
from torchturbo.techniques.framework.proposal import StageContext
from torchturbo.techniques.framework.spec import Technique

#: Samples in the batch whose forward measures the logits' share (it is a share: a few do).
CENSUS_SAMPLES = 2
#: A start is taken only where the facts expect at least this gain: below it the noise of a
#: prior is larger than the gain, and the measurement would only undo it.
START_GAIN = 1.10
#: Losses on the same batch may differ by this share between the two sides (the tuner's default).
LOSS_TOLERANCE = 0.05
#: Windows of each side run untimed before its first paired round: the first carries one-time
#: costs (autocast's weight casts, allocator growth).
WARM_WINDOWS = 1
#: The job's steps assumed when the host does not say how many it will train.
ASSUMED_STEPS = 300
#: Timed windows of the run whose median is its step time, for the gate of a build aside.
RECENT_WINDOWS = 8
#: Optimizer steps a choice built aside needs left when its build starts: the build's own
#: (a compile takes tens of the job's steps on a CPU), then its paired windows.
BUILD_WINDOWS = 20 * (MIN_ROUNDS + WARM_WINDOWS)
#: A batch plan is measured on the job's steps only where the facts expect less than this of it:
#: its side without the plan costs (gain - 1) x its chunks, more than a larger gain could show.
PLAN_MEASURED_BELOW = 1.5
#: What a run that tuned inside itself keeps, as ``tune`` does: every verdict, the decided config.
RESULTS = "results.json"
CONFIG = "turbo.toml"

Verdict = Literal["measuring", "adopted", "dropped", "undecided", "loss differs", "waiting"]
Side = Literal["with", "without"]


@dataclass(frozen=True)
class Start:
    """One candidate a from-facts stage proposed, and whether the run started with it."""

    name: str
    stage: str
    expected_gain: float | None
    evidence: str
    taken: bool
    #: Why it was not taken ("" when taken).
    why_not: str = ""
    #: Not taken, but its lever's leader and expected to gain, under ``START_GAIN``: measured on
    #: the job's steps where a step can switch it.
    trial: bool = False
    #: The techniques it changes, and their fields as it sets them (``TurboConfig.replace``
    #: keywords).
    techniques: tuple[str, ...] = ()
    settings: dict[str, Any] = field(default_factory=dict)
    #: Built off the critical path before it is measured (a compile: ``engine/build_aside.py``),
    #: and the seconds its build is expected to take from the job.
    built_aside: bool = False
    build_cost_s: float = 0.0


def start(
    config: TurboConfig,
    model: nn.Module | None,
    device: torch.device,
    *,
    data: Dataset | None,
    lengths: Sequence[int] | None,
    batch_size: int,
    seed: int,
    planned_steps: int | None,
    switchable: Callable[[TurboConfig, TurboConfig], bool] = registry.switchable_per_step,
    forward: Callable[[], Any] | None = None,
    build_aside: bool = False,
    measure_plan: bool = False,
) -> InRunTuner:
    """The in-run tuner of a run of ``model`` on ``data`` (``lengths`` per sample, None where
    not known), its start chosen by the facts measured here now; every host calls this.
    ``switchable(with, without)``: whether this host can switch between them per window (the
    engine: ``registry.switchable_per_step``; a trainer with its own autocast: transforms
    only, ``registry.switchable_by_toggle``).
    ``forward()``: one forward of the model on a small batch, which measures the LM head's
    logits' share of the activations (``facts.before_training``). ``build_aside``: the host
    can build a choice off the critical path (``engine/build_aside.py``), so that the choices
    whose cold cost must stay off it (a compile: ``Technique.built_aside``) are trials too.
    ``measure_plan``: the host batches its epochs by chunks (``data/chunked_plan.py``), so a
    batch plan the facts expect little of is measured too (:func:`plan_measurable`)."""
    known = Recipe(
        name="this run",
        model=(lambda: model) if model is not None else _unknown,
        optimizer=_unknown,
        loss_fn=_unknown,
        # A manual loop (no data given): one unknown sample, never read.
        dataset=data if data is not None else typing.cast(Dataset, [None]),
        batch_size=batch_size,
        lengths=lengths,
        seed=seed,
    )
    found = before_training(model, device, lengths, batch_size, seed, forward)
    started, starts = start_from_facts(config, found, known, device)
    if build_aside:
        starts += aside_starts(config, started, found)
    comparisons = comparisons_for(started, config, starts, switchable, measure_plan)
    trials = {c.name for c in comparisons if not c.started}
    tuner = InRunTuner(started, starts, comparisons, planned_steps=planned_steps, device=device)
    for entry in starts:
        said = "started with" if entry.taken else f"not started ({entry.why_not})"
        then = "; it is measured on the job's steps" if entry.name in trials else ""
        tuner.events.append(f"in-run: {entry.name} {said}: {entry.evidence}{then}")
    return tuner


def _unknown(*args: Any) -> Any:
    """The loss and optimizer of a run are not known when its start is chosen; the stages that
    choose it read facts only."""
    raise RuntimeError("tuning inside the run: its start reads facts, not the loss or optimizer")


def start_from_facts(
    config: TurboConfig, facts: Facts, recipe: Recipe, device: torch.device
) -> tuple[TurboConfig, list[Start]]:
    """The config the run starts from and every candidate considered (module docstring)."""
    best, starts = config, []
    for stage in registry.stages():
        if not stage.from_facts:
            continue
        context = StageContext(recipe, best, device, facts, None, None)
        proposed = stage.propose(context)
        if isinstance(proposed, str):
            continue
        gains = {c.name: c.expected_gain or 0.0 for c in proposed if c.not_applicable is None}
        leader = max(gains, key=lambda name: gains[name], default=None)
        for candidate in proposed:
            changed = registry.changed_techniques(best, candidate.config)
            why_not = _why_not(candidate.name, leader, gains, config, changed)
            trial = why_not == _under_start(gains.get(candidate.name, 0.0)) and (
                gains[candidate.name] > 1.0
            )
            starts.append(
                Start(
                    candidate.name,
                    stage.name,
                    candidate.expected_gain,
                    candidate.not_applicable or candidate.evidence,
                    taken=not why_not,
                    why_not=why_not,
                    trial=trial,
                    techniques=tuple(t.name for t in changed),
                    settings=_fields_of(candidate.config, changed),
                )
            )
            if not why_not:
                best = candidate.config
    return best, starts


def aside_starts(user: TurboConfig, started: TurboConfig, facts: Facts) -> list[Start]:
    """The trials built aside (``Technique.built_aside``: a compile) from the ``started``
    config, unless the ``user``'s config sets their techniques itself. Never a start: their
    cold cost comes before their first step, so they must pay back, which only the job's steps
    can tell."""
    starts = []
    for _, aside in registry.aside_candidates(started, facts):
        candidate = aside.candidate
        changed = registry.changed_techniques(started, candidate.config)
        set_by_user = [t.name for t in changed if t.changed_fields(user)]
        starts.append(
            Start(
                candidate.name,
                candidate.name,
                candidate.expected_gain,
                candidate.not_applicable or candidate.evidence,
                taken=False,
                why_not=(
                    f"the config sets {', '.join(set_by_user)} itself"
                    if set_by_user
                    else "built aside, then measured"
                ),
                trial=not set_by_user and candidate.not_applicable is None,
                techniques=tuple(t.name for t in changed),
                settings=_fields_of(candidate.config, changed),
                built_aside=True,
                build_cost_s=aside.build_s,
            )
        )
    return starts


def _fields_of(config: TurboConfig, owners: Sequence[Technique]) -> dict[str, Any]:
    """The fields of ``owners`` as ``config`` sets them, as ``TurboConfig.replace`` keywords."""
    return {
        f"{entry.section}__{name}": getattr(config.section(entry.section), name)
        for entry in owners
        for name in entry.owned_fields(config)
    }


def _why_not(
    name: str,
    leader: str | None,
    gains: dict[str, float],
    user: TurboConfig,
    changed: list[Technique],
) -> str:
    if name not in gains:
        return "not applicable here"
    if not changed:
        return "the config already has it"
    set_by_user = [t.name for t in changed if t.changed_fields(user)]
    if set_by_user:
        return f"the config sets {', '.join(set_by_user)} itself"
    if name != leader:
        return f"{leader} is expected to gain more"
    if gains[name] < START_GAIN:
        return _under_start(gains[name])
    return ""


def _under_start(gain: float) -> str:
    return f"expected {gain:.2f}x, under the {START_GAIN:.2f}x a start needs"


def work_of(batch: Any) -> int:
    """A batch's work: the elements of its largest tensor (padded tokens, pixels)."""
    return max((t.numel() for t in iter_tensors(batch)), default=1) or 1


@dataclass
class Comparison:
    """One choice measured on the job's steps: the run's config with it against without it.

    ``on`` and ``off`` are its fields with and without it (``TurboConfig.replace`` keywords),
    applied to the config the run has then, so that an earlier verdict carries over. A started
    choice is the run's until measured otherwise; a trial (one the facts expected too little of
    to start with) is not until measured faster."""

    name: str
    on: dict[str, Any]
    off: dict[str, Any]
    started: bool = True
    verdict: Verdict = "waiting"
    #: Per pair: (work, seconds) of the window with the choice, then of the one without it.
    pairs: list[tuple[int, float, int, float]] = field(default_factory=list)
    evidence: str = ""
    #: Windows each side ran so far (the first ``WARM_WINDOWS`` of each are not timed).
    windows: dict[str, int] = field(default_factory=lambda: {"with": 0, "without": 0})
    parity_checked: bool = False
    #: Built aside before it is measured (``Start.built_aside``): its build, once started, and
    #: the seconds the build took, once done.
    built_aside: bool = False
    build: Build | None = field(default=None, repr=False, compare=False)
    built_seconds: float | None = None
    #: The gain the facts expected, and the seconds a build aside is expected to take.
    expected_gain: float | None = None
    build_cost_s: float = 0.0
    #: A batch plan, measured on chunks of the epoch (``data/chunked_plan.py``): each pair's
    #: work is the real tokens of a chunk, its seconds the chunk's.
    per_token: bool = False

    @property
    def ratios(self) -> list[float]:
        """Per pair: the cost without the choice over the cost with it, each window's seconds
        over the cost model's for its work (> 1: the choice is faster). A batch plan changes the
        work itself (its padding), so its sides are compared on seconds per real token."""
        if self.per_token:
            return [
                (without_s / without_tokens) / (with_s / with_tokens)
                for with_tokens, with_s, without_tokens, without_s in self.pairs
            ]
        model = cost_model([(w, t) for pair in self.pairs for w, t in (pair[:2], pair[2:])])
        return [
            (without_s / model(without_work)) / (with_s / model(with_work))
            for with_work, with_s, without_work, without_s in self.pairs
        ]

    def speed(self) -> RatioEstimate | None:
        return estimate(self.ratios) if self.pairs else None

    def row(self) -> dict[str, Any]:
        """Its line of results.json."""
        speed = self.speed()
        return {
            "name": self.name,
            "started": self.started,
            "verdict": self.verdict,
            "evidence": self.evidence,
            "ratio": None if speed is None else speed.ratio,
            "low": None if speed is None else speed.low,
            "high": None if speed is None else speed.high,
            "pairs": len(self.pairs),
            "windows": dict(self.windows),
            "built_aside_s": self.built_seconds,
            "on_chunks": self.per_token,
        }


class InRunTuner:
    """Chooses each accumulation window's side and judges the pairs (module docstring).

    The engine asks :meth:`side` when a window opens and reports its seconds and work with
    :meth:`window_done` when it closes; :attr:`config` is the config training runs now.
    """

    def __init__(
        self,
        config: TurboConfig,
        starts: list[Start],
        comparisons: list[Comparison],
        *,
        planned_steps: int | None,
        device: torch.device,
    ) -> None:
        self.config = config
        self.starts = starts
        self.comparisons = comparisons
        self.planned_steps = planned_steps
        self.device = device
        self.events: list[str] = []
        #: Windows run on the slower side of a comparison so far, all comparisons together.
        self.spent_windows = 0
        #: Windows the run trained so far, measured or not.
        self.windows_run = 0
        #: Comparisons built aside whose build is done, as ``side`` last saw them: the others
        #: wait, so that no window changes comparison while it runs.
        self._built: set[str] = set()
        #: Seconds of the last timed windows of the run's config (with the choice measured).
        self._recent_s: collections.deque[float] = collections.deque(maxlen=RECENT_WINDOWS)
        self._round: dict[Side, tuple[int, float]] = {}
        #: The chunks drawn in the epoch in progress (``draw``), and the measuring chunks drawn
        #: in the whole run, whose count sets the next one's side.
        self._draws: tuple[int, list[Draw]] = (-1, [])
        self._measure_draws = 0
        #: Loader batches per window (the host's accumulation): a chunk's batches in windows.
        self.batches_per_window = 1

    @property
    def current(self) -> Comparison | None:
        """The comparison measured per window, or None once all are decided (or wait for a
        build)."""
        return next(
            (
                c
                for c in self.comparisons
                if c.verdict in ("waiting", "measuring")
                and not c.per_token
                and (not c.built_aside or c.name in self._built)
            ),
            None,
        )

    @property
    def plan(self) -> Comparison | None:
        """The batch plan measured on chunks of the epoch, if any (``draw``)."""
        return next((c for c in self.comparisons if c.per_token), None)

    def draw(self, epoch: int, index: int) -> Draw:
        """Chunk ``index`` of ``epoch`` (``data/chunked_plan.py``): a measuring chunk of the
        plan's next side (ABBA) while the plan is measured and nothing else is (no window
        compared, no build running), else the run's plan: in holding chunks until the plan is
        measured, then the rest of the epoch at once. A chunk drawn once is drawn again alike
        (a resumed epoch is drawn again from its start)."""
        drawn_epoch, draws = self._draws
        if drawn_epoch != epoch:
            draws = []
            self._draws = (epoch, draws)
        if index < len(draws):
            return draws[index]
        comparison = self.plan
        assert comparison is not None, "draw() is for a run whose batch plan is measured"
        free = not self._busy()
        if comparison.verdict == "waiting" and free:
            self._start_plan(comparison)
        side: Side = "with" if self._measure_draws % 4 in (0, 3) else "without"
        if comparison.verdict == "measuring" and free and side == "without":
            self._charge_rows_chunk(comparison)
        has_it = self.config.replace(**comparison.on) == self.config
        run_side: Side = "with" if has_it else "without"
        if comparison.verdict == "measuring" and free:
            self._measure_draws += 1
            draw = Draw(side, "measure")
        elif comparison.verdict in ("waiting", "measuring"):
            draw = Draw(run_side, "hold")
        else:
            draw = Draw(run_side, "rest")
        draws.append(draw)
        return draw

    @property
    def _chunk_windows(self) -> int:
        """The windows a measuring chunk takes."""
        return math.ceil(MEASURE_BATCHES / self.batches_per_window)

    def _charge_rows_chunk(self, comparison: Comparison) -> None:
        """Count a measuring chunk of rows against the share of the job the slower side may
        take as it is drawn, so that no chunk runs past it; where it would, the plan is
        undecided, kept as the facts chose."""
        if self.spent_windows + self._chunk_windows <= self.budget_windows:
            self.spent_windows += self._chunk_windows
            return
        speed = comparison.speed()
        measured = "not measured" if speed is None else describe(speed)
        self._decide(comparison, "undecided", f"{measured}; kept as the facts chose")

    def _start_plan(self, comparison: Comparison) -> None:
        """Measure the plan on chunks from now, where the share of the job the slower side may
        take holds its warm chunk and ``MIN_ROUNDS`` more (else undecided, as the facts chose)."""
        needed = self._chunk_windows * (WARM_WINDOWS + MIN_ROUNDS)
        left = self.budget_windows - self.spent_windows
        if left < needed:
            self._decide(
                comparison,
                "undecided",
                f"its chunks of your rows need {needed} steps, more than the {left} left of the "
                "job's share for measuring ([tune] measure_share); kept as the facts chose",
            )
            return
        comparison.verdict = "measuring"
        self.events.append(
            f"in-run: measuring {comparison.name} on chunks of the epoch, paired with chunks of "
            "your rows; compared per real token"
        )

    def _busy(self) -> bool:
        """Whether a comparison other than the plan is measured or built now."""
        return any(
            c.verdict in ("waiting", "measuring")
            and not c.per_token
            and (not c.built_aside or c.build is not None)
            for c in self.comparisons
        )

    def chunk_done(self, chunk: Chunk, seconds: float) -> None:
        """Record a measuring chunk trained whole in ``seconds`` (the first of each side warms)."""
        comparison = self.plan
        if comparison is None or comparison.verdict != "measuring" or not chunk.measured:
            return
        side = chunk.side
        warm = comparison.windows[side] < WARM_WINDOWS
        comparison.windows[side] += 1
        if warm:
            return
        self._round[side] = (chunk.real_tokens, seconds)
        if len(self._round) == 2:
            comparison.pairs.append((*self._round["with"], *self._round["without"]))
            self._round = {}
            self._judge(comparison)

    @property
    def timing(self) -> bool:
        """Whether the window now opening is timed: a comparison is measured, or one to build
        aside waits for the job's step time (``to_build``)."""
        return self.current is not None or self._awaiting_build() is not None

    def _awaiting_build(self) -> Comparison | None:
        return next(
            (
                c
                for c in self.comparisons
                if c.built_aside and c.build is None and c.verdict in ("waiting", "measuring")
            ),
            None,
        )

    def to_build(self) -> Comparison | None:
        """A comparison to build aside now (the host starts its build and sets ``build``), or
        None. Its build waits for the other comparisons to be decided (it would take the CPU
        their windows are timed on) and for a timed window of the run; it is not built, and is
        undecided, where the job's steps left would not pay for it: too few to measure it after
        the build (``BUILD_WINDOWS``), or saving, at the gain the facts expect, less than the
        seconds the build is expected to take from the job."""
        comparison = self._awaiting_build()
        others = any(
            c.verdict in ("waiting", "measuring") and not c.built_aside for c in self.comparisons
        )
        if comparison is None or others or not self._recent_s:
            return None
        left = (self.planned_steps or ASSUMED_STEPS) - self.windows_run
        window_s = statistics.median(self._recent_s)
        gain = comparison.expected_gain or 1.0
        saving = left * window_s * (1 - 1 / gain) if gain > 1 else 0.0
        why_not = ""
        if left < BUILD_WINDOWS:
            why_not = f"too few to build it aside and measure it ({BUILD_WINDOWS} needed)"
        elif saving < comparison.build_cost_s:
            why_not = (
                f"at {window_s:.3g} s a step and the {gain:.2f}x the facts expect they would "
                f"save ~{saving:.0f} s, less than the ~{comparison.build_cost_s:.0f} s its "
                "build is expected to take"
            )
        if why_not:
            self._decide(comparison, "undecided", f"{left} of the job's steps left: {why_not}")
            return None
        self.events.append(f"in-run: building {comparison.name} aside while the job trains")
        return comparison

    def _settle_builds(self) -> None:
        """Take up the builds done since the last window: a failed one is dropped."""
        for comparison in self.comparisons:
            build = comparison.build
            if build is None or comparison.name in self._built or not build.done.is_set():
                continue
            self._built.add(comparison.name)
            comparison.built_seconds = build.seconds
            if build.error:
                self._decide(comparison, "dropped", build.error)
            else:
                self.events.append(
                    f"in-run: {comparison.name} built aside in {build.seconds:.1f} s"
                )

    @property
    def budget_windows(self) -> int:
        """Windows the side without the choice may run, over the whole job."""
        steps = self.planned_steps or ASSUMED_STEPS
        share = self.config.tune.measure_share
        return max(2 * MIN_ROUNDS + WARM_WINDOWS, math.floor(share * steps))

    def side(self, parity: Callable[[TurboConfig, TurboConfig], tuple[float, float]]) -> Side:
        """The side the window now opening runs. ``parity(with, without)`` returns both sides'
        losses on this window's first batch; it is called once per comparison, before the side
        without the choice first trains."""
        self._settle_builds()
        comparison = self.current
        if comparison is None:
            return "with"
        if not comparison.parity_checked:
            comparison.parity_checked = True
            with_loss, without_loss = parity(
                self.config.replace(**comparison.on), self.config.replace(**comparison.off)
            )
            check = loss_parity([without_loss], [with_loss], LOSS_TOLERANCE)
            if not check.ok:
                why = (
                    f"loss {check.loss:.4g} against {check.reference_loss:.4g} without it on "
                    f"the same batch ({check.relative_diff:.1%} > {LOSS_TOLERANCE:.0%})"
                )
                self._decide(comparison, "loss differs", why)
                return self.side(parity)
            comparison.verdict = "measuring"
            self.events.append(
                f"in-run: measuring {comparison.name} on the job's steps, paired with windows "
                "without it"
            )
        # ABBA: windows 0,3 with the choice, 1,2 without, and so on.
        position = sum(comparison.windows.values()) % 4
        return "with" if position in (0, 3) else "without"

    def window_done(self, side: Side, seconds: float, work: int) -> None:
        """Record a closed window of ``side`` that took ``seconds`` for ``work`` (module
        docstring: the slowest rank's cost under torchrun)."""
        comparison = self.current
        if side == "with":
            self._recent_s.append(seconds)
        if comparison is None or comparison.verdict != "measuring":
            return
        seconds = _slowest_rank(seconds, self.device)
        warm = comparison.windows[side] < WARM_WINDOWS
        comparison.windows[side] += 1
        if side == "without":
            self.spent_windows += 1
        if warm:
            return
        self._round[side] = (work, seconds)
        if len(self._round) < 2:
            return
        comparison.pairs.append((*self._round["with"], *self._round["without"]))
        self._round = {}
        self._judge(comparison)

    def _judge(self, comparison: Comparison) -> None:
        speed = estimate(comparison.ratios)
        left = self.budget_windows - self.spent_windows
        if speed.decision == "faster":
            self._decide(comparison, "adopted", describe(speed))
        elif speed.decision == "not faster":
            self._decide(comparison, "dropped", describe(speed))
        elif (left <= 0 and not comparison.per_token) or _hopeless(
            speed, comparison.ratios, self._pairs_left(comparison)
        ):
            self._decide(comparison, "undecided", f"{describe(speed)}; kept as the facts chose")

    def _pairs_left(self, comparison: Comparison) -> int:
        """Pairs the slower side's share of the job has left: a window each, or a chunk."""
        left = self.budget_windows - self.spent_windows
        return left // self._chunk_windows if comparison.per_token else left

    def _decide(self, comparison: Comparison, verdict: Verdict, evidence: str) -> None:
        comparison.verdict = verdict
        comparison.evidence = evidence
        self._round = {}
        if verdict == "adopted":
            self.config = self.config.replace(**comparison.on)
        elif verdict in ("dropped", "loss differs"):
            self.config = self.config.replace(**comparison.off)
        self.events.append(f"in-run: {comparison.name} {verdict}: {evidence}")

    def config_of(self, side: Side) -> TurboConfig:
        """The config a window of ``side`` runs: the run's, with or without the choice being
        measured."""
        comparison = self.current
        if comparison is None:
            return self.config
        return self.config.replace(**(comparison.on if side == "with" else comparison.off))

    def composed_config(self) -> TurboConfig:
        """The config the model is composed with: the run's, with every choice still to be
        measured on (a transform to switch must be there; ``registry.set_toggles`` then
        switches it per window)."""
        config = self.config
        for comparison in self.comparisons:
            if comparison.verdict in ("waiting", "measuring") and not comparison.per_token:
                config = config.replace(**comparison.on)
        return config

    def results(self) -> dict[str, Any]:
        """What results.json records: the start and every verdict."""
        return {
            "start": [dataclasses.asdict(s) for s in self.starts],
            "measured": [c.row() for c in self.comparisons],
            "spent_windows": self.spent_windows,
            "budget_windows": self.budget_windows,
        }

    def write(self, directory: str | Path) -> Path:
        """Keep what was decided in ``directory`` (made if missing): ``results.json``, the start
        and every verdict, and ``turbo.toml``, the decided config, which the next run trains as
        it is (its ``[tune] in_run`` off: the measuring is done). Returns the config's path."""
        directory = Path(directory)
        decided = self.config.replace(tune__in_run=False)
        write_results(directory / RESULTS, {**self.results(), "config": decided.to_dict()})
        path = directory / CONFIG
        write_atomic(path, decided.to_toml().encode())
        return path

    def state_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(),
            "spent_windows": self.spent_windows,
            "windows_run": self.windows_run,
            "draws": {
                "epoch": self._draws[0],
                "chunks": [[d.side, d.size] for d in self._draws[1]],
                "measured": self._measure_draws,
            },
            "comparisons": [
                {
                    "name": c.name,
                    "verdict": c.verdict,
                    "pairs": [list(pair) for pair in c.pairs],
                    "evidence": c.evidence,
                    "windows": dict(c.windows),
                    "parity_checked": c.parity_checked,
                    "built_seconds": c.built_seconds,
                }
                for c in self.comparisons
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a resumed run's measuring where it stopped: verdicts, pairs, spent windows.
        A comparison this run does not have (the facts chose another start) is dropped."""
        self.config = TurboConfig.from_dict(state["config"])
        self.spent_windows = state["spent_windows"]
        self.windows_run = state.get("windows_run", 0)
        draws = state.get("draws") or {"epoch": -1, "chunks": [], "measured": 0}
        self._draws = (draws["epoch"], [Draw(side, size) for side, size in draws["chunks"]])
        self._measure_draws = draws["measured"]
        saved = {entry["name"]: entry for entry in state["comparisons"]}
        for comparison in self.comparisons:
            entry = saved.get(comparison.name)
            if entry is None:
                continue
            comparison.verdict = entry["verdict"]
            comparison.pairs = [tuple(pair) for pair in entry["pairs"]]
            comparison.evidence = entry["evidence"]
            comparison.windows = dict(entry["windows"])
            comparison.parity_checked = entry["parity_checked"]
            comparison.built_seconds = entry.get("built_seconds")
        self._round = {}


class WindowClock:
    """A host's windows for its in-run tuner: :meth:`open` as a window's first batch arrives
    names the config it runs (the host applies it), :meth:`add` counts each batch's work, and
    :meth:`close` at its optimizer step times a measured window (the device synchronized at
    both ends) and hands it to the tuner. One clock for the engine and both trainers."""

    def __init__(self, tuner: InRunTuner, device: torch.device) -> None:
        self.tuner, self.device = tuner, device
        #: The open window's side, its start (perf_counter; None: not timed) and its work.
        self._open: tuple[Side, float | None, int] | None = None

    @property
    def is_open(self) -> bool:
        return self._open is not None

    def open(
        self,
        parity: Callable[[TurboConfig, TurboConfig], tuple[float, float]],
        held: bool = False,
    ) -> TurboConfig:
        """Open a window (``parity`` as :meth:`InRunTuner.side` takes it); the config it runs.
        ``held``: its batches measure the batch plan (``ChunkClock``), so it runs the run's
        config with the choice, untimed."""
        if held:
            self._open = ("with", None, 0)
            return self.tuner.config_of("with")
        timing = self.tuner.timing
        side = self.tuner.side(parity)
        started = None
        if timing and self.tuner.timing:
            sync(self.device)
            started = time.perf_counter()
        self._open = (side, started, 0)
        return self.tuner.config_of(side)

    def add(self, batch: Any) -> None:
        if self._open is not None and self._open[1] is not None:
            side, started, work = self._open
            self._open = (side, started, work + work_of(batch))

    def close(self) -> None:
        if self._open is None:
            return
        side, started, work = self._open
        self._open = None
        self.tuner.windows_run += 1
        if started is not None:
            sync(self.device)
            self.tuner.window_done(side, time.perf_counter() - started, work)


class ChunkClock:
    """Times the measuring chunks of a run batched by chunks (``data/chunked_plan.py``): from
    the arrival of a chunk's first batch to the end of its last batch's step (the device
    synchronized at both ends only), its batches' loading between steps included, and the
    seconds its plan took to batch it added in place of the batching of others that the loader
    did ahead inside it. Handed to :meth:`InRunTuner.chunk_done` only for a chunk trained whole
    from its first batch (a resume that lands inside one skips it)."""

    def __init__(self, tuner: InRunTuner, device: torch.device) -> None:
        self.tuner, self.device = tuner, device
        #: The measuring chunk being timed: the chunk, its start, the sampler's planning
        #: seconds then, and its batches stepped so far.
        self._open: tuple[Chunk, float, float, int] | None = None
        #: Whether the batch last arrived belongs to a measuring chunk.
        self.measuring = False

    def arrive(self, chunk: Chunk | None, position: int, planning_s: float) -> None:
        """The epoch's ``position``-th batch, of ``chunk``, arrives for its step;
        ``planning_s``: the sampler's batching seconds so far."""
        self.measuring = chunk is not None and chunk.measured
        if chunk is None or not self.measuring:
            self._open = None
        elif position == chunk.first:
            sync(self.device)
            self._open = (chunk, time.perf_counter(), planning_s, 0)

    def stepped(self, planning_s: float) -> None:
        """The batch last arrived has been trained (its step, and the optimizer's if it
        closed a window)."""
        if self._open is None:
            return
        chunk, started, planned, batches = self._open
        self._open = (chunk, started, planned, batches + 1)
        if batches + 1 == chunk.batches:
            sync(self.device)
            ahead = planning_s - planned
            self.tuner.chunk_done(chunk, time.perf_counter() - started - ahead + chunk.plan_s)
            self._open = None


def comparisons_for(
    config: TurboConfig,
    user: TurboConfig,
    starts: list[Start],
    switchable: Callable[[TurboConfig, TurboConfig], bool] = registry.switchable_per_step,
    measure_plan: bool = False,
) -> list[Comparison]:
    """A comparison for each choice the host can switch per window (``switchable``): each
    taken start (``config`` is the start) and each trial, against its fields as the ``user``
    set them; and, where the host batches by chunks (``measure_plan``), one for a batch plan
    that chunks can measure (:func:`plan_measurable`)."""
    out = []
    for start in starts:
        if not (start.taken or start.trial):
            continue
        owners = [t for t in registry.techniques() if t.name in start.techniques]
        on, off = start.settings, _fields_of(user, owners)
        with_it, without = config.replace(**on), config.replace(**off)
        per_token = measure_plan and plan_measurable(with_it, without, start.expected_gain)
        if per_token or switchable(with_it, without):
            out.append(
                Comparison(
                    start.name,
                    on,
                    off,
                    started=start.taken,
                    built_aside=start.built_aside,
                    expected_gain=start.expected_gain,
                    build_cost_s=start.build_cost_s,
                    per_token=per_token,
                )
            )
    return out


def plan_measurable(with_it: TurboConfig, without: TurboConfig, gain: float | None) -> bool:
    """Whether chunks of the epoch can measure ``with_it``'s batch plan against ``without``'s
    rows: a plan that reads only the lengths (packing also checks the model) on the lengths'
    own shapes (no ``max_shapes`` ladder, whose collate fits the whole run's budget), at the
    budget matched to the user's batches (a ``max_tokens`` of the user's could draw more
    batches from a chunk than its rows), expected to gain less than ``PLAN_MEASURED_BELOW``."""
    return (
        registry.plans_batches(with_it)
        and not registry.plans_batches(without)
        and registry.plan_needs(with_it) <= {"lengths"}
        and not with_it.data.max_shapes
        and with_it.data.max_tokens is None
        and gain is not None
        and gain < PLAN_MEASURED_BELOW
    )


def cost_model(points: list[tuple[int, float]]) -> Callable[[int], float]:
    """Seconds as a function of work, ``a + b x work``, fitted by least squares to ``points``
    (work, seconds); proportional to work where the points do not fix a line with positive
    cost (one work size, or a fit that would make some work free)."""
    works = [w for w, _ in points]
    if len(set(works)) < 2:
        return float
    mean_w = sum(works) / len(works)
    mean_t = sum(t for _, t in points) / len(points)
    spread = sum((w - mean_w) ** 2 for w in works)
    slope = sum((w - mean_w) * (t - mean_t) for w, t in points) / spread
    intercept = mean_t - slope * mean_w
    if slope <= 0 or intercept < 0:
        return float
    return lambda work: intercept + slope * work


def same_batch_losses(
    model: nn.Module,
    device: torch.device,
    loss_under: Callable[[TurboConfig], float],
    with_config: TurboConfig,
    without: TurboConfig,
) -> tuple[float, float]:
    """``loss_under(config)`` for both sides of a comparison, on the batch the host closed
    over: without gradients, each from the same random state (dropout draws alike), and the
    model's buffers (batch-norm statistics) and the random state left as they were, so that
    measuring does not change what the run trains."""
    buffers = [b.detach().clone() for b in model.buffers()]
    devices = [device] if device.type == "cuda" else []
    losses = []
    for config in (with_config, without):
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            losses.append(loss_under(config))
    with torch.no_grad():
        for kept, buffer in zip(buffers, model.buffers(), strict=True):
            buffer.copy_(kept)
    return losses[0], losses[1]


def _hopeless(speed: RatioEstimate, ratios: list[float], pairs_left: int) -> bool:
    """Whether the pairs the budget has left (each one window or chunk on the slower side) cannot
    decide the comparison at the spread measured so far."""
    if len(ratios) < MIN_ROUNDS:
        return False
    needed = rounds_to_decide(speed, ratios)
    return needed is not None and needed - len(ratios) > pairs_left


def _slowest_rank(cost: float, device: torch.device) -> float:
    """The largest of every rank's ``cost`` under torchrun; ``cost`` in one process."""
    if not (dist.is_available() and dist.is_initialized()):
        return cost
    backend_device = device if dist.get_backend() != "gloo" else torch.device("cpu")
    value = torch.tensor([cost], dtype=torch.float64, device=backend_device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())
