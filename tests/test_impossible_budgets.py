"""Budgets no run can keep end in exit 2 and one line with the figure that makes them
impossible and the smallest budget that could work, before more time is spent and without
writing anything; budgets that can be kept run (the negative controls)."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchturbo.cli import main
from torchturbo.techniques.framework.decide import MIN_ROUNDS
from torchturbo.tune.search.budget import (
    BudgetError,
    memory_floor,
    one_decision_s,
    readable_bytes,
    readable_seconds,
    refuse_impossible_memory_budget,
    refuse_short_time_budget,
)

TINY = f"{Path(__file__).parent / 'recipes' / 'tiny.py'}:recipe"


def test_one_decision_is_the_baseline_so_far_one_candidate_the_confirmation_and_the_report():
    needed = one_decision_s(
        spent_s=3.0, build_s=1.0, step_s=0.5, steps_per_round=2, warm_steps=1, report_s=5.0
    )
    candidate = 1.0 + 3 * 0.5 + MIN_ROUNDS * 2 * (0.5 + 0.5)  # build, 3 steps, paired rounds
    assert needed > 3.0 + candidate + 5.0  # the confirmation's rounds come on top
    slower = one_decision_s(
        spent_s=3.0, build_s=1.0, step_s=2.0, steps_per_round=1, warm_steps=1, report_s=5.0
    )
    assert slower > needed  # a slower step needs more


def test_a_time_budget_under_one_decision_names_the_step_and_the_budget_to_give():
    with pytest.raises(BudgetError) as raised:
        refuse_short_time_budget(5.0, 31.2, 0.95)
    message = str(raised.value)
    assert "--time-budget 5 s cannot decide a single candidate" in message
    assert "the fp32 eager step takes 0.95 s" in message
    assert message.endswith("give --time-budget 35s or more")
    refuse_short_time_budget(35.0, 31.2, 0.95)  # negative control: enough


def test_a_memory_budget_under_the_weights_gradients_and_optimizer_state_is_refused():
    kib = 1024
    assert memory_floor(10 * kib, 10 * kib, 20 * kib) == 40 * kib
    with pytest.raises(BudgetError) as raised:
        refuse_impossible_memory_budget(
            kib, weights=10 * kib, gradients=10 * kib, optimizer_state=20 * kib, step_bytes=None
        )
    message = str(raised.value)
    assert "optimizer state 20.0 KiB = 40.0 KiB" in message
    assert "give --memory-budget 40KiB or more" in message
    refuse_impossible_memory_budget(  # negative control: the floor itself is not refused
        40 * kib, weights=10 * kib, gradients=10 * kib, optimizer_state=20 * kib, step_bytes=None
    )


@pytest.mark.parametrize(
    ("seconds", "typed"), [(16.2, "20s"), (120.0, "120s"), (121.0, "3m"), (9000.0, "3h")]
)
def test_the_budget_to_give_is_rounded_up_to_what_one_types(seconds, typed):
    assert readable_seconds(seconds) == typed


@pytest.mark.parametrize(
    ("size", "typed"),
    [(900, "900B"), (1536, "1.5KiB"), (44851, "44KiB"), (3 * 2**30 + 1, "3.1GiB")],
)
def test_the_size_to_give_is_rounded_up_to_what_one_types(size, typed):
    assert readable_bytes(size) == typed


@pytest.mark.slow
@pytest.mark.parametrize(
    ("budget", "expected"),
    [
        (["--memory-budget", "1KiB"], "is below what any step of this model holds: weights"),
        (["--time-budget", "1"], "--time-budget 1 s cannot decide a single candidate"),
    ],
)
def test_the_command_exits_2_before_measuring_and_writes_nothing(
    budget, expected, tmp_path, capsys
):
    out = tmp_path / "report"
    code = main(["tune", TINY, "--device", "cpu", *budget, "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and expected in err[0], err
    assert "or more" in err[0]  # the smallest budget that could work
    assert not out.exists()
