"""Sizes, durations and switches as people type them: ``20GiB``, ``512M``, ``90s``, ``1m30s``,
``1.5h``, ``true``/``off``.

Durations are read by ``pytimeparse`` (``90s``, ``90sec``, ``1m30s``, ``5 minutes``, ``1.5h``,
``1:30``), plus plain numbers as seconds, which it does not read. Sizes are read here: bitmath,
the maintained size library, reads ``b`` as bits (``512Mb`` is 64 MB) and lets the case of a
letter change the base (``10KB`` is KiB but ``10kB`` is kB), both traps in a memory budget.
Here case never matters, ``B`` is always bytes, and the suffixes follow GNU coreutils: a bare
``K``/``M``/``G``/``T``/``P``/``E`` and ``KiB``... are powers of 1024, ``KB``... powers of 1000.

Both refuse what no run can use, with one line that says what was expected: zero, negative,
``inf``/``nan`` and values beyond the limits below.
"""

from __future__ import annotations

import argparse
import re
from decimal import Decimal, InvalidOperation

import pytimeparse

#: Largest size accepted: torch counts bytes in int64.
MAX_BYTES = 2**63 - 1
#: Longest duration accepted: a time budget of more than a year is a typo, not a plan.
MAX_SECONDS = 365 * 24 * 3600
#: Longer strings are not a size or a duration (and would only slow the parser down).
_MAX_TEXT = 64

#: Kilo, mega, giga, tera, peta, exa: 1000 or 1024 to the power of the position plus one.
_PREFIXES = "kmgtpe"
_SIZE = re.compile(r"\s*(?P<number>[+-]?[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(?P<unit>[a-z]*)\s*$")
_SIZE_EXAMPLES = "e.g. 20GiB, 20G, 512MB or a number of bytes"
_DURATION_EXAMPLES = "e.g. 90, 90s, 1m30s, 5m or 1.5h"


#: The words a boolean option takes after ``=``: ``--resume=true``, ``--chunked_loss.enabled=off``.
BOOLEAN_WORDS = {
    "true": True,
    "false": False,
    "yes": True,
    "no": False,
    "on": True,
    "off": False,
    "1": True,
    "0": False,
}


class UnitError(ValueError, argparse.ArgumentTypeError):
    """A size or duration that cannot be read or used; the message names it and the form.

    An ``ArgumentTypeError`` too, so that argparse prints this message for ``type=parse_size``.
    """


def parse_size(text: str) -> int:
    """Bytes in ``text``: ``20GiB`` and ``20G`` are 20 x 2**30, ``20GB`` is 20 x 10**9."""
    match = _SIZE.match(text.lower()) if len(text) <= _MAX_TEXT else None
    multiplier = _size_multiplier(match["unit"]) if match else None
    if match is None or multiplier is None:
        raise UnitError(f"{text!r} is not a size: use {_SIZE_EXAMPLES}")
    number = Decimal(match["number"])
    # Compared before multiplying: Decimal raises on an exponent beyond its context's range.
    size = number * multiplier if number <= MAX_BYTES else None
    if size is None or size > MAX_BYTES:
        raise UnitError(f"{text!r} is too large: at most {MAX_BYTES} bytes (8 EiB)")
    if number < 0:
        raise UnitError(f"{text!r} is negative: a size is at least 1 byte, {_SIZE_EXAMPLES}")
    if size < 1:
        raise UnitError(f"{text!r}: the size must be at least 1 byte")
    return int(size)


def parse_duration(text: str) -> float:
    """Seconds in ``text``: a plain number is seconds; ``1m30s``, ``1.5h``, ``90sec`` ..."""
    seconds = _seconds(text) if len(text) <= _MAX_TEXT else None
    if seconds is None:
        raise UnitError(f"{text!r} is not a duration: use {_DURATION_EXAMPLES}")
    if seconds > MAX_SECONDS:
        raise UnitError(f"{text!r} is too long: at most {MAX_SECONDS} s (365 days)")
    if seconds <= 0:
        raise UnitError(f"{text!r}: the duration must be positive")
    return float(seconds)


def _size_multiplier(unit: str) -> int | None:
    """1 for '' and 'b'; 1024**n for 'g', 'gi', 'gib'; 1000**n for 'gb' (n = 3 for g)."""
    if unit in ("", "b"):
        return 1
    power = _PREFIXES.find(unit[0]) + 1
    if power == 0 or unit[1:] not in ("", "i", "ib", "b"):
        return None
    return (1000 if unit[1:] == "b" else 1024) ** power


def _seconds(text: str) -> float | None:
    stripped = text.strip()
    try:
        plain = Decimal(stripped)
    except InvalidOperation:
        parsed = pytimeparse.parse(stripped)
        return None if parsed is None else float(parsed)
    # Decimal also reads 'inf', 'nan' and 'snan': only finite numbers are seconds.
    return float(plain) if plain.is_finite() else None
