"""Small readers of a trial's batches and losses. (A trial's batches are its config's batch
plan, ``trials.trial.TrialBatches``; micro-batches are the engine's own.)"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torchturbo.reliability.oom import leading_size


def batch_size(batches: list[Any]) -> int | None:
    """Samples in the first batch, or None when that cannot be told."""
    try:
        return leading_size(batches[0]) if batches else None
    except ValueError:
        return None


def window_losses(losses: Sequence[float], steps: int) -> list[float]:
    """Per optimizer step losses: micro-batch losses averaged over each accumulation window."""
    return [sum(losses[i : i + steps]) / steps for i in range(0, len(losses) - steps + 1, steps)]
