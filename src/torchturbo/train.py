"""A checkpointed training run of a recipe: what ``torchturbo train`` runs.

It trains for a number of optimizer steps with the engine, saves a checkpoint every
``save_every`` steps and at the end, resumes from the newest valid checkpoint when asked, and
reports the micro-batch the run settled on when out-of-memory (or the activation budget) made
the engine split batches. The loop is the one ``docs/reliability.md`` shows, so that a resumed
run continues bit-identically.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torchturbo.checkpoint import checkpoint_name
from torchturbo.config import TurboConfig
from torchturbo.engine import Turbo
from torchturbo.recipe import Recipe


@dataclass(frozen=True)
class TrainResult:
    """How a run ended."""

    optimizer_steps: int
    #: Mean loss of the last batch trained (None when no step was left to train).
    last_loss: float | None
    #: The checkpoint the run resumed from, and the last one it wrote.
    resumed_from: Path | None
    saved: Path | None
    #: Pieces per batch and samples in the largest piece after out-of-memory splits.
    micro_batch_split: int
    micro_batch_size: int | None
    events: tuple[str, ...]


def train(
    recipe: Recipe,
    config: TurboConfig,
    *,
    steps: int,
    checkpoint_dir: str | Path | None = None,
    save_every: int = 0,
    resume: bool = False,
    on_event: Callable[[str], None] | None = None,
) -> TrainResult:
    """Train ``recipe`` for ``steps`` optimizer steps (counted across resumes).

    ``save_every`` > 0 saves every that many optimizer steps into ``checkpoint_dir``, which is
    also saved at the end; ``resume`` continues from its newest valid checkpoint.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps = {steps!r} is invalid: expected a positive int")
    if save_every < 0:
        raise ValueError(f"save_every = {save_every} is invalid: expected >= 0 (0 = at the end)")
    if (resume or save_every) and checkpoint_dir is None:
        raise ValueError("resume and save_every need a checkpoint directory (checkpoint_dir=)")
    turbo = Turbo(config)
    model, optimizer = recipe.build()
    _, _, loader = turbo.setup(
        model,
        optimizer,
        recipe.dataset,
        batch_size=recipe.batch_size,
        collate_fn=recipe.collate_fn(),
        seed=recipe.seed,
        lengths=recipe.lengths,
    )
    assert loader is not None
    resumed_from = turbo.load(checkpoint_dir) if resume else None
    saved, last_loss, seen_events = None, None, 0
    try:
        while turbo.optimizer_steps < steps:
            if len(loader) == 0:
                raise ValueError(f"recipe {recipe.name!r}: the data loader yields no batch")
            for batch in loader:
                metrics = turbo.step(recipe.loss_fn, batch)
                for event in turbo.microbatcher.events[seen_events:]:
                    if on_event is not None:
                        on_event(event)
                seen_events = len(turbo.microbatcher.events)
                if not metrics.optimizer_stepped:
                    continue
                last_loss = float(metrics.loss)
                if save_every and turbo.optimizer_steps % save_every == 0:
                    saved = turbo.save(checkpoint_dir)
                if turbo.optimizer_steps >= steps:
                    break
        just_saved = saved is not None and saved.name == checkpoint_name(turbo.optimizer_steps)
        if checkpoint_dir is not None and not just_saved:
            saved = turbo.save(checkpoint_dir)
    finally:
        turbo.close()
    return TrainResult(
        optimizer_steps=turbo.optimizer_steps,
        last_loss=last_loss,
        resumed_from=resumed_from,
        saved=saved,
        micro_batch_split=turbo.microbatcher.split,
        micro_batch_size=turbo.microbatcher.micro_batch_size,
        events=tuple(turbo.microbatcher.events),
    )
