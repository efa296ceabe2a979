"""The config's fields as data: section, name, type, default, range and documentation.

The command line's ``--section.field`` options (:mod:`torchturbo.config.options`), ``config
show`` and ``config schema`` are generated from this one list, so a field added to a section of
:mod:`torchturbo.config` appears in all three with no other line of code. A field's
documentation is the ``#:`` comment above its declaration (the convention Sphinx's autodoc
reads), taken from the source of its section.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from torchturbo.config import Bounds, TurboConfig, sections

_DOC_LINE = re.compile(r"\s*#:\s?(?P<text>.*)")
_DECLARATION = re.compile(r"\s*(?P<name>[a-z_][a-z0-9_]*)\s*:")
_CLASS = re.compile(r"class (?P<name>\w+)")


@dataclass(frozen=True)
class ConfigField:
    """One key of turbo.toml: ``device`` at the top, or ``field`` of ``[section]``."""

    #: "" for the top-level ``device``.
    section: str
    name: str
    #: The resolved annotation, e.g. ``Literal['fp32', ...]`` or ``int | None``.
    annotation: Any
    default: Any
    bounds: Bounds | None
    doc: str

    @property
    def key(self) -> str:
        """``precision.dtype``: the name of the option and of ``config show``'s sources."""
        return f"{self.section}.{self.name}" if self.section else self.name

    @property
    def optional(self) -> bool:
        """None is allowed: no key in the file."""
        return type(None) in _union_args(self.annotation)

    @property
    def value_type(self) -> Any:
        """The annotation without its None: what a value in the file is."""
        (value_type,) = [a for a in _union_args(self.annotation) if a is not type(None)]
        return value_type

    @property
    def choices(self) -> tuple[Any, ...]:
        """The values of a ``Literal`` field, else ()."""
        value_type = self.value_type
        return get_args(value_type) if get_origin(value_type) is Literal else ()


def _union_args(annotation: Any) -> tuple[Any, ...]:
    if get_origin(annotation) in (typing.Union, types.UnionType):
        return get_args(annotation)
    return (annotation,)


@functools.cache
def config_fields() -> tuple[ConfigField, ...]:
    """Every key of turbo.toml, in the order of the file: ``device``, then section by section."""
    docs = _docs(sys.modules[TurboConfig.__module__].__file__)
    fields = [ConfigField("", "device", str, "auto", None, docs.get(("TurboConfig", "device"), ""))]
    read = {TurboConfig.__module__}
    for name, section_type in sections().items():
        hints = typing.get_type_hints(section_type)
        if section_type.__module__ not in read:
            read.add(section_type.__module__)
            docs |= _docs(sys.modules[section_type.__module__].__file__)
        fields.extend(
            ConfigField(
                name,
                f.name,
                hints[f.name],
                f.default,
                f.metadata.get("bounds"),
                docs.get((section_type.__name__, f.name), ""),
            )
            for f in dataclasses.fields(section_type)
        )
    return tuple(fields)


def _docs(source: str | None) -> dict[tuple[str, str], str]:
    """{(class, field): its ``#:`` comment lines, joined} of a module's source file, read in one
    pass (``inspect.getsource`` parses the whole module once per class: 0.75 s of every command's
    start-up); {} when the source is not there (a zipped or compiled install)."""
    try:
        lines = Path(str(source)).read_text(encoding="utf-8").splitlines()
    except OSError:
        return {}
    docs: dict[tuple[str, str], str] = {}
    owner, pending = "", []
    for line in lines:
        if (comment := _DOC_LINE.match(line)) is not None:
            pending.append(comment["text"].strip())
            continue
        if (declared_class := _CLASS.match(line)) is not None:
            owner = declared_class["name"]
        elif (declaration := _DECLARATION.match(line)) is not None and pending:
            docs[owner, declaration["name"]] = " ".join(pending)
        pending = []
    return docs
