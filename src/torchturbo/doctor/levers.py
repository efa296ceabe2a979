"""The doctor's levers with one figure each: measured where the doctor timed the lever, else
expected from the facts.

``techniques.framework.levers`` gives every lever an expected gain from facts (GEMM rates,
convolution share, padding), which is what the tuner orders its work by. The doctor also times some
levers on the model itself (bf16, channels_last: ``doctor.gains``). Listing the expectation beside
the measurement would show two figures for one thing ("mixed precision: within noise ~0.80x", then
"bf16 ~1.83x" first among the levers), so a measured lever is listed and ranked by what it measured,
with its expectation as context; and a precision lever the doctor did not time is scaled by how its
measured sibling fell short of (or beat) the same rule, and says so.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torchturbo.doctor.diagnosis import Lever
from torchturbo.doctor.gains import Gain, deciding
from torchturbo.techniques.framework.levers import RankedLever

#: Levers that the same rule (Amdahl over measured GEMM rates) expects: one measured member
#: says how far the rule holds for the others.
_PRECISIONS = ("bf16", "fp16", "tf32")
#: The doctor's quick comparisons, by lever: the variant each lever is timed as.
_TIMED_AS = {"channels_last": "channels_last"}


def with_measurements(
    ranked: Sequence[RankedLever], speedups: Mapping[str, Gain] | None
) -> list[Lever]:
    """``ranked`` as the doctor's levers, measured figures in place of expectations, sorted by
    the figure each one shows (levers that cannot help last)."""
    speedups = speedups or {}
    measured = {name: _deciding(name, speedups) for name in _timed(ranked, speedups)}
    sibling = next(
        (
            (name, gain, expected)
            for name, gain in measured.items()
            if name in _PRECISIONS
            and (expected := _expected(ranked, name)) is not None
            and expected > 0
        ),
        None,
    )
    levers = []
    for lever in ranked:
        expected, evidence = lever.expectation.gain, lever.expectation.evidence
        gain = measured.get(lever.name)
        if gain is not None:
            verdict = "faster" if gain.faster else "within noise"
            prior = f"; expected ~{expected:.2f}x: {evidence}" if expected is not None else ""
            text = f"measured here {gain.describe()}, {verdict}{prior}"
            levers.append(Lever(lever.name, gain.speed.ratio, text, measured=True))
        elif expected is not None and sibling is not None and lever.name in _PRECISIONS:
            name, sibling_gain, sibling_expected = sibling
            scale = sibling_gain.speed.ratio / sibling_expected
            text = (
                f"expected ~{expected:.2f}x: {evidence}; {name}, expected ~{sibling_expected:.2f}x "
                f"by the same rule, measured ~{sibling_gain.speed.ratio:.2f}x here, so "
                f"~{expected * scale:.2f}x is more likely"
            )
            levers.append(Lever(lever.name, expected * scale, text))
        else:
            levers.append(Lever(lever.name, expected, evidence))
    return sorted(levers, key=lambda lever: -(lever.expected_gain or 0.0))


def _deciding(name: str, speedups: Mapping[str, Gain]) -> Gain:
    """The measurement ``name``'s verdict rests on: alone, or on top of the precision where
    the doctor timed that too (``channels_last``), as its checklist item decides."""
    alone = _TIMED_AS.get(name, name)
    on_top = [gain for variant, gain in speedups.items() if variant.endswith(f"+{alone}")]
    return deciding([speedups[alone], *on_top])


def _timed(ranked: Sequence[RankedLever], speedups: Mapping[str, Gain]) -> list[str]:
    return [lever.name for lever in ranked if _TIMED_AS.get(lever.name, lever.name) in speedups]


def _expected(ranked: Sequence[RankedLever], name: str) -> float | None:
    return next((lever.expectation.gain for lever in ranked if lever.name == name), None)
