"""Tuning inside the run (``engine/in_run.py``): where the facts start a run, how the job's own
steps judge each choice, and that the run trains what it would have trained (every step, every
sample once per epoch), keeps its verdicts and resumes them."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import MLP
from torch import nn

from torchturbo import Turbo, TurboConfig
from torchturbo.engine import in_run
from torchturbo.engine.in_run import (
    START_GAIN,
    Comparison,
    InRunTuner,
    comparisons_for,
    cost_model,
    start_from_facts,
)
from torchturbo.recipe import Recipe
from torchturbo.runs.train import train
from torchturbo.techniques.framework.decide import MIN_ROUNDS
from torchturbo.techniques.framework.facts import Facts

CPU = torch.device("cpu")
IN_RUN = TurboConfig(device="cpu").replace(tune__in_run=True)


def _facts(bf16: float = 4.0, padding: tuple[float, float] | None = (0.7, 0.02)) -> Facts:
    return Facts(
        device="cpu",
        gemm_speedup={"bf16": bf16, "fp16": bf16, "tf32": 1.0},
        emulated={"fp16": "no fp16 units", "tf32": "no TF32 units"},
        padding=padding,
        has_convolutions=False,
        conv_share=0.0,
        leaf_modules=3,
        shapes_vary=padding is not None,
    )


class Tokens(torch.utils.data.Dataset):
    """Sequences of lengths ``shortest``..40 whose next token is the current one plus one
    (learnable); each sample carries its index so that a test can see which samples were
    trained."""

    def __init__(self, count: int = 48, shortest: int = 2) -> None:
        generator = torch.Generator().manual_seed(0)
        self.lengths = [int(n) for n in torch.randint(shortest, 41, (count,), generator=generator)]

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = (torch.arange(self.lengths[index]) + index) % 31
        return {"input_ids": ids, "labels": (ids + 1) % 31, "index": torch.tensor(index)}


class TokenModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 32)
        self.out = nn.Linear(32, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.embed(ids)))


def token_loss(model: nn.Module, batch: dict[str, torch.Tensor]):
    logits = model(batch["input_ids"])
    labels = batch["labels"]
    mask = labels != -100
    loss = nn.functional.cross_entropy(logits[mask], labels[mask])
    return loss, mask.sum()


def _recipe(dataset: Tokens | None = None) -> Recipe:
    dataset = dataset or Tokens()
    return Recipe(
        name="tokens",
        model=TokenModel,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        loss_fn=token_loss,
        dataset=dataset,
        batch_size=4,
        lengths=dataset.lengths,
        count_unit="tokens",
    )


# -- the start --------------------------------------------------------------------------------


def test_fast_bf16_and_heavy_padding_start_the_run_on_bf16_and_length_buckets():
    started, starts = start_from_facts(IN_RUN, _facts(), _recipe(), CPU)
    assert started.precision.dtype == "bf16" and started.data.batches == "buckets"
    taken = {s.name for s in starts if s.taken}
    assert taken == {"bf16", "length buckets"}
    fp16 = next(s for s in starts if s.name == "fp16+scaler")
    assert not fp16.taken and fp16.why_not == "not applicable here"


def test_slow_bf16_and_no_lengths_leave_the_run_where_the_user_put_it():
    started, starts = start_from_facts(IN_RUN, _facts(bf16=0.5, padding=None), _recipe(), CPU)
    assert started == IN_RUN
    bf16 = next(s for s in starts if s.name == "bf16")
    assert not bf16.taken and f"under the {START_GAIN:.2f}x" in bf16.why_not
    buckets = next(s for s in starts if s.name == "length buckets")
    assert buckets.why_not == "not applicable here"


def test_the_users_own_choice_stands():
    user = IN_RUN.replace(precision__dtype="fp16")
    started, starts = start_from_facts(user, _facts(), _recipe(), CPU)
    assert started.precision.dtype == "fp16"
    bf16 = next(s for s in starts if s.name == "bf16")
    assert bf16.why_not == "the config sets precision itself"


def test_only_choices_a_step_can_switch_are_measured_in_the_run():
    started, starts = start_from_facts(IN_RUN, _facts(), _recipe(), CPU)
    comparisons = comparisons_for(started, IN_RUN, starts)
    assert [c.name for c in comparisons] == ["bf16"]
    (bf16,) = comparisons
    assert bf16.started and started.replace(**bf16.on) == started
    assert bf16.off == {"precision__dtype": "fp32", "precision__grad_scaler": None}
    assert started.replace(**bf16.off).data.batches == "buckets"  # the plan is not switched


# -- the judging ------------------------------------------------------------------------------


def test_the_cost_model_recovers_a_line_and_falls_back_to_work():
    line = cost_model([(w, 0.5 + 0.01 * w) for w in (10, 20, 40, 80)])
    assert line(100) == pytest.approx(1.5)
    assert cost_model([(10, 1.0), (10, 2.0)])(7) == 7.0  # one size: proportional
    assert cost_model([(10, 2.0), (20, 1.0)])(7) == 7.0  # more work cheaper: not believed


def _tuner(planned_steps: int = 1000) -> InRunTuner:
    config = IN_RUN.replace(precision__dtype="bf16")
    comparison = Comparison("bf16", {"precision__dtype": "bf16"}, {"precision__dtype": "fp32"})
    return InRunTuner(config, [], [comparison], planned_steps=planned_steps, device=CPU)


def _drive(tuner: InRunTuner, seconds: dict[str, float], windows: int, loss=(1.0, 1.0)) -> list:
    """Run ``windows`` windows of alternating work (64 and 96 elements) taking
    ``seconds[side]`` per element-hundred, as the engine would; returns the sides run."""
    sides = []
    for i in range(windows):
        side = tuner.side(lambda with_config, without: loss)
        sides.append(side)
        work = 64 if i % 2 else 96
        tuner.window_done(side, seconds[side] * work / 100 * (1 + 0.01 * (i % 3)), work)
    return sides


def test_a_clearly_faster_choice_is_adopted_after_a_few_abba_pairs():
    tuner = _tuner()
    sides = _drive(tuner, {"with": 0.5, "without": 1.0}, 40)
    (comparison,) = tuner.comparisons
    assert comparison.verdict == "adopted"
    assert sides[:8] == ["with", "without", "without", "with"] * 2
    assert MIN_ROUNDS <= len(comparison.pairs) < 10
    assert comparison.speed().ratio == pytest.approx(2.0, rel=0.05)
    assert tuner.config.precision.dtype == "bf16"
    assert set(sides[2 * len(comparison.pairs) + 2 :]) == {"with"}  # measuring has stopped


def test_a_choice_that_is_not_faster_is_dropped_and_the_run_goes_on_without_it():
    tuner = _tuner()
    _drive(tuner, {"with": 1.3, "without": 1.0}, 60)
    (comparison,) = tuner.comparisons
    assert comparison.verdict == "dropped"
    assert tuner.config.precision.dtype == "fp32"
    assert tuner.config_of("with").precision.dtype == "fp32"


def test_a_loss_that_differs_on_the_same_batch_drops_the_choice_before_it_trains_more():
    tuner = _tuner()
    sides = _drive(tuner, {"with": 0.5, "without": 1.0}, 4, loss=(2.0, 1.0))
    (comparison,) = tuner.comparisons
    assert comparison.verdict == "loss differs" and "100.0% > 5%" in comparison.evidence
    assert tuner.config.precision.dtype == "fp32" and not comparison.pairs
    assert sides == ["with"] * 4  # the decided config, on every window


def test_the_slower_side_never_runs_past_its_share_of_the_job():
    tuner = _tuner(planned_steps=100)  # 10% of 100 steps: 10 windows without bf16 at most
    _drive(tuner, {"with": 1.0, "without": 1.0}, 200)
    (comparison,) = tuner.comparisons
    assert comparison.verdict in ("undecided", "dropped")
    assert comparison.windows["without"] <= tuner.budget_windows == 10


def test_the_tuner_state_round_trips():
    tuner = _tuner()
    _drive(tuner, {"with": 0.5, "without": 1.0}, 5)
    restored = _tuner()
    restored.load_state_dict(json.loads(json.dumps(tuner.state_dict())))
    assert restored.comparisons[0].pairs == tuner.comparisons[0].pairs
    assert restored.spent_windows == tuner.spent_windows
    _drive(restored, {"with": 0.5, "without": 1.0}, 40)
    assert restored.comparisons[0].verdict == "adopted"


# -- the engine -------------------------------------------------------------------------------


def test_the_engine_trains_every_step_and_every_sample_once_per_epoch_while_tuning(fast_bf16):
    dataset = Tokens()
    turbo = Turbo(IN_RUN)
    model = TokenModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _, _, loader = turbo.setup(
        model, optimizer, dataset, batch_size=4, lengths=dataset.lengths, planned_steps=200
    )
    assert turbo.config.data.batches == "buckets" and turbo.config.precision.dtype == "bf16"
    dtypes, seen = [], []
    for _ in range(2):
        for batch in loader:
            seen.extend(batch["index"].tolist())
            metrics = turbo.step(token_loss, batch)
            dtypes.append(turbo.steps.hooks.get("precision") is not None)
    assert turbo.optimizer_steps == len(dtypes)
    assert sorted(seen) == sorted(list(range(len(dataset))) * 2)
    bf16, compile_ = turbo.in_run.comparisons
    assert (bf16.name, compile_.name) == ("bf16", "compile")
    assert bf16.verdict == "adopted"
    assert compile_.verdict == "undecided" and compile_.build is None  # not worth a build
    assert False in dtypes and dtypes[-1]  # fp32 windows were measured, bf16 stays
    assert turbo.applied["precision"] is None
    assert torch.isfinite(metrics.loss)


def test_parity_losses_are_of_the_same_batch_and_leave_the_run_untouched():
    """Dropout draws alike on both sides, batch-norm statistics and the random state are put
    back: measuring does not change what the run trains."""
    model = nn.Sequential(MLP(width=8, dropout=0.5), nn.BatchNorm1d(5))
    turbo = Turbo(IN_RUN)
    turbo.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    batch = (torch.randn(16, 8), torch.randint(0, 5, (16,)))
    buffers = [b.clone() for b in model.buffers()]
    before = torch.random.get_rng_state()

    def loss_fn(model, batch):
        return nn.functional.cross_entropy(model(batch[0]), batch[1])

    same, again = turbo._parity_losses(loss_fn, batch, IN_RUN, IN_RUN)
    assert same == again
    assert torch.equal(torch.random.get_rng_state(), before)
    assert all(torch.equal(a, b) for a, b in zip(buffers, model.buffers(), strict=True))


def test_train_keeps_the_verdicts_and_a_resume_continues_the_measuring(fast_bf16, tmp_path):
    recipe = _recipe()
    events: list[str] = []
    checkpoints, tuned = tmp_path / "ckpt", tmp_path / "tuned"
    train(
        recipe, IN_RUN, steps=5, checkpoint_dir=checkpoints, tuned_dir=tuned, on_event=events.append
    )
    saved = json.loads((tuned / "results.json").read_text())
    assert saved["measured"][0]["verdict"] == "measuring"
    pairs_before = saved["measured"][0]["pairs"]
    assert any("bf16 started with" in e for e in events)
    result = train(
        recipe, IN_RUN, steps=40, checkpoint_dir=checkpoints, resume=True, tuned_dir=tuned
    )
    assert result.optimizer_steps == 40
    final = json.loads((tuned / "results.json").read_text())
    bf16, compile_ = final["measured"]
    assert bf16["verdict"] == "adopted" and bf16["pairs"] >= max(pairs_before, MIN_ROUNDS)
    assert compile_["verdict"] == "undecided" and "too few" in compile_["evidence"]
    decided = TurboConfig.from_toml((tuned / "turbo.toml").read_text())
    assert decided.precision.dtype == "bf16" and decided.data.batches == "buckets"
    assert decided.compile.mode == "off"
    assert not decided.tune.in_run  # the next run trains it as decided


def test_the_assumed_horizon_bounds_a_run_that_does_not_say_its_steps():
    tuner = InRunTuner(IN_RUN, [], [], planned_steps=None, device=CPU)
    assert tuner.budget_windows == int(IN_RUN.tune.measure_share * in_run.ASSUMED_STEPS)


def test_a_switchable_transform_the_facts_expect_little_of_is_tried_on_the_jobs_steps(
    fast_chunked_loss,
):
    """A causal LM whose logits hold most of the forward's activations: the chunked loss is
    expected to gain, under what a start needs. Composed but switched off, it is measured
    against the run's own steps (here made twice as fast with it), parity first, and adopted."""
    pytest.importorskip("transformers")
    from recipes import hf_causal_lm

    dataset = hf_causal_lm.documents()
    turbo = Turbo(IN_RUN)
    net = hf_causal_lm.logits_heavy_model()
    _, _, loader = turbo.setup(
        net,
        torch.optim.SGD(net.parameters(), lr=0.01),
        dataset,
        batch_size=4,
        collate_fn=hf_causal_lm.collator(),
        planned_steps=200,
        loss_fn=lambda m, batch: m(**batch).loss,
    )
    chunked, compile_ = turbo.in_run.comparisons
    assert chunked.name == "chunked_loss" and not chunked.started
    assert compile_.name == "compile" and not compile_.started
    assert not turbo.config.chunked_loss.enabled and "chunked_loss" not in turbo.applied
    for _ in range(4):
        for batch in loader:
            turbo.step(lambda m, batch: m(**batch).loss, batch)
    assert chunked.verdict == "adopted" and chunked.windows["without"] >= 3
    assert turbo.config.chunked_loss.enabled and turbo.applied["chunked_loss"] is None
