"""The planned job's length: --planned-steps over the recipe's over an assumed horizon."""

from __future__ import annotations

import pytest
from test_tune import tiny_recipe

from torchturbo.recipe import RecipeError
from torchturbo.tune.search.horizon import ASSUMED_STEPS, horizon


def test_the_command_line_wins_over_the_recipe_which_wins_over_the_assumption():
    planned = tiny_recipe(planned_steps=96, planned_steps_source="the Trainer's max_steps=96")
    assert horizon(planned, 500).steps == 500 and horizon(planned, 500).source == "--planned-steps"
    assert horizon(planned, None).describe() == "96 steps (the Trainer's max_steps=96)"
    assumed = horizon(tiny_recipe(), None)
    assert assumed.steps == ASSUMED_STEPS and assumed.assumed and "assumed" in assumed.source


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_a_recipe_refuses_a_planned_length_that_is_no_positive_int(bad):
    with pytest.raises(RecipeError, match="planned_steps must be a positive int"):
        tiny_recipe(planned_steps=bad)
