"""The tuner end to end on tiny recipes: verdicts, budgets, ordering, confirmation, resume."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import ConvNet, classification_loss, cpu_stage_context

from torchturbo.config import TurboConfig
from torchturbo.recipe import Recipe
from torchturbo.techniques.framework.decide import (
    MIN_ROUNDS,
    Verdict,
    describe,
    head_to_head_decided,
    job_times,
    loss_parity,
)
from torchturbo.techniques.framework.proposal import Candidate
from torchturbo.trials.trial import Trial, fixed_batches, start_trial
from torchturbo.tune.search import candidate as candidate_module
from torchturbo.tune.search import run as search
from torchturbo.tune.search.budget import COMPILE_BASE_S
from torchturbo.tune.search.compare import batch_cycle, compare, steps_per_round
from torchturbo.tune.search.outcome import STATES
from torchturbo.tune.search.previous import Previous, is_reusable
from torchturbo.tune.search.run import TuneInterrupted, TuneOptions, select_stages, tune
from torchturbo.tune.search.stages import bucket_stage, comm_hook_stage, tuner_stages
from torchturbo.tune.search.state import MIN_BATCHES, NUM_BATCHES, batch_count


def tiny_recipe(**overrides) -> Recipe:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 16, 16, generator=generator)
    y = (x[:, 0].mean(dim=(1, 2)) > 0).long()
    args = dict(
        name="tiny",
        model=ConvNet,
        optimizer=lambda params: torch.optim.Adam(params, lr=1e-2),
        loss_fn=classification_loss,
        dataset=torch.utils.data.TensorDataset(x, y),
        batch_size=8,
    )
    args.update(overrides)
    return Recipe(**args)


QUICK = TuneOptions(time_budget_s=300, device="cpu", max_rounds=6)


def _only(*names):
    return {name: tuner_stages()[name] for name in names}


def _rows(result):
    return {o.name: o for o in result.candidates}


def test_every_candidate_ends_adopted_rejected_undecided_not_measured_or_not_applicable():
    config, result = tune(tiny_recipe(), QUICK, stages=_only("precision", "memory_format"))
    rows = _rows(result)
    assert {"bf16", "fp16+scaler", "tf32", "channels_last", "loader settings"} <= set(rows)
    for outcome in result.candidates:
        assert outcome.verdict in STATES[1:] and outcome.reason
        measured = outcome.comparison is not None
        assert measured == (
            outcome.verdict in ("adopted", "rejected", "undecided")
            and "error" not in outcome.reason
            and "not measured further" not in outcome.reason
        )
    # TF32 is a CUDA tensor-core mode: decided by the facts, never trained, on a CPU.
    assert rows["tf32"].verdict == "not applicable" and "no TF32 units" in rows["tf32"].reason
    assert result.confirmation.state in (
        "not needed",
        "confirmed",
        "consistent",
        "dropped",
        "reverted",
    )
    assert TurboConfig.from_toml(config.to_toml()) == config
    report = result.to_dict()
    assert report["candidates"][0]["verdict"] == "reference"


def test_a_candidate_that_raises_is_rejected_and_the_run_goes_on():
    def broken_model():
        raise RuntimeError("this op has no bf16 kernel")

    def stage(ctx):
        return [
            Candidate("explodes", ctx.best, 3.0, recipe=tiny_recipe(model=broken_model)),
            Candidate("bf16", ctx.best.replace(precision__dtype="bf16"), 1.5),
        ]

    _, result = tune(tiny_recipe(), QUICK, stages={"injected": stage})
    rows = _rows(result)
    assert rows["explodes"].verdict == "rejected"
    assert "RuntimeError: this op has no bf16 kernel" in rows["explodes"].reason
    assert rows["bf16"].verdict in {"adopted", "rejected", "undecided"} and rows["bf16"].comparison


def test_a_candidate_that_breaks_loss_parity_is_rejected():
    def wrong_loss(model, batch):  # a "technique" that silently changes what is optimized
        return 3.0 * classification_loss(model, batch)

    def stage(ctx):
        return [Candidate("wrong", ctx.best, 2.0, recipe=tiny_recipe(loss_fn=wrong_loss))]

    _, result = tune(tiny_recipe(), QUICK, stages={"injected": stage})
    row = _rows(result)["wrong"]
    assert row.verdict == "rejected" and row.reason.startswith("loss parity")
    assert row.parity.relative_diff > 1.0
    assert result.adopted == ()


def _other_samples(count: int = 4) -> list[Any]:
    """Batches of samples unlike the reference's (every one of class 3, which a model learns in
    a few steps): their losses differ from the reference curve's for what they hold, as a batch
    plan's other groupings of samples do."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(8 * count, 3, 16, 16, generator=generator)
    y = torch.full((8 * count,), 3)
    return [(x[i : i + 8], y[i : i + 8]) for i in range(0, len(x), 8)]


def _fp32_curve(recipe: Recipe, batches: list[Any]) -> list[float]:
    """The fp32 baseline's first six losses on ``batches``, from the recipe's initial weights."""
    trial = Trial(recipe, TurboConfig(device="cpu"), batches)
    for _ in range(6):
        trial.step()
    return trial.loss_curve()


def test_a_candidate_on_other_samples_is_held_to_the_baseline_on_those_samples():
    """Parity compares like with like: a sound candidate whose batches hold other samples than
    the baseline's is held to the fp32 baseline trained on its batches, and passes exactly; held
    to the baseline's own curve it would be 'off' by its data alone."""
    batches = _other_samples()

    def stage(ctx):
        return [Candidate("other samples", ctx.best, 2.0, batches=batches)]

    _, result = tune(tiny_recipe(), QUICK, stages={"injected": stage})
    row = _rows(result)["other samples"]
    fp32 = _fp32_curve(tiny_recipe(), batches)
    assert row.parity.reference_loss == pytest.approx(sum(fp32) / len(fp32), rel=1e-6)
    assert row.parity.ok and row.parity.relative_diff < 1e-6
    on_the_baseline_curve = loss_parity(result.loss_curves["baseline"], row.loss_curve, 0.05)
    assert not on_the_baseline_curve.ok  # what the candidate's data alone would have done


