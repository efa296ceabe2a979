"""What an ``apply_*`` function did: one result type for every technique.

A technique that cannot apply (channels_last on a model without convolutions, checkpointing
that selected no block, torch.compile that failed) must say so rather than fall back silently:
the engine reads ``applied`` to decide what it does next (NHWC inputs or not), and reports
``reason`` in ``Turbo.applied``, the bench table and the doctor.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class TechniqueResult:
    """``applied`` or not, and ``reason`` exactly when not; ``targets`` names what changed
    (the qualified names of checkpointed blocks, for instance)."""

    technique: str
    applied: bool
    reason: str | None = None
    targets: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.applied == (self.reason is not None):
            raise ValueError(
                f"TechniqueResult({self.technique!r}): applied={self.applied} with "
                f"reason={self.reason!r}; a reason is given exactly when it did not apply"
            )


def applied(technique: str, targets: tuple[str, ...] = ()) -> TechniqueResult:
    """The technique took effect (on ``targets``, where it names them)."""
    return TechniqueResult(technique=technique, applied=True, targets=targets)


def not_applied(technique: str, reason: str) -> TechniqueResult:
    """The technique did not take effect, and why (one line, for reports)."""
    return TechniqueResult(technique=technique, applied=False, reason=reason)


def reasons(results: Mapping[str, TechniqueResult]) -> dict[str, str | None]:
    """Technique -> None when it took effect, else why not: the report form of ``results``."""
    return {name: result.reason for name, result in results.items()}
