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
from torchturbo.techniques.framework.decide import (
    FUTILITY_CONFIDENCE,
    MIN_ROUNDS,
    WIDEST_SHOWN,
    WORTH_MEASURING,
)

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


def replacements(results: dict) -> dict[str, tuple[str, ...]]:
    """For each kept adoption that took back what an earlier one set, the earlier ones, by
    name: length buckets adopted over packing sets ``[data] batches`` back, fp16+scaler
    adopted over bf16 sets ``[precision] dtype`` anew. Read from the configs the results hold
    (each adoption's whole config), so that the tables say what turbo.toml holds."""
    rows = adopted_rows(results)
    before = flat_settings(baseline_candidate(results).get("config"))
    changed: list[tuple[str, dict[str, Any]]] = []
    out: dict[str, tuple[str, ...]] = {}
    for row in rows:
        after = flat_settings(row.get("config"))
        if not after:
            continue
        mine = {key: value for key, value in after.items() if before.get(key) != value}
        undone = tuple(
            name
            for name, theirs in changed
            if any(key in mine and after[key] != value for key, value in theirs.items())
        )
        if undone:
            out[str(row.get("name"))] = undone
        changed.append((str(row.get("name")), mine))
        before = after
    return out


def adoption_label(
    name: str, results: dict, replaced: dict[str, tuple[str, ...]] | None = None
) -> str:
    """``length buckets instead of packing`` for an adoption that replaced another, else the
    name as it is."""
    undone = (replacements(results) if replaced is None else replaced).get(name)
    return f"{name} instead of {' and '.join(undone)}" if undone else name


def replaced_by(results: dict) -> dict[str, str]:
    """Each adoption a later one replaced, with the one that replaced it."""
    return {old: new for new, olds in replacements(results).items() for old in olds}


def flat_settings(config: Any) -> dict[str, Any]:
    """A config dict as ``section.field`` -> value (sections are the nested dicts)."""
    if not isinstance(config, dict):
        return {}
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update({f"{key}.{field}": inner for field, inner in value.items()})
        else:
            flat[key] = value
    return flat


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
    of too few rounds, or too wide to bound anything, is left out (``decide.describe``). A "not
    faster" decision shows the bound that decided it, ``0.94x (<= 1.01 at 95%)``: the 99.9%
    interval is the one an adoption must clear, and says nothing of that decision."""
    ratio, low, high = num(row.get("ratio")), num(row.get("ratio_low")), num(row.get("ratio_high"))
    if ratio is None:
        return "n/a"
    bound = num(row.get("ratio_plausible_high"))
    if row.get("decision") == "not faster" and bound is not None and bound < 1 + WORTH_MEASURING:
        return f"{ratio:.2f}x (<= {bound:.2f} at {FUTILITY_CONFIDENCE:.0%})"
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