def test_a_broken_candidate_on_other_samples_still_breaks_parity():
    def wrong_loss(model, batch):
        return 3.0 * classification_loss(model, batch)

    batches = _other_samples()

    def stage(ctx):
        recipe = tiny_recipe(loss_fn=wrong_loss)
        return [Candidate("wrong", ctx.best, 2.0, batches=batches, recipe=recipe)]

    _, result = tune(tiny_recipe(), QUICK, stages={"injected": stage})
    row = _rows(result)["wrong"]
    assert row.verdict == "rejected" and row.reason.startswith("loss parity")
    fp32 = _fp32_curve(tiny_recipe(), batches)
    assert row.parity.reference_loss == pytest.approx(sum(fp32) / len(fp32), rel=1e-6)
    assert row.parity.relative_diff > 1.0


def test_rows_padded_to_another_multiple_are_held_to_the_baseline_curve(monkeypatch):
    """Padding to another multiple keeps the baseline's samples: its parity is against the
    baseline's own curve, where a model that does not mask padding would show, and no baseline
    is trained on the padded rows (which would pad the reference alike)."""
    references = []
    monkeypatch.setattr(
        candidate_module, "Trial", lambda *args: references.append(args) or Trial(*args)
    )

    def stage(ctx):
        return [Candidate("pad 16", ctx.best.replace(data__pad_to_multiple=16), 1.1)]

    _, result = tune(token_recipe(), QUICK, stages={"injected": stage})
    baseline = result.loss_curves["baseline"]
    parity = _rows(result)["pad 16"].parity
    assert parity.reference_loss == pytest.approx(sum(baseline) / len(baseline), rel=1e-9)
    assert references == []


def test_candidates_after_an_adopted_plan_are_held_to_six_steps_on_its_batches(monkeypatch):
    """A candidate whose harm shows only once it updates the weights (a diverging optimizer: its
    first loss is the baseline's) is still rejected on parity after a batch plan is adopted: the
    baseline's curve on the plan's batches is the reference, not one forward."""
    recipe = token_recipe()

    def adopt_when_parity_holds(*, parity, **_):
        return Verdict(adopt=parity.ok, reason="forced" if parity.ok else "loss parity: off")

    monkeypatch.setattr(candidate_module, "judge", adopt_when_parity_holds)
    diverging = dataclasses.replace(recipe, optimizer=lambda params: torch.optim.SGD(params, lr=5))
    stages = {
        "batching": lambda ctx: [
            Candidate("buckets", ctx.best.replace(data__batches="buckets"), 3.0)
        ],
        "next": lambda ctx: [Candidate("diverging", ctx.best, 1.1, recipe=diverging)],
    }
    _, result = tune(recipe, QUICK, stages=stages)
    rows = _rows(result)
    assert rows["buckets"].verdict == "adopted" and rows["buckets"].parity.relative_diff < 1e-6
    assert rows["diverging"].loss_curve[0] == pytest.approx(rows["buckets"].loss_curve[0])
    assert rows["diverging"].verdict == "rejected" and not rows["diverging"].parity.ok


def test_candidates_are_measured_in_order_of_expected_gain_per_second(monkeypatch):
    order = []
    real = candidate_module.try_candidate

    def recording(run, stage, candidate, *args, **kwargs):  # kwargs: the undecided measured again
        order.append(candidate.name)
        return real(run, stage, candidate, *args, **kwargs)

    monkeypatch.setattr("torchturbo.tune.search.run.try_candidate", recording)

    def lever(name, norm, gain):  # three levers, one candidate each
        return lambda ctx: [Candidate(name, ctx.best.replace(clipping__max_norm=norm), gain)]

    stages = {
        "small": lever("small", 10.0, 1.05),
        "large": lever("large", 20.0, 3.0),
        "middle": lever("middle", 30.0, 1.5),
    }
    _, result = tune(tiny_recipe(), QUICK, stages=stages)
    assert order[0] == "large"  # then the others, in the order the adoptions leave them
    # The report lists each with what it was expected to bring.
    assert {o.name: o.expected_gain for o in result.candidates if o.name in stages} == {
        "small": 1.05,
        "large": 3.0,
        "middle": 1.5,
    }


def _two_norms(ctx):
    """Two alternatives of one lever, priors far apart: the measuring order is the priors'."""
    if ctx.best.clipping.max_norm is not None:
        return "a norm is chosen"
    return [
        Candidate("clip 10", ctx.best.replace(clipping__max_norm=10.0), 3.0),
        Candidate("clip 20", ctx.best.replace(clipping__max_norm=20.0), 1.2),
    ]


def _recording_references(monkeypatch) -> list[tuple[str, str]]:
    """(candidate, what it was measured against) for every candidate of a lever measured."""
    from torchturbo.tune.search import fastest_fit

    measured_against = []
    real = fastest_fit.try_candidate

    def recording(run, stage, candidate, best, fit_memory, **kw):
        measured_against.append((candidate.name, best.name))
        return real(run, stage, candidate, best, fit_memory, **kw)

    monkeypatch.setattr(fastest_fit, "try_candidate", recording)
    return measured_against


def _confirmation_expectations(monkeypatch) -> list[Callable]:
    """Each confirmation's stopping rule (``decided``): what it expects the search gained."""
    from torchturbo.tune.search import confirm as confirm_module

    expected = []
    real_chain = confirm_module.compare_chain

    def chain(*args, **kwargs):
        expected.append(kwargs["decided"])
        return real_chain(*args, **kwargs)

    monkeypatch.setattr(confirm_module, "compare_chain", chain)
    return expected


