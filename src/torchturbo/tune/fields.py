"""Values read from the tuner's results and formatted as table cells.

The tables, the summary lines and the plots all read the same ``results`` dict, in which any
field the tuner could not measure is null. Reading goes through here so that null, NaN and
non-numbers are treated alike everywhere, and a missing value prints as "n/a" rather than as a
made-up number.
"""

from __future__ import annotations

import math
from typing import Any

from torchturbo.report import format_bytes

BASELINE_LABEL = "fp32 eager"


# --- reading the results: tolerant of nulls, since unmeasured fields are null -------------------


def num(value: Any) -> float | None:
    """A finite number, or None for null, NaN and anything that is not a number."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def ratio(value: float | None, reference: float | None) -> float | None:
    return value / reference if value is not None and reference else None


def baseline_candidate(results: dict) -> dict:
    """The candidate measured for stage "baseline", if the tuner recorded one (else empty)."""
    return next((c for c in results.get("candidates") or [] if c.get("stage") == "baseline"), {})


def adopted_candidate(results: dict, name: str) -> dict:
    """The measurement behind an adopted name: its adopted candidate, else its stage's record."""
    candidates = results.get("candidates") or []
    for c in candidates:
        if c.get("name") == name and c.get("verdict") == "adopted":
            return c
    stage = next((s for s in results.get("stages") or [] if s.get("best") == name), {})
    return {"stage": stage.get("stage"), "name": name, **stage}


# --- formatting -----------------------------------------------------------------------------


def fmt_rate(value: Any) -> str:
    v = num(value)
    if v is None:
        return "n/a"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def fmt_x(value: Any) -> str:
    v = num(value)
    return "n/a" if v is None else f"{v:.2f}x"


def fmt_pct(value: Any) -> str:
    v = num(value)
    return "n/a" if v is None else f"{100 * v:.1f}%"


def fmt_float(value: Any, digits: int) -> str:
    v = num(value)
    return "n/a" if v is None else f"{v:.{digits}f}"


def fmt_int(value: Any) -> str:
    v = num(value)
    return "n/a" if v is None else f"{v:,.0f}"


def fmt_bytes(value: Any) -> str:
    v = num(value)
    return format_bytes(None if v is None else int(v))


def fmt_parity(parity: Any) -> str:
    if not isinstance(parity, dict):
        return "n/a"
    if parity.get("finite") is False:
        return "non-finite"
    return fmt_pct(parity.get("relative_diff"))
