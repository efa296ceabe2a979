"""The config's validation core: one :class:`ConfigError` listing every problem, field ranges.

Each section validates itself in ``__post_init__`` with :func:`validate_section`: field types are
checked from the annotations, so a TOML file with ``steps = "4"`` fails with a message, not deep
inside the engine; numbers are checked against the range declared beside the field
(:func:`between`): never NaN, never infinite unless the field says so, never beyond what the
code can use.

Why hand-written (dataclasses and a small validation core, not pydantic or attrs): the sections
must stay plain frozen standard-library dataclasses that pickle to every rank and that users
build with ``dataclasses.replace``; a validation library would be a dependency of several MB
for the ~150 lines below, and would still need these rules written out (ranges with the reason
for a limit, checks of how fields combine, typo suggestions) and its own messages, which span
lines and name types the way Python does, turned into the one line per problem a CLI prints.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import reprlib
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_origin

from torchturbo.output import suggest

if sys.version_info >= (3, 11):
    pass
else:  # pragma: no cover - exercised only on Python 3.10
    pass


class ConfigError(ValueError):
    """Invalid configuration values; the message names each field, its value and what is allowed.

    ``problems`` holds one sentence per problem: a file with several is reported whole, in one
    line, rather than one problem per run.
    """

    def __init__(self, *problems: str, where: str = "") -> None:
        self.problems = problems
        self.where = where
        count = f"{len(problems)} problems: " if len(problems) > 1 else ""
        super().__init__(f"{where}: " * bool(where) + count + "; ".join(problems))


#: Every int field fits torch's int64 (counters and sizes become int64 tensors and C++ ints).
INT64_MAX = 2**63 - 1
#: torch's device index is an int8: "cuda:128" silently becomes cuda:-128.
MAX_CUDA_INDEX = 127
#: "auto", or a device type with an optional index: cpu, cuda, cuda:N, and the accelerators
#: torch knows beside CUDA (mps, xpu, a PrivateUse1 backend's name); whether this machine has
#: the device is checked against the environment (``check_environment``), not here.
DEVICE_NAME = re.compile(r"auto|(?P<type>[a-z][a-z0-9_]*)(?::(?P<index>0|[1-9][0-9]{0,2}))?")
#: A config file is a few hundred bytes; a larger one is the wrong file.


def quote(value: Any) -> str:
    """``repr(value)`` cut short: a TOML value may be a huge or deeply nested table."""
    short = reprlib.Repr()  # keyword arguments only from Python 3.12
    short.maxlevel, short.maxstring, short.maxother = 2, 40, 40
    short.maxlist = short.maxtuple = short.maxdict = 4
    return short.repr(value)


@dataclass(frozen=True)
class Bounds:
    """The range a numeric field allows; ``why`` explains an upper limit in the error.

    Int fields are also capped at :data:`INT64_MAX`; floats must be finite unless
    ``inf_allowed``.
    """

    low: float
    high: float = math.inf
    low_exclusive: bool = False
    #: +inf is a meaningful value (clipping's norm_type: the max-norm).
    inf_allowed: bool = False
    why: str = ""
    #: What leaving the key out means, for fields that may be None ("no clipping").
    absent: str = ""

    def problem(self, value: float, *, integer: bool) -> str | None:
        """What is wrong with ``value`` (of an int field when ``integer``), or None."""
        if value == math.inf and self.inf_allowed:
            return None
        high = min(self.high, INT64_MAX) if integer else self.high
        too_low = value <= self.low if self.low_exclusive else value < self.low
        if not math.isfinite(value) or too_low or value > high:
            return f"expected {self._allowed(integer, above=value > high)}"
        return None

    def _allowed(self, integer: bool, *, above: bool) -> str:
        kind = "an int" if integer else "a finite number"
        allowed = f"{kind} {'>' if self.low_exclusive else '>='} {self.low}"
        if self.inf_allowed:
            allowed += ", or inf"
        elif self.high < math.inf:
            allowed += f" and <= {self.high}" + f" ({self.why})" * bool(self.why)
        elif integer and above:  # the int64 cap is news only to a value beyond it
            allowed += " and <= 2**63 - 1 (torch's int64)"
        return allowed + f", or no key for {self.absent}" * bool(self.absent)


def between(default: Any, low: float, **bounds: Any) -> Any:
    """A dataclass field whose numeric value must lie within :class:`Bounds` ``(low, **bounds)``."""
    return field(default=default, metadata={"bounds": Bounds(low, **bounds)})


def validate_section(section: Any, *combinations: typing.Callable[[], list[str]]) -> None:
    """Raise one :class:`ConfigError` for every bad field of ``section``.

    ``combinations`` check how fields go together; they run only once every field has the
    right type and range, so that they compare well-formed values.
    """
    problems = _field_problems(section)
    if not problems:
        problems = [problem for check in combinations for problem in check()]
    if problems:
        raise ConfigError(*problems)


def _field_problems(section: Any) -> list[str]:
    """Type and range problems of every field, from the annotations and ``between`` bounds."""
    hints = typing.get_type_hints(type(section))
    problems = []
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        expected = hints[f.name]
        bounds = f.metadata.get("bounds")
        if not _matches(value, expected):
            wrong = f"expected {_describe(expected)}{_closest_choice(value, expected)}"
        elif bounds is not None and isinstance(value, (int, float)):
            wrong = bounds.problem(value, integer=not _matches(0.5, expected))
        elif isinstance(value, float) and not math.isfinite(value):
            wrong = "expected a finite number"
        else:
            wrong = None
        if wrong:
            problems.append(f"[{section.SECTION}] {f.name} = {quote(value)} is invalid: {wrong}")
    return problems


def _matches(value: Any, expected: Any) -> bool:
    origin = get_origin(expected)
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in get_args(expected))
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in get_args(expected))
    if origin is tuple:
        (item_type, _ellipsis) = get_args(expected)
        return isinstance(value, tuple) and all(_matches(v, item_type) for v in value)
    if expected is type(None):
        return value is None
    if expected is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, expected)


def _closest_choice(value: Any, expected: Any) -> str:
    """`` (did you mean 'bf16'?)`` for a misspelt choice of a ``Literal`` field, else ''."""
    choices = [a for a in get_args(expected) if isinstance(a, str)]
    if get_origin(expected) is not Literal or not isinstance(value, str):
        return ""
    return suggest.did_you_mean(value, choices)


def _describe(expected: Any) -> str:
    origin = get_origin(expected)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(expected))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(expected))
    if origin is tuple:
        return f"a list of {_describe(get_args(expected)[0])}"
    if expected is type(None):
        return "nothing (omit the key)"
    return expected.__name__


def did_you_mean(unknown: set[str], allowed: set[str]) -> str:
    """' (did you mean 'dtype'?)' for the closest valid names of typo'd keys, else ''."""
    guesses = [
        f"{key!r} -> {match[0]!r}"
        for key in sorted(unknown)
        if (match := difflib.get_close_matches(key, sorted(allowed), n=1))
    ]
    return f" (did you mean {', '.join(guesses)}?)" if guesses else ""


def device_problem(device: Any, *, name: str = "device = ") -> str | None:
    """Why ``device`` is not a device name torchturbo can use, or None. ``name`` is how the
    message introduces the value."""
    match = DEVICE_NAME.fullmatch(device) if isinstance(device, str) else None
    if match is not None and int(match["index"] or 0) <= MAX_CUDA_INDEX:
        return None
    return (
        f"{name}{quote(device)} is invalid: expected 'auto', 'cpu', 'cuda' or 'cuda:N' "
        f"with N from 0 to {MAX_CUDA_INDEX}, or another accelerator's name as torch spells it "
        "('mps', 'xpu:N')"
    )