def _expects(decided: Callable, speed, gain: float) -> bool:
    """Whether ``decided`` calls a confirmation short of ``gain`` (its plausible high just
    under it) contradicted, and one just over it not."""
    short = dataclasses.replace(speed, decision="undecided", plausible_high=gain * 0.999)
    return decided(short) and not decided(dataclasses.replace(short, plausible_high=gain * 1.001))


def test_a_levers_later_alternative_is_measured_against_its_leader_and_replaces_it(monkeypatch):
    """The first alternative (bf16, say) against the best; the next (fp16) against that leader
    head to head, both fast, not against the slow best: adopted there, it takes the leader's
    place, and the leader's row quotes the measurement that beat it."""
    measured_against = _recording_references(monkeypatch)
    monkeypatch.setattr(candidate_module, "judge", lambda **_: Verdict(adopt=True, reason="ok"))
    step_s = {None: 0.04, 10.0: 0.02, 20.0: 0.01}  # 2x over fp32, then 2x over clip 10
    clock = _stepping_clock(monkeypatch, lambda trial: step_s[trial.config.clipping.max_norm])
    expected = _confirmation_expectations(monkeypatch)
    _, result = tune(tiny_recipe(), QUICK, stages={"clipping": _two_norms}, clock=clock)
    assert measured_against == [("clip 10", "fp32 eager"), ("clip 20", "clip 10")]
    rows = _rows(result)
    assert rows["clip 20"].verdict == "adopted" and result.adopted == ("clip 20",)
    assert rows["clip 20"].comparison.against == "clip 10"
    beaten = rows["clip 10"]
    assert beaten.verdict == "rejected" and beaten.comparison.against == "fp32 eager"
    assert beaten.reason.startswith(
        "faster than the best, but clip 20 makes the job shorter: it measured "
        f"{describe(rows['clip 20'].comparison.speed)} against this head to head; "
    )
    # Over fp32 eager the search measured the two ratios multiplied (4x), not clip 20's alone.
    over_best = beaten.comparison.speed.ratio * rows["clip 20"].comparison.speed.ratio
    assert over_best == pytest.approx(4.0, rel=1e-6)
    assert rows["clip 20"].over_best == pytest.approx(over_best, rel=1e-9)
    assert len(expected) == 1 and _expects(expected[0], rows["clip 20"].comparison.speed, over_best)

    # Tuned again into the same --out: the reused winner keeps the two ratios multiplied, so
    # the new confirmation expects 4x again, not clip 20's 2x over clip 10 alone.
    previous = json.loads(json.dumps(result.to_dict()))  # as results.json holds it
    _, again = tune(
        tiny_recipe(), QUICK, stages={"clipping": _two_norms}, clock=clock, previous=previous
    )
    assert _rows(again)["clip 20"].reused and again.adopted == ("clip 20",)
    assert len(expected) == 2 and _expects(expected[1], rows["clip 20"].comparison.speed, over_best)


def test_a_later_alternative_slower_than_the_leader_leaves_the_leader(monkeypatch):
    measured_against = _recording_references(monkeypatch)
    monkeypatch.setattr(candidate_module, "judge", lambda **_: Verdict(adopt=True, reason="ok"))
    step_s = {None: 0.04, 10.0: 0.02, 20.0: 0.03}
    clock = _stepping_clock(monkeypatch, lambda trial: step_s[trial.config.clipping.max_norm])
    _, result = tune(tiny_recipe(), QUICK, stages={"clipping": _two_norms}, clock=clock)
    assert measured_against == [("clip 10", "fp32 eager"), ("clip 20", "clip 10")]
    rows = _rows(result)
    assert rows["clip 10"].verdict == "adopted" and result.adopted == ("clip 10",)
    slower = rows["clip 20"]
    assert slower.verdict == "rejected" and slower.comparison.against == "clip 10"
    assert slower.reason.startswith("clip 10 stays ahead: this measured 0.67x")


def test_an_alternative_within_the_noise_of_its_leader_wins_by_the_jobs_time():
    """Both alternatives already beat the best: the race ends once they are within 5% of each
    other both ways, and the shorter job at the measured ratio wins, one-time costs included."""
    from torchturbo.techniques.framework.decide import Parity, estimate, judge_against_leader

    ratios = [1.03, 0.99, 1.02, 1.01, 1.04, 1.00, 1.02, 1.01] * 4
    assert head_to_head_decided(ratios)
    speed = estimate(ratios)
    parity = Parity(1.0, 1.0, 0.0, True, True)
    common = {"speed": speed, "parity": parity, "memory_bytes": None, "memory_budget": None}
    cheap = job_times(steps=1000, best_step_s=0.5, ratio=speed.ratio, best_one_time_s=0.0,
                      one_time_s=0.0)  # fmt: skip
    won = judge_against_leader(**common, job=cheap, tolerance=0.05, leader="packing")
    assert won.adopt and won.reason.startswith("ahead of packing head to head: 1.01x")
    costly = job_times(steps=1000, best_step_s=0.5, ratio=speed.ratio, best_one_time_s=0.0,
                       one_time_s=60.0)  # fmt: skip
    lost = judge_against_leader(**common, job=costly, tolerance=0.05, leader="packing")
    assert not lost.adopt and lost.reason.startswith("packing stays ahead")


