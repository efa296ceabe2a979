"""The batch plan measured on chunks of the epoch: every sample once per epoch whatever the
sides, the user's real tokens per step, the plan decided on seconds per real token, and a
resumed epoch drawn again as it was."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from conftest import _gemm_rates
from test_in_run import IN_RUN, TokenModel, Tokens, token_loss

from torchturbo import Turbo
from torchturbo.data.chunked_plan import (
    SIDES,
    Chunk,
    ChunkedPlanSampler,
    Draw,
    SidedCollate,
    SidedDataset,
)
from torchturbo.engine import in_run
from torchturbo.engine.in_run import InRunTuner
from torchturbo.techniques import compile as compile_technique


def _modest() -> Tokens:
    """Lengths 20..40: random batches of 4 pad ~17%, length buckets ~2%, a gain the facts
    expect to be modest (~1.2x), so the run measures it."""
    return Tokens(160, shortest=20)


def _sorted_rows(lengths, batch_size):
    """A plan over a chunk: its samples by length, in rows of ``batch_size``."""

    def plan(indices: np.ndarray, seed: int) -> list[list[int]]:
        ranked = sorted(indices.tolist(), key=lambda i: lengths[i])
        return [ranked[i : i + batch_size] for i in range(0, len(ranked), batch_size)]

    return plan


def _cycle(*draws: Draw):
    def draw(epoch: int, index: int) -> Draw:
        return draws[min(index, len(draws) - 1)]

    return draw


def test_every_sample_is_drawn_once_per_epoch_whatever_the_sides_and_sizes():
    lengths = list(np.random.default_rng(0).integers(1, 50, 203))
    draws = [Draw("with", "measure"), Draw("without", "measure"), Draw("without", "hold")]
    sampler = ChunkedPlanSampler(
        lengths,
        4,
        _sorted_rows(lengths, 8),  # the plan draws half the batches of rows
        _cycle(*draws, Draw("with", "rest")),
        measure_batches=2,
        hold_batches=5,
    )
    assert len(sampler) == 51  # before drawing: the user's rows, which no chunk exceeds
    for epoch in range(2):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        keys = [key for batch in batches for key in batch]
        assert sorted(i for _, i in keys) == list(range(203))
        # 8 samples in 1 batch, 8 in 2 rows, 20 in 5 rows, 167 in 21 batches of up to 8.
        assert len(sampler) == len(batches) == 1 + 2 + 5 + 21  # exact once all are drawn
        sides = [c.side for c in sampler.chunks]
        assert sides == ["with", "without", "without", "with"]
        assert [c.measured for c in sampler.chunks] == [True, True, False, False]
        # Each chunk's batches are keyed by its side, and chunk_at finds it.
        for chunk in sampler.chunks:
            positions = range(chunk.first, chunk.first + chunk.batches)
            key = SIDES.index(chunk.side)
            for position in positions:
                assert sampler.chunk_at(position) is chunk
                assert {side for side, _ in batches[position]} == {key}
            indices = [i for p in positions for _, i in batches[p]]
            assert chunk.real_tokens == sum(lengths[i] for i in indices)
    assert sampler.chunk_at(29) is None


def test_a_measuring_chunk_cut_short_by_the_epochs_end_is_not_measured():
    lengths = [10] * 10
    sampler = ChunkedPlanSampler(
        lengths, 2, _sorted_rows(lengths, 2), _cycle(Draw("with", "measure")), measure_batches=3
    )
    list(sampler)
    assert [(c.batches, c.measured) for c in sampler.chunks] == [(3, True), (2, False)]


def test_the_epochs_differ_and_the_same_draws_give_the_same_batches():
    lengths = list(range(1, 65))
    draw = _cycle(Draw("without", "measure"), Draw("with", "rest"))

    def epoch_of(epoch: int) -> list:
        sampler = ChunkedPlanSampler(lengths, 4, _sorted_rows(lengths, 4), draw, seed=3)
        sampler.set_epoch(epoch)
        return list(sampler)

    assert epoch_of(1) == epoch_of(1)
    assert epoch_of(1) != epoch_of(2)


def test_sided_samples_are_collated_by_their_sides_collate():
    dataset = SidedDataset(["a", "b", "c"])
    collate = SidedCollate((lambda xs: ("plan", xs), lambda xs: ("rows", xs)))
    assert len(dataset) == 3 and dataset[(1, 2)] == (1, "c")
    assert collate([dataset[(0, 0)], dataset[(0, 2)]]) == ("plan", ["a", "c"])
    assert collate([dataset[(1, 1)]]) == ("rows", ["b"])


# -- the tuner --------------------------------------------------------------------------------

BUCKETS = {"data__batches": "buckets"}
ROWS = {"data__batches": "rows"}


def _plan_tuner(*others: in_run.Comparison) -> InRunTuner:
    plan = in_run.Comparison("length buckets", BUCKETS, ROWS, per_token=True)
    return InRunTuner(
        IN_RUN.replace(**BUCKETS),
        [],
        [*others, plan],
        planned_steps=1000,
        device=torch.device("cpu"),
    )


def _chunk(tuner: InRunTuner, epoch: int, index: int, per_token: dict[str, float]) -> None:
    """Draw chunk ``index`` and report it trained at ``per_token[side]`` seconds a token."""
    draw = tuner.draw(epoch, index)
    chunk = Chunk(index, draw.side, draw.size == "measure", 0, 4, 1000 + index)
    tuner.chunk_done(chunk, per_token[draw.side] * chunk.real_tokens)


def test_chunks_wait_for_the_window_comparisons_then_measure_abba_then_the_rest_is_the_verdict():
    bf16 = in_run.Comparison("bf16", {"precision__dtype": "bf16"}, {"precision__dtype": "fp32"})
    tuner = _plan_tuner(bf16)
    assert tuner.plan is not None and tuner.current is bf16  # the plan is not a window's
    assert tuner.draw(0, 0) == Draw("with", "hold")  # bf16 is measured on windows now
    bf16.verdict = "adopted"
    sides = [tuner.draw(0, i) for i in range(1, 5)]
    assert [d.side for d in sides] == ["with", "without", "without", "with"]
    assert {d.size for d in sides} == {"measure"}
    assert tuner.draw(0, 2) == sides[1]  # drawn again alike
    assert tuner.plan.verdict == "measuring"
    faster = {"with": 0.5e-3, "without": 1e-3}
    for index in range(5, 40):
        _chunk(tuner, 0, index, faster)
        if tuner.plan.verdict != "measuring":
            break
    assert tuner.plan.verdict == "adopted" and tuner.plan.speed().ratio == pytest.approx(2.0)
    assert tuner.draw(0, index + 1) == Draw("with", "rest")
    assert tuner.config.data.batches == "buckets"


def test_a_plan_not_faster_per_real_token_is_dropped_and_the_rest_is_the_users_rows():
    tuner = _plan_tuner()
    for index in range(40):
        _chunk(tuner, 0, index, {"with": 1e-3, "without": 1e-3})
        if tuner.plan.verdict != "measuring":
            break
    assert tuner.plan.verdict == "dropped" and tuner.config.data.batches == "rows"
    assert tuner.draw(0, index + 1) == Draw("without", "rest")
    # Charged as drawn: a measuring chunk of rows takes 4 windows of the job's share.
    assert tuner.spent_windows == 4 * tuner.plan.windows["without"]


def test_the_plan_is_undecided_once_its_rows_chunks_would_pass_the_jobs_share():
    tuner = _plan_tuner()
    tuner.planned_steps = 200  # a share of 20 windows: the warm chunk of rows and four more
    noisy = iter([1e-3, 2e-3, 0.5e-3, 1.5e-3] * 20)
    for index in range(40):
        draw = tuner.draw(0, index)
        if draw.size != "measure":
            break
        chunk = Chunk(index, draw.side, True, 0, 4, 1000)
        tuner.chunk_done(chunk, next(noisy) * chunk.real_tokens)
    assert tuner.plan.verdict == "undecided" and tuner.spent_windows <= 20
    assert "kept as the facts chose" in tuner.plan.evidence
    assert draw == Draw("with", "rest")  # the started plan stays


def test_a_short_job_leaves_the_plan_as_the_facts_chose_it():
    tuner = _plan_tuner()
    tuner.planned_steps = 100  # a share of 10 windows: not a warm chunk and three pairs
    assert tuner.draw(0, 0) == Draw("with", "rest")
    assert tuner.plan.verdict == "undecided" and "need 16 steps" in tuner.plan.evidence


def test_the_draws_of_the_epoch_survive_a_resume_and_a_new_epoch_draws_anew():
    tuner = _plan_tuner()
    for index in range(3):
        _chunk(tuner, 4, index, {"with": 1e-3, "without": 2e-3})
    restored = _plan_tuner()
    restored.load_state_dict(json.loads(json.dumps(tuner.state_dict())))
    assert [restored.draw(4, i) for i in range(3)] == [tuner.draw(4, i) for i in range(3)]
    # The ABBA count carried over: chunks 3-5 are with, with, without.
    assert [restored.draw(4, i) for i in range(3, 6)] == [tuner.draw(4, i) for i in range(3, 6)]
    assert [tuner.draw(4, i).side for i in range(3, 6)] == ["with", "with", "without"]
    assert restored.plan.windows == tuner.plan.windows
    assert restored.spent_windows == tuner.spent_windows
    assert restored.draw(5, 0) == tuner.draw(5, 0) and len(restored._draws[1]) == 1


class _Reports:
    def __init__(self) -> None:
        self.chunks: list[tuple[Chunk, float]] = []

    def chunk_done(self, chunk: Chunk, seconds: float) -> None:
        self.chunks.append((chunk, seconds))


def test_the_chunk_clock_times_whole_chunks_and_charges_each_its_own_batching():
    reports = _Reports()
    clock = in_run.ChunkClock(reports, torch.device("cpu"))
    measured = Chunk(0, "with", True, 0, 3, 100, plan_s=0.25)
    clock.arrive(measured, 0, planning_s=1.0)
    assert clock.measuring
    for position in (1, 2):
        clock.stepped(planning_s=1.0)
        clock.arrive(measured, position, planning_s=1.0)
    # The loader batched the next chunk ahead, inside this one's time: 5 s, not this chunk's.
    clock.stepped(planning_s=6.0)
    [(chunk, seconds)] = reports.chunks
    assert chunk is measured and -5.0 + 0.25 < seconds < -5.0 + 0.25 + 1.0
    # A chunk first seen after its first batch (a resume inside it) is not reported.
    resumed = Chunk(1, "without", True, 3, 3, 100)
    for position in (4, 5):
        clock.arrive(resumed, position, planning_s=6.0)
        clock.stepped(planning_s=6.0)
    held = Chunk(2, "with", False, 6, 64, 100)
    clock.arrive(held, 6, planning_s=6.0)
    clock.stepped(planning_s=6.0)
    assert len(reports.chunks) == 1 and not clock.measuring


# -- the engine -------------------------------------------------------------------------------


@pytest.fixture
def buckets_twice_as_fast(monkeypatch):
    """bf16 measured slow (only the plan is measured), no compile built aside, and chunks of
    length buckets taking half the seconds a real token of rows takes."""
    _gemm_rates(monkeypatch, 0.5)
    monkeypatch.setattr(compile_technique, "SECONDS_PER_LEAF", float("inf"))
    real = InRunTuner.chunk_done

    def timed(self, chunk, seconds):
        per_token = 0.5e-4 if chunk.side == "with" else 1e-4
        return real(self, chunk, per_token * chunk.real_tokens)

    monkeypatch.setattr(InRunTuner, "chunk_done", timed)


def test_the_engine_measures_a_modest_plan_on_chunks_and_trains_every_sample_once_per_epoch(
    buckets_twice_as_fast,
):
    dataset = _modest()
    turbo, loader = _modest_run(dataset)
    plan = turbo.in_run.plan
    assert plan is not None and plan.started and 1.1 < plan.expected_gain < 1.5
    steps = 0
    for _ in range(4):
        seen = []
        for batch in loader:
            seen.extend(batch["index"].tolist())
            metrics = turbo.step(token_loss, batch)
            steps += 1
        assert sorted(seen) == list(range(len(dataset)))
    assert turbo.optimizer_steps == steps
    assert plan.verdict == "adopted" and len(plan.pairs) >= 3
    assert plan.speed().ratio == pytest.approx(2.0)
    assert turbo.config.data.batches == "buckets"
    assert torch.isfinite(metrics.loss)


def _modest_run(dataset: Tokens) -> tuple[Turbo, object]:
    turbo = Turbo(IN_RUN)
    model = TokenModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _, _, loader = turbo.setup(
        model, optimizer, dataset, batch_size=4, lengths=dataset.lengths, planned_steps=400
    )
    return turbo, loader


def test_a_run_resumed_inside_a_measuring_epoch_draws_it_again_and_trains_the_rest_once(
    buckets_twice_as_fast,
):
    dataset = _modest()
    turbo, loader = _modest_run(dataset)
    batches = iter(loader)
    before = []
    for _ in range(10):  # inside the third chunk: three drawn, not a whole ABBA round
        batch = next(batches)
        before.extend(batch["index"].tolist())
        turbo.step(token_loss, batch)
    state = copy.deepcopy(turbo.state_dict())
    rest = [i for batch in batches for i in batch["index"].tolist()]
    assert sorted(before + rest) == list(range(len(dataset)))
    drawn = [(c.side, c.first, c.batches) for c in loader.loader.batch_sampler.chunks]
    assert {side for side, _, _ in drawn} == {"with", "without"}

    resumed, again = _modest_run(dataset)
    resumed.load_state_dict(state)
    assert resumed.in_run.plan.verdict == "measuring"
    redrawn = [i for batch in again for i in batch["index"].tolist()]
    assert redrawn == rest  # the same batches: the epoch's chunks drawn again alike
    assert [(c.side, c.first, c.batches) for c in again.loader.batch_sampler.chunks] == drawn
