"""Values read from the tuner's results and formatted as table cells.

The tables, the summary lines and the plots all read the same ``results`` dict, in which any
field the tuner could not measure is null. Reading goes through here so that null, NaN and
non-numbers are treated alike everywhere, and a missing value prints as "n/a" rather than as a
made-up number.
"""

from __future__ import annotations

import math
from typing import Any

from torchturbo.output.tables import format_bytes
from torchturbo.tune.decide import MIN_ROUNDS, WIDEST_SHOWN

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
    """The baseline's row ("reference" verdict), if the results hold one (else empty)."""
    return next((c for c in results.get("candidates") or [] if c.get("stage") == "baseline"), {})


def adopted_rows(results: dict) -> list[dict]:
    """The row of every adoption the confirmation kept, in the order they were adopted."""
    rows = {
        c.get("name"): c for c in results.get("candidates") or [] if c.get("verdict") == "adopted"
    }
    return [rows[name] for name in results.get("adopted") or [] if name in rows]


def dropped(results: dict) -> set[str]:
    """Adoptions the confirmation dropped (it could not reproduce them)."""
    confirmation = results.get("confirmation")
    return set(confirmation.get("dropped") or []) if isinstance(confirmation, dict) else set()


# --- formatting -----------------------------------------------------------------------------


def fmt_rate(value: Any) -> str:
    v = num(value)
    if v is None:
        return "n/a"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def fmt_x(value: Any) -> str:
    v = num(value)
    return "n/a" if v is None else f"{v:.2f}x"


def fmt_interval(row: dict) -> str:
    """``1.31x (1.12-1.52)``: a measured ratio with its decision interval, or n/a; an interval
    of too few rounds, or too wide to bound anything, is left out (``decide.describe``)."""
    ratio, low, high = num(row.get("ratio")), num(row.get("ratio_low")), num(row.get("ratio_high"))
    if ratio is None:
        return "n/a"
    rounds = num(row.get("rounds"))
    if low is None or high is None:
        return f"{ratio:.2f}x"
    if (rounds is not None and rounds < MIN_ROUNDS) or not low > 0 or high / low > WIDEST_SHOWN:
        return f"{ratio:.2f}x (unbounded)"
    return f"{ratio:.2f}x ({low:.2f}-{high:.2f})"


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