def test_later_candidates_train_on_the_batches_an_earlier_one_adopted(monkeypatch):
    """Batches follow the config: a candidate built on an adopted batching plans the same
    batches, and trains on the very list the best holds (so their steps pair up)."""
    recipe = token_recipe()
    trained_on = []

    def recording_start(recipe, config, batches, clock=time.perf_counter):
        trained_on.append((config.data.batches == "buckets", batches))
        return start_trial(recipe, config, batches, clock)

    monkeypatch.setattr(candidate_module, "start_trial", recording_start)
    monkeypatch.setattr(candidate_module, "judge", lambda **_: Verdict(adopt=True, reason="forced"))
    stages = {
        "batching": lambda ctx: [
            Candidate("buckets", ctx.best.replace(data__batches="buckets"), 3.0)
        ],
        "next": lambda ctx: [Candidate("clip", ctx.best.replace(clipping__max_norm=1.0), 1.1)],
    }
    _, result = tune(recipe, QUICK, stages=stages)
    assert [o.name for o in result.candidates if o.verdict == "adopted"] == ["buckets", "clip"]
    (bucketed, buckets), (still_bucketed, then) = trained_on
    assert bucketed and still_bucketed and then is buckets


def token_recipe() -> Recipe:
    """Variable-length token ids with a class per sample, and their lengths."""
    from technique_settings import TokenClassifier

    generator = torch.Generator().manual_seed(0)
    lengths = [int(n) for n in torch.randint(2, 33, (96,), generator=generator)]
    samples = [
        {"input_ids": torch.randint(1, 50, (n,), generator=generator), "label": n % 3}
        for n in lengths
    ]

    def loss(model, batch):
        logits = model(batch["input_ids"])[:, 0]
        return torch.nn.functional.cross_entropy(logits, batch["label"])

    return Recipe(
        name="tokens",
        model=TokenClassifier,
        optimizer=lambda params: torch.optim.Adam(params, lr=1e-2),
        loss_fn=loss,
        dataset=samples,
        batch_size=8,
        lengths=lengths,
    )


def _slowed(loss_fn: Any, model: Any, batch: Any) -> Any:
    """Four more forwards a step: about half the speed however busy the machine, so the
    candidate is decided slower in a few rounds."""
    with torch.no_grad():
        for _ in range(4):
            loss_fn(model, batch)
    return loss_fn(model, batch)


def _clip(norm: float, gain: float) -> Any:
    def stage(ctx):
        name = f"clip {norm:g}"
        config = ctx.best.replace(clipping__max_norm=norm)
        slowed = dataclasses.replace(
            ctx.recipe, loss_fn=functools.partial(_slowed, ctx.recipe.loss_fn)
        )
        return [Candidate(name, config, gain, recipe=slowed)]

    return stage


#: Two levers every machine can run (unlike bf16, not applicable where it is emulated), one
#: candidate each, decided in a few rounds: slower, so rejected (the reuse tests need decisions).
CLIPPING = {"clip10": _clip(10.0, 1.5), "clip20": _clip(20.0, 1.4)}


def test_a_candidate_that_does_not_fit_the_budget_is_not_measured_and_says_what_it_needs():
    options = dataclasses.replace(QUICK, time_budget_s=0.001)
    _, result = tune(tiny_recipe(), options, stages=CLIPPING)
    clip = _rows(result)["clip 10"]
    assert clip.verdict == "not measured" and clip.comparison is None
    assert clip.reason.startswith("budget: needs ~") and clip.estimate_s > 0
    # Nothing adopted: no confirmation, 1.00x by definition, and the headline says what to do.
    assert result.confirmation.state == "not needed" and result.confirmation.ratio == 1.0
    from torchturbo.tune.report.summary import headline

    line = headline(result.to_dict())
    assert "not measured for lack of time: clip 10" in line and "min would measure" in line


def test_a_compile_left_out_because_it_cannot_pay_back_is_not_called_a_lack_of_time():
    """A tune for a 60-step job once read 'not measured for lack of time: compile:default (a
    budget of about 11 min would measure them)' for a compile its row said could not pay back:
    no budget measures that one; the headline says why it was left out."""
    from torchturbo.tune.report.summary import headline

    _, result = tune(tiny_recipe(), QUICK, stages=CLIPPING)
    results = result.to_dict()
    rows = [r for r in results["candidates"] if r["stage"] != "baseline"]
    futile = "cannot pay back on this job: even 1.5x faster steps would save ~6 s of the ..."
    rows[0].update(verdict="not measured", reason=futile, estimate_s=600.0)
    assert headline(results).endswith(
        f"; not measured, as it cannot pay back on this job: {rows[0]['name']}"
    )
    assert "lack of time" not in headline(results)
    rows[1].update(verdict="not measured", reason="budget: needs ~30 s, 4 s left", estimate_s=30)
    line = headline(results)
    assert f"not measured for lack of time: {rows[1]['name']} (a budget of about" in line
    assert line.endswith(f"; not measured, as it cannot pay back on this job: {rows[0]['name']}")


def test_the_budget_the_headline_asks_for_is_more_than_the_one_given():
    """A run ends a little before its budget (the confirmation's share is held back): the
    skipped candidates come on top of the whole budget, not of the time the run took."""
    from torchturbo.tune.report.summary import headline

    _, result = tune(tiny_recipe(), QUICK, stages=CLIPPING)
    results = result.to_dict()
    results["candidates"][-1] |= {"verdict": "not measured", "reason": "budget: needs ~6 s"}
    results |= {"time_budget_s": 180.0, "elapsed_s": 170.4, "unmeasured_s": 6.4}
    assert "(a budget of about 4 min would measure them)" in headline(results)


def _sleepy_loss(model, batch):
    time.sleep(0.25)  # a model whose step takes a quarter of a second, as real ones on a CPU
    return classification_loss(model, batch)


