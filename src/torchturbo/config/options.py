"""Every config field as a command-line option: ``--precision.dtype bf16``, ``--data.batches``.

One option per key of turbo.toml (:func:`~torchturbo.config.fields.config_fields`), named as in
the file and taking values in the file's units (bytes, MiB, counts): a choice for a ``Literal``
field, ``--x`` / ``--no-x`` for a boolean, a comma-separated list for a list, ``none`` for a
field the file may leave out (``--x=none`` for a boolean one); ``*_bytes`` fields also read
sizes such as ``64MiB``. The text is only converted to the field's type here: what a value
may be is decided by the config's own validation (:func:`torchturbo.config.resolve.resolve`),
so an option and a file get the same one-line errors. A misspelt ``--section.field`` is
refused with the closest name (``torchturbo.cli.tokens``): argparse alone would take
``--precision.dtyp`` as an abbreviation.

Why hand-written: the options must be argparse options like the rest of the command (argparse
costs nothing at start-up, and ``--help``, completion and the one-line errors already rest on
it), must convert values as turbo.toml does and leave checking to ``TurboConfig``, and must go
over ``--config`` and ``--preset``. The libraries that build a CLI from dataclasses (tyro,
simple-parsing, jsonargparse) each bring their own parser, validation and error format in its
place; generating the options from the dataclasses is the ~150 lines below.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, get_origin

from torchturbo.config.fields import ConfigField, config_fields
from torchturbo.config.sections import RENAMED
from torchturbo.output.units import BOOLEAN_WORDS, UnitError, parse_size

#: Where the parsed options go in the namespace: a list of :class:`Override`, in command order.
DEST = "config_overrides"
_INT = re.compile(r"[+-]?[0-9][0-9_]*")
#: The longest ``--option METAVAR`` that --help prints within 80 columns (indented by 2).
_HELP_WIDTH = 76


@dataclass(frozen=True)
class Override:
    """One config option as given: the field, its converted value, and how it was typed."""

    field: ConfigField
    value: Any
    #: ``--precision.dtype bf16`` as ``precision.dtype=bf16``, for labels and messages.
    text: str
    option: str


class _Shown(tuple[Any, ...]):
    """Choices that --help and completion show but argparse does not enforce: a bad value is
    reported by the config's validation, in the words a file's would be."""

    def __contains__(self, value: object) -> bool:
        return True


class _SetValue(argparse.Action):
    """``--section.field VALUE``: the value converted to the field's type, appended to DEST."""

    #: How the CLI's help formatter tells these options apart without importing this module.
    config_option = True

    def __init__(self, *args: Any, field: ConfigField, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.field = field

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        value = convert(self.field, str(values))
        given = Override(self.field, value, f"{self.field.key}={values}", str(option_string))
        setattr(namespace, DEST, [*(getattr(namespace, DEST, None) or []), given])


class FlagOption(_SetValue):
    """``--section.field`` sets a boolean field, ``--no-section.field`` clears it, and
    ``--section.field=true|false`` (or yes/no, on/off, 1/0) says which. A field that may be
    absent (None: "as needed") also takes ``--section.field=none``. :func:`explicit` writes
    bare flags as ``=true``, so that a flag never takes the next word as its value.
    """

    def __init__(self, *args: Any, field: ConfigField, **kwargs: Any) -> None:
        super().__init__(*args, nargs="?", field=field, **kwargs)
        #: How --help shows the pair: one line, ``--[no-]chunked_loss.enabled``.
        self.invocation = f"--[no-]{field.key}" + "[=none]" * field.optional

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        negated = str(option_string).startswith("--no-")
        words = {**BOOLEAN_WORDS, **({"none": None} if self.field.optional else {})}
        text = "true" if values is None else str(values).strip().lower()
        if text not in words:
            allowed = "true, false" + ", none" * self.field.optional
            raise argparse.ArgumentError(self, f"{values!r} is not one of {allowed}")
        value = words[text]
        if negated and isinstance(value, bool):
            value = not value
        shown = "none" if value is None else str(value).lower()
        given = Override(self.field, value, f"{self.field.key}={shown}", str(option_string))
        setattr(namespace, DEST, [*(getattr(namespace, DEST, None) or []), given])


def explicit(tokens: Sequence[str], actions: Mapping[str, argparse.Action]) -> list[str]:
    """``tokens`` with each bare config flag written ``--flag=true``: a flag takes an optional
    value (``=false``, ``=none``), and argparse would otherwise read the word after it (a
    recipe) as that value."""
    out = []
    for token in tokens:
        out.append(f"{token}=true" if isinstance(actions.get(token), FlagOption) else token)
        if token == "--":
            out.extend(tokens[len(out) :])
            break
    return out


def renamed_option(name: str) -> str | None:
    """The new spelling of an older flag (``--data.bucketing`` is ``--data.batches buckets``),
    or None: the line an older command gets instead of "unknown option"."""
    value = not name.startswith("--no-")
    section, _, key = name.removeprefix("--no-").removeprefix("--").partition(".")
    spelling = RENAMED.get((section, key), {}).get(value)
    if spelling is None:
        return None
    field, _, choice = spelling.partition(" = ")
    return f"--{section}.{field} {choice.strip(chr(39))}"


def add_config_options(parser: argparse.ArgumentParser) -> None:
    """Add one option per config field (``device`` excepted: ``--device`` sets it) in a group."""
    group = parser.add_argument_group(
        "config fields",
        "Each option sets one key of turbo.toml, in the file's units, over --config and "
        "--preset; `torchturbo config show` prints the result and where each value came from.",
    )
    for field in config_fields():
        if not field.section:
            continue
        option = f"--{field.key}"
        help_text = field.doc.replace("%", "%%") or None
        if field.value_type is bool:
            group.add_argument(
                option, f"--no-{field.key}", action=FlagOption, field=field, help=help_text
            )
        else:
            metavar = _metavar(field)
            if len(option) + len(metavar) > _HELP_WIDTH:  # a line of its own, within 80 columns
                help_text = f"{metavar.replace(',', ', ')}: {help_text}"
                metavar = field.name.upper()
            group.add_argument(
                option,
                action=_SetValue,
                field=field,
                metavar=metavar,
                choices=_Shown(field.choices) if field.choices else None,
                help=help_text,
            )


def _metavar(field: ConfigField) -> str:
    if field.choices:
        shown = "{" + ",".join(map(str, field.choices)) + "}"
    elif get_origin(field.value_type) is tuple:
        shown = "NAME,..."
    elif field.name.endswith("_bytes"):
        shown = "BYTES"
    else:
        shown = {int: "N", float: "X"}.get(field.value_type, "TEXT")
    return f"{shown}|none" if field.optional else shown


def convert(field: ConfigField, text: str) -> Any:
    """``text`` as the field's type, as TOML would give it; text that is not of that type is
    returned as it is, for the config's validation to name (``steps = 'abc'`` expects an int)."""
    stripped = text.strip()
    if field.optional and stripped.lower() == "none":
        return None
    if get_origin(field.value_type) is tuple:
        return tuple(part.strip() for part in text.split(",") if part.strip())
    if field.value_type is int:
        if _INT.fullmatch(stripped):
            return int(stripped)
        if field.name.endswith("_bytes"):
            try:
                return parse_size(stripped)
            except UnitError:
                return text
        return text
    if field.value_type is float:
        try:
            return float(stripped)
        except ValueError:
            return text
    return text
