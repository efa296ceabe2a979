"""The job the tuner judges candidates for: how many steps it trains, and where that came from.

A one-time cost (a compile) pays off only over enough steps, so the job's length decides whether
it is adopted. It is taken from the most specific place that knows it: ``--planned-steps``
(``TuneOptions.planned_steps``), else the recipe (which ``recipe_from_trainer`` and
``recipe_from_lightning`` fill from the trainer's own step or epoch count), else
:data:`ASSUMED_STEPS`, which the headline then names as an assumption.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchturbo.recipe import Recipe

#: The horizon when nothing says how long the job is: a short fine-tune's order of magnitude.
ASSUMED_STEPS = 1_000


@dataclass(frozen=True)
class Horizon:
    """The planned job: ``steps`` batches per process, ``source`` saying who said so."""

    steps: int
    source: str
    assumed: bool = False

    def describe(self) -> str:
        """``96 steps (the Trainer's num_train_epochs=1 x 96 batches)``."""
        return f"{self.steps:,} steps ({self.source})"


def horizon(recipe: Recipe, planned_steps: int | None) -> Horizon:
    """The job's length: ``planned_steps`` (the command line) over the recipe's over the
    assumption."""
    if planned_steps is not None:
        return Horizon(planned_steps, "--planned-steps")
    if recipe.planned_steps is not None:
        return Horizon(recipe.planned_steps, recipe.planned_steps_source)
    return Horizon(
        ASSUMED_STEPS,
        "assumed: neither the recipe nor --planned-steps says how long the job is",
        assumed=True,
    )