@pytest.mark.slow
def test_a_slow_model_keeps_the_budget_and_names_what_it_could_not_measure():
    # Under COMPILE_BASE_S: compile cannot fit on any machine, whatever else it measures.
    options = dataclasses.replace(QUICK, time_budget_s=0.9 * COMPILE_BASE_S, max_rounds=15)
    stages = _only("precision", "memory_format", "compile")
    begin = time.perf_counter()
    _, result = tune(tiny_recipe(loss_fn=_sleepy_loss), options, stages=stages)
    elapsed = time.perf_counter() - begin
    assert result.baseline_step_ms > 250
    assert elapsed <= 1.1 * options.time_budget_s
    compile_row = _rows(result)["compile:default"]
    assert compile_row.verdict == "not measured" and "needs ~" in compile_row.reason
    assert result.unmeasured_s > 0


def _stepping_clock(monkeypatch, seconds: Callable[[Trial], float]) -> Callable[[], float]:
    """A clock that only steps advance, each by ``seconds(trial)``: the budget logic and the
    paired rounds then see the same times whatever else loads the machine (real sleeps and a
    stretched real clock failed under a load of 10)."""
    now = [0.0]
    real_step = Trial.step

    def step(self):
        real_step(self)
        now[0] += seconds(self)

    monkeypatch.setattr(Trial, "step", step)
    return lambda: now[0]


def test_the_budget_is_kept_on_an_injected_clock(monkeypatch):
    clock = _stepping_clock(monkeypatch, lambda trial: 0.25)  # a real model's step on a CPU
    # Under COMPILE_BASE_S, so compile can never fit, however fast this machine runs the rest.
    options = dataclasses.replace(QUICK, time_budget_s=0.9 * COMPILE_BASE_S, max_rounds=15)
    begin = clock()
    _, result = tune(tiny_recipe(), options, stages=_only("precision", "compile"), clock=clock)
    assert 0 < clock() - begin <= 1.1 * options.time_budget_s
    assert _rows(result)["compile:default"].verdict == "not measured"


def test_over_the_memory_budget_memory_candidates_go_first(monkeypatch):
    order = []
    real = candidate_module.try_candidate

    def recording(run, stage, candidate, best, fit_memory):
        order.append(candidate.name)
        return real(run, stage, candidate, best, fit_memory)

    monkeypatch.setattr("torchturbo.tune.search.fastest_fit.try_candidate", recording)
    options = dataclasses.replace(QUICK, memory_budget=1)  # nothing fits: the leanest plan
    _, result = tune(tiny_recipe(), options, stages=_only("precision", "memory"))
    # The leanest plan: every knob, bf16 moments too (the ConvNet's tensors are too small for
    # torchao's 8- and 4-bit states, which leave them float32).
    assert order[0] == "plan: ckpt all 2 blocks + micro-batch 1 x8 + bf16 optimizer state"
    memory_rows = [o for o in result.candidates if o.stage == "memory"]
    assert memory_rows and not [o for o in memory_rows if o.verdict == "adopted"]
    assert any("memory: " in o.reason and "> budget 1 B" in o.reason for o in memory_rows)


def test_only_and_skip_choose_stages_and_unknown_names_list_the_stages():
    chosen = select_stages(
        tuner_stages(), dataclasses.replace(QUICK, only=("precision", "data_loader"))
    )
    assert list(chosen) == ["data_loader", "precision"]
    chosen = select_stages(tuner_stages(), dataclasses.replace(QUICK, skip=("compile",)))
    assert "compile" not in chosen and "precision" in chosen
    with pytest.raises(ValueError, match=r"no such stage.*; the stages are data_loader, precision"):
        select_stages(tuner_stages(), dataclasses.replace(QUICK, only=("precison",)))


def test_tuning_again_reuses_what_was_measured_and_measures_the_rest():
    recipe = tiny_recipe()

    _, first = tune(recipe, QUICK, stages=CLIPPING)
    decided = {o.name for o in first.candidates if o.verdict in ("adopted", "rejected")}
    assert decided == {"clip 10", "clip 20"}
    both = {**CLIPPING, **_only("memory_format")}
    _, second = tune(recipe, QUICK, stages=both, previous=first.to_dict())
    rows = _rows(second)
    for name in decided:
        assert rows[name].reused and rows[name].comparison == _rows(first)[name].comparison
    assert not rows["channels_last"].reused
    assert second.reused_from and "reused 2 measured candidates" in second.reuse_note
    marked = [row["reused"] for row in second.to_dict()["candidates"]]
    assert marked.count(True) == 2


def test_ctrl_c_keeps_what_was_measured_and_the_next_run_measures_only_the_rest(monkeypatch):
    calls = []

    def ctrl_c_after_the_first_candidate(ctx):
        calls.append(1)
        if len(calls) == 2:  # stages are asked again once a candidate is decided
            raise KeyboardInterrupt
        return []

    stages = {**CLIPPING, "interrupt": ctrl_c_after_the_first_candidate}
    with pytest.raises(TuneInterrupted) as caught:
        tune(tiny_recipe(), QUICK, stages=stages)
    assert caught.value.measured == 1
    partial = json.loads(json.dumps(caught.value.partial))  # as progress.json holds it
    # The run as far as it went, for the report: nothing measured for it, its rows its own.
    stopped = caught.value.result
    assert caught.value.why == "stopped by SIGINT" and stopped.breakdown == {}
    assert stopped.confirmation.state == "interrupted" and stopped.confirmation.ratio == 1.0
    assert [o.name for o in stopped.candidates if o.comparison] == ["clip 10"]

    # Interrupted again before it replayed what it reuses: that is kept too.
    def ctrl_c(*_):
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(search, "loader_stage", ctrl_c)
        with pytest.raises(TuneInterrupted) as caught:
            tune(tiny_recipe(), QUICK, stages=CLIPPING, previous=partial)
    assert caught.value.measured == 1
    partial = json.loads(json.dumps(caught.value.partial))
    _, again = tune(
        tiny_recipe(),
        QUICK,
        stages=CLIPPING,
        previous=partial,
        previous_source="progress.json",
    )
    assert again.reuse_note == "reused 1 measured candidates from progress.json"
    rows = _rows(again)
    assert rows["clip 10"].reused and not rows["clip 20"].reused
    assert rows["clip 20"].comparison is not None  # measured in this run


