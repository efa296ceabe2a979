"""What a lever is expected to buy on this model and machine, before anything is trained: the
shape of the answer, and the order of work it gives.

The tuner measures candidates in order of expected gain per second of measuring, and the doctor
ranks the same levers by the same numbers (each technique names its levers: ``Technique.levers``,
ranked by ``techniques.registry.ranked_levers``), so the two never disagree about what to try
first. Each estimate lives with its technique (``precision_gain`` in ``precision.py``,
``compile_gain`` in ``compile.py``, ...): a prior built from facts measured in seconds
(``framework.facts``): the rate of a matrix product in each precision against fp32 on this
device, the padding that length buckets would remove, the share of the FLOPs in convolutions,
whether batch shapes vary. They order the work and explain it; only the tuner's paired
measurement decides what is adopted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: The gain assumed for a lever with no better prior (DDP bucket sizes).
SMALL_GAIN = 1.03


@dataclass(frozen=True)
class Expectation:
    """A lever's expected speed-up, or why it cannot help here, with the fact behind either."""

    gain: float | None
    evidence: str

    @property
    def applicable(self) -> bool:
        return self.gain is not None


def amdahl_gain(share: float, speedup: float) -> float:
    """The whole step's speed-up when a part taking ``share`` of it runs ``speedup`` times
    faster (Amdahl's law)."""
    return 1 / (1 - share * (1 - 1 / speedup))


def priority(gain: float | None, cost_s: float) -> float:
    """Expected gain per second of measuring: log-gain, so that gains compose by adding."""
    if gain is None or gain <= 1:
        return 0.0
    return math.log(gain) / max(cost_s, 1e-3)


@dataclass(frozen=True)
class RankedLever:
    name: str
    expectation: Expectation
