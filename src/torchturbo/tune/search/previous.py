"""Tuning again into the same ``--out``: reuse what the previous run measured.

A previous results.json is reused only when it was made for the same recipe (name, batch size,
dataset size, parameter count), machine, torch and torchturbo versions, process count and tuner
options (memory budget, loss tolerance, planned steps): otherwise its verdicts might not hold, and
the run starts afresh, saying why. Reused are the candidates it decided (adopted or rejected by a
measurement); candidates it could not measure for lack of time are measured now, on top of the
config it chose, which is rebuilt first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

import torchturbo
from torchturbo.data.length import length_or_none
from torchturbo.distributed.launch import current_env
from torchturbo.measure.system import cpu_model
from torchturbo.recipe import Recipe
from torchturbo.tune.search.horizon import horizon
from torchturbo.tune.search.outcome import Outcome, outcome_from_dict
from torchturbo.tune.search.state import TuneOptions


def fingerprint(
    recipe: Recipe, options: TuneOptions, device: torch.device, parameters: int
) -> dict[str, Any]:
    """What must match for a previous run's verdicts to hold for this one."""
    return {
        "recipe": recipe.name,
        "batch_size": recipe.batch_size,
        "samples": length_or_none(recipe.dataset),
        "parameters": parameters,
        "device": str(device),
        "cpu": cpu_model(),
        "cuda": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "processes": current_env().world_size,
        "torch": torch.__version__,
        "torchturbo": torchturbo.__version__,
        "memory_budget": options.memory_budget,
        "find_batch": options.find_batch,
        "loss_tolerance": options.loss_tolerance,
        "planned_steps": horizon(recipe, options.planned_steps).steps,
    }


def is_reusable(verdict: str, stage: str) -> bool:
    """A candidate decided by measurement (an undecided one is measured again); the loader is
    measured afresh every run."""
    return verdict in ("adopted", "rejected") and stage != "data_loader"


@dataclass(frozen=True)
class Previous:
    """The reusable part of a previous run."""

    source: str
    #: Candidates it decided by measurement, marked as reused.
    outcomes: tuple[Outcome, ...]
    #: Its adoptions, in order (their configs chain: the last one is the chosen config).
    adopted: tuple[Outcome, ...]

    @staticmethod
    def parse(
        previous: Mapping[str, Any] | None, current: dict[str, Any], source: str
    ) -> tuple[Previous | None, str]:
        """The reusable part of ``previous`` (a results.json), or None and why not."""
        if previous is None:
            return None, ""
        theirs = previous.get("fingerprint")
        if not isinstance(theirs, dict):
            return None, f"{source} has no fingerprint (an older torchturbo): measured afresh"
        differ = [key for key in current if theirs.get(key) != current[key]]
        if differ:
            first = differ[0]
            return None, (
                f"{source} was made with another {first} ({theirs.get(first)!r}, now "
                f"{current[first]!r}): measured afresh"
            )
        try:
            rows = [outcome_from_dict(row) for row in previous.get("candidates") or []]
        except (KeyError, TypeError, ValueError) as err:
            return (
                None,
                f"{source} could not be read ({type(err).__name__}: {err}): measured afresh",
            )
        decided = tuple(o for o in rows if is_reusable(o.verdict, o.stage))
        # In the order they were adopted (rows are in stage order): each adoption's config
        # contains the ones before it, so the last is the config the run chose.
        by_name = {o.name: o for o in decided if o.verdict == "adopted"}
        adopted = tuple(by_name[n] for n in previous.get("adopted") or [] if n in by_name)
        note = f"reused {len(decided)} measured candidates from {source}"
        return Previous(source, decided, adopted), note

    @staticmethod
    def first(
        sources: Sequence[tuple[Mapping[str, Any], str]], current: dict[str, Any]
    ) -> tuple[Previous | None, str]:
        """The first of ``sources`` (a results.json and its name) made for this run; else None
        and why the first was not."""
        notes = []
        for previous, source in sources:
            reuse, note = Previous.parse(previous, current, source)
            if reuse is not None:
                return reuse, note
            notes.append(note)
        return None, next(iter(notes), "")