def test_ctrl_c_while_a_reused_config_is_rebuilt_keeps_its_adoptions(monkeypatch):
    _, first = tune(tiny_recipe(), QUICK, stages=CLIPPING)
    results = first.to_dict()
    rows = [r for r in results["candidates"] if r["verdict"] in ("adopted", "rejected")]
    rows[0]["verdict"], results["adopted"] = "adopted", [rows[0]["name"]]
    calls = []

    def rebuild_interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the baseline's trial first, then the rebuild of the adoption
            raise KeyboardInterrupt
        return start_trial(*args, **kwargs)

    monkeypatch.setattr(search, "start_trial", rebuild_interrupted)
    with pytest.raises(TuneInterrupted) as caught:
        tune(tiny_recipe(), QUICK, stages=CLIPPING, previous=results)
    assert caught.value.partial["adopted"] == [rows[0]["name"]]
    assert caught.value.measured == len(rows)


def test_the_first_previous_run_made_for_this_one_is_reused():
    _, first = tune(tiny_recipe(), dataclasses.replace(QUICK, only=("precision",)))
    other = {**first.to_dict(), "fingerprint": {**first.fingerprint, "recipe": "another"}}
    sources = [(other, "progress.json"), (first.to_dict(), "results.json")]
    reuse, note = Previous.first(sources, first.fingerprint)
    assert reuse is not None and note.endswith("from results.json")
    reuse, note = Previous.first(sources[:1], first.fingerprint)
    assert reuse is None and note.startswith("progress.json was made with another recipe")


def test_a_previous_run_is_rebuilt_from_its_last_adoption_not_its_last_row():
    """Rows are in stage order, adoptions in the order they happened: the chosen config is the
    config of the last adoption, which contains the ones before it."""
    _, first = tune(tiny_recipe(), QUICK, stages=CLIPPING)
    results = first.to_dict()
    rows = [r for r in results["candidates"] if r["verdict"] in ("adopted", "rejected")]
    assert len(rows) >= 2
    for row in rows[:2]:
        row["verdict"] = "adopted"
    results["adopted"] = [rows[1]["name"], rows[0]["name"]]  # adopted against the row order
    reuse, _ = Previous.parse(results, results["fingerprint"], "results.json")
    assert [o.name for o in reuse.adopted] == results["adopted"]


def test_a_previous_run_of_another_recipe_is_not_reused():
    _, first = tune(tiny_recipe(), dataclasses.replace(QUICK, only=("precision",)))
    _, second = tune(
        tiny_recipe(batch_size=16),
        dataclasses.replace(QUICK, only=("precision",)),
        previous=first.to_dict(),
    )
    assert second.reused_from is None and "another batch_size" in second.reuse_note
    assert not any(o.reused for o in second.candidates)


def test_an_adoption_the_confirmation_contradicts_is_dropped_and_the_baseline_kept(monkeypatch):
    # 4x slower (under the probe's 10x, so it is measured), on a clock only steps advance.
    clock = _stepping_clock(
        monkeypatch, lambda trial: 0.04 if trial.config.clipping.max_norm == 123.0 else 0.01
    )
    monkeypatch.setattr(candidate_module, "judge", lambda **_: Verdict(adopt=True, reason="forced"))
    stages = {
        "bad": lambda ctx: [Candidate("slow", ctx.best.replace(clipping__max_norm=123.0), 2.0)]
    }
    options = dataclasses.replace(QUICK, max_rounds=10)
    config, result = tune(tiny_recipe(), options, stages=stages, clock=clock)
    assert result.confirmation.state == "reverted" and result.confirmation.dropped == ("slow",)
    assert config.clipping.max_norm is None  # the written config is the baseline's
    assert result.adopted == ()
    # The table shows what is kept: the baseline alone, not the dropped adoption.
    from torchturbo.tune.report.tables import incremental_rows

    assert [row[0] for row in incremental_rows(result.to_dict())] == ["baseline (fp32 eager)"]
    assert (
        "slow were not faster alone" in result.confirmation.note
        or "no adoption" in result.confirmation.note
    )


def test_a_confirmation_that_holds_when_measured_again_drops_nothing_and_says_so(monkeypatch):
    """The chained confirmation undecided, the adoption re-measured alone faster: every output
    says it held, none names a drop (a tune once printed 'after dropping ' and 'compile:default
    held and  were dropped')."""
    from torchturbo.tune.report.summary import confirmation_line, headline, incremental_note
    from torchturbo.tune.search import confirm as confirm_module

    clock = _stepping_clock(
        monkeypatch, lambda trial: 0.01 if trial.config.clipping.max_norm == 123.0 else 0.04
    )
    monkeypatch.setattr(candidate_module, "judge", lambda **_: Verdict(adopt=True, reason="forced"))
    real_chain = confirm_module.compare_chain

    def undecided_chain(*args, **kwargs):
        chained = real_chain(*args, **kwargs)
        speed = dataclasses.replace(
            chained.overall.comparison.speed, decision="undecided", plausible_high=0.5
        )
        comparison = dataclasses.replace(chained.overall.comparison, speed=speed)
        overall = dataclasses.replace(chained.overall, comparison=comparison)
        return dataclasses.replace(chained, overall=overall)

    monkeypatch.setattr(confirm_module, "compare_chain", undecided_chain)
    stages = {
        "good": lambda ctx: [Candidate("quick", ctx.best.replace(clipping__max_norm=123.0), 2.0)]
    }
    config, result = tune(
        tiny_recipe(), dataclasses.replace(QUICK, max_rounds=10), stages=stages, clock=clock
    )
    confirmation = result.confirmation
    assert confirmation.state == "dropped" and confirmation.dropped == ()
    assert config.clipping.max_norm == 123.0  # it held: the written config keeps it
    assert confirmation.note.endswith("re-measured alone, quick held, nothing was dropped")
    results = result.to_dict()
    assert "Confirmed 4.00x" in headline(results) and headline(results).endswith(", measured again")
    for line in (headline(results), confirmation_line(results), incremental_note(results)):
        assert "dropping" not in line and "were dropped" not in line, line


