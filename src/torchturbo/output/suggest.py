"""The closest valid word to a misspelt one, for the "did you mean" of every error that lists
choices: options, their values, stage and workload names, config keys.

Spelling variants that only differ in separators (``--precision-dtype`` for
``--precision.dtype``, ``num-workers`` for ``num_workers``) and case are matched first; then
:func:`difflib.get_close_matches`, the standard library's ratio of matching characters.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable

_SEPARATORS = re.compile(r"[-_. ]+")


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The choice ``word`` was most likely meant to be, or None when none is close."""
    options = sorted(set(choices))
    key = _normalized(word)
    same = [choice for choice in options if _normalized(choice) == key]
    if same:
        return same[0]
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    if close:
        return close[0]
    by_key = {_normalized(choice): choice for choice in options}
    close = difflib.get_close_matches(key, list(by_key), n=1, cutoff=0.6)
    return by_key[close[0]] if close else None


def did_you_mean(word: str, choices: Iterable[str], *, quote: bool = True) -> str:
    """``" (did you mean 'precision'?)"`` for the closest choice, or ``""``."""
    match = closest(word, choices)
    if match is None:
        return ""
    return f" (did you mean {match!r}?)" if quote else f" (did you mean {match}?)"


def _normalized(word: str) -> str:
    return _SEPARATORS.sub("-", word.strip().lower())