def test_a_config_against_itself_is_not_called_faster():
    """A/A on real trials: two identical configs, paired rounds, many times over."""
    recipe = tiny_recipe()
    batches = fixed_batches(recipe, 8)
    reference, _ = start_trial(recipe, TurboConfig(device="cpu"), batches)
    same, _ = start_trial(recipe, TurboConfig(device="cpu"), batches)
    try:
        decisions = [
            compare(
                reference,
                same,
                against="itself",
                device=torch.device("cpu"),
                max_rounds=8,
                may_continue=lambda seconds: True,
            ).comparison.speed.decision
            for _ in range(20)
        ]
    finally:
        reference.close()
        same.close()
    assert decisions.count("faster") <= 1, decisions


def test_a_decided_comparison_settles_on_more_rounds_only_while_the_budget_allows(monkeypatch):
    # Steps timed on a clock they advance themselves, the reference 4x slower: decided in the
    # fewest rounds whatever else loads the machine (with real sleeps, a busy machine needed 10).
    now = [0.0]
    real_step = Trial.step

    def step(self):
        real_step(self)
        now[0] += 0.04 if self.config.clipping.max_norm == 123.0 else 0.01

    monkeypatch.setattr(Trial, "step", step)
    recipe = tiny_recipe()
    batches = fixed_batches(recipe, 8)
    slow, _ = start_trial(
        recipe, TurboConfig(device="cpu").replace(clipping__max_norm=123.0), batches
    )
    fast, _ = start_trial(recipe, TurboConfig(device="cpu"), batches)
    try:

        def rounds(settle_rounds, may_continue, min_rounds=MIN_ROUNDS):
            measured = compare(
                slow,
                fast,
                against="slow",
                device=torch.device("cpu"),
                max_rounds=12,
                may_continue=may_continue,
                min_rounds=min_rounds,
                settle_rounds=settle_rounds,
                clock=lambda: now[0],
            )
            assert measured.comparison.speed.decision == "faster"
            return measured.comparison.speed.rounds

        assert rounds(1, lambda seconds: True) < 6  # decided early, and stopped there
        assert rounds(6, lambda seconds: True) == 6
        # No budget: a decided ratio is not settled (min_rounds keeps an undecided one going).
        assert rounds(6, lambda seconds: False, min_rounds=6) < 6
    finally:
        slow.close()
        fast.close()


def test_variable_length_batches_are_compared_in_whole_cycles():
    fixed, varying = tiny_recipe(), tiny_recipe(lengths=[3, 5] * 32)
    eight, other_eight, six = [0] * 8, [1] * 8, [0] * 6
    assert batch_cycle(fixed, eight, other_eight) == 1
    assert batch_cycle(varying, eight, other_eight) == 8
    assert batch_cycle(varying, eight, six) == 24
    # On the same batches both sides step the same batch every round: one step is a round.
    assert batch_cycle(varying, eight, eight) == 1
    assert steps_per_round(0.5) == 1 and steps_per_round(0.5, 8) == 8
    assert steps_per_round(0.001) == 8 and steps_per_round(0.001, 8) == 8
    assert steps_per_round(0.02, 3) == 3  # 0.05 s needs 3 steps: one whole cycle of 3


def _context(recipe, world_size=2, comm_share=0.3):
    return cpu_stage_context(
        recipe,
        facts={"comm_share": comm_share if world_size > 1 else None},
        world_size=world_size,
        backend="gloo",
    )


def test_ddp_stages_need_torchrun_and_try_only_bucket_sizes_that_change_the_buckets():
    assert "torchrun" in comm_hook_stage(_context(tiny_recipe(), world_size=1))
    hooks = comm_hook_stage(_context(tiny_recipe()))
    assert [c.name for c in hooks] == ["comm_hook:fp16", "comm_hook:powersgd"]  # no bf16 on gloo
    # PowerSGD sends fewer bytes than fp16, so it is expected to gain more.
    assert hooks[1].expected_gain > hooks[0].expected_gain > 1
    # A few KiB of gradients fit one bucket at 5, 25 and 100 MiB alike.
    assert "changes nothing" in bucket_stage(_context(tiny_recipe()))
    wide = tiny_recipe(model=lambda: torch.nn.Linear(2048, 2048))  # 16 MiB of gradients
    caps = [c.config.distributed.bucket_cap_mb for c in bucket_stage(_context(wide))]
    assert caps == [5.0]  # 100 MiB would hold them in one bucket, as 25 MiB does


def test_a_comparison_the_budget_stops_is_undecided_and_says_what_it_would_need(monkeypatch):
    """Steps of 0.25 s +-40% (a noisy machine) and a budget of a few rounds: the clip candidate
    (no faster, no slower) cannot be decided; it is undecided, with its estimate, not rejected,
    and the next run measures it again."""
    import random

    noise = random.Random(0)
    clock = _stepping_clock(monkeypatch, lambda trial: 0.25 * (0.6 + 0.8 * noise.random()))
    options = dataclasses.replace(QUICK, time_budget_s=14.0, max_rounds=30)

    def clip(ctx):
        return [Candidate("clip", ctx.best.replace(clipping__max_norm=10.0), 1.5)]

    _, result = tune(tiny_recipe(), options, stages={"clip": clip}, clock=clock)
    row = _rows(result)["clip"]
    assert row.verdict == "undecided", row.reason
    assert row.comparison is not None and row.comparison.speed.decision == "undecided"
    assert "the budget stopped it: about " in row.reason and "s more)" in row.reason
    assert not is_reusable(row.verdict, row.stage)
    from torchturbo.tune.report.summary import headline

    assert "undecided, not rejected: clip (" in headline(result.to_dict())


def test_before_the_search_the_run_says_which_budget_would_measure_the_large_gains(monkeypatch):
    clock = _stepping_clock(monkeypatch, lambda trial: 0.25)
    options = dataclasses.replace(QUICK, time_budget_s=6.0)

    def large(ctx):
        return [Candidate("large", ctx.best.replace(clipping__max_norm=10.0), 2.0)]

    said = []
    _, result = tune(
        tiny_recipe(),
        options,
        stages={"large": large},
        clock=clock,
        on_progress=lambda stage, what, left: said.append((stage, what)),
    )
    assert result.budget_note.startswith("the 6 s budget may not measure every candidate")
    assert "large (~2.00x)" in result.budget_note and "--time-budget 1m" in result.budget_note
    assert ("budget", result.budget_note) in said  # on the progress line, before the search
    from torchturbo.tune.report.summary import headline

    assert "said before the search: the 6 s budget" in headline(result.to_dict())
    roomy = dataclasses.replace(options, time_budget_s=600.0)
    _, enough = tune(tiny_recipe(), roomy, stages={"large": large}, clock=clock)
    assert enough.budget_note == ""


def test_a_compile_that_cannot_pay_back_on_the_job_is_not_measured():
    """A 5-step job saves at most a few seconds even at 1.5x faster steps: compiling (15 s or
    more) is not worth the budget to measure, and the row says why."""
    options = dataclasses.replace(QUICK, planned_steps=5)
    _, result = tune(tiny_recipe(), options, stages=_only("compile"))
    row = _rows(result)["compile:default"]
    assert row.verdict == "not measured" and row.comparison is None
    assert row.reason.startswith("cannot pay back on this job: even 1.5x faster steps")
    long_job = dataclasses.replace(options, planned_steps=10**9)
    assert not candidate_module._cannot_pay_back(
        types.SimpleNamespace(options=long_job, horizon=types.SimpleNamespace(steps=10**9)),
        candidate_module.Estimate(min_s=1.0, typical_s=1.0, compile_s=30.0),
        types.SimpleNamespace(trial=types.SimpleNamespace(step_seconds=0.01)),
    )


def test_slow_steps_hold_fewer_batches_so_a_pass_over_them_stays_short():
    assert batch_count(0.05) == NUM_BATCHES and batch_count(0.5) == NUM_BATCHES
    assert batch_count(0.8) == 5 and batch_count(2.0) == MIN_BATCHES == 4


def test_a_trials_one_time_cost_counts_the_engines_setup():
    """Work a technique does in setup (compile's probe of the CPU) is a one-time cost of the
    job as much as the first step's: the first step's time carries both."""
    recipe = tiny_recipe()
    ticks = iter([0.0, 5.0, 5.0, 6.5])  # setup begins, ends; the first step begins, ends
    trial, first = start_trial(
        recipe, TurboConfig(device="cpu"), fixed_batches(recipe, 1), lambda: next(ticks)
    )
    try:
        assert trial.setup_s == 5.0 and first == 6.5
    finally:
        trial.close()


def test_no_round_cap_ends_a_decision_the_budget_can_afford(monkeypatch):
    """A 1.10x gain at ~13% per-round noise (channels_last on a CNN, 2-core EPYC) needs about
    50 rounds: with the budget to spare, the default options measure it to a decision rather
    than leave it undecided at a fixed 30 rounds."""
    import random

    noise = random.Random(3)

    def seconds(trial):
        base = 0.2 / (1.10 if trial.config.clipping.max_norm is not None else 1.0)
        return base * math.exp(noise.gauss(0, 0.13))

    clock = _stepping_clock(monkeypatch, seconds)
    options = TuneOptions(time_budget_s=3000, device="cpu")
    assert options.max_rounds is None

    def clip(ctx):
        return [Candidate("clip", ctx.best.replace(clipping__max_norm=10.0), 1.5)]

    _, result = tune(tiny_recipe(), options, stages={"clip": clip}, clock=clock)
    row = _rows(result)["clip"]
    assert row.verdict == "adopted", row.reason
    assert row.comparison.speed.rounds > 30


def test_when_nothing_was_adopted_the_confirmations_time_goes_to_the_undecided(monkeypatch):
    """A real 1.2x gain on a noisy machine: the budget less the confirmation's reserve leaves it
    undecided; nothing was adopted, so no confirmation will run and its reserve measures the
    candidate again, which adopts it on its own measurement against the baseline."""
    import random

    noise = random.Random(1)

    def seconds(trial):
        base = 0.25 / (1.2 if trial.config.clipping.max_norm is not None else 1.0)
        return base * (0.85 + 0.3 * noise.random())

    clock = _stepping_clock(monkeypatch, seconds)
    options = dataclasses.replace(QUICK, time_budget_s=float(14), max_rounds=None)

    def clip(ctx):
        return [Candidate("clip", ctx.best.replace(clipping__max_norm=10.0), 1.5)]

    said = []
    _, result = tune(
        tiny_recipe(),
        options,
        stages={"clip": clip},
        clock=clock,
        on_progress=lambda stage, what, left: said.append((stage, what)),
    )
    assert [what for stage, what in said if stage == "clip"] == ["clip", "clip"]
    row = _rows(result)["clip"]
    assert row.verdict == "adopted", row.reason
    assert result.confirmation.state == "unconfirmed"
    assert "went to measuring it" in result.confirmation.note
