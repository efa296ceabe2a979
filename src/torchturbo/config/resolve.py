"""The config a command runs with, from its layers, and where each value came from.

Precedence, lowest first: the defaults, ``--preset``, the ``--config`` file (only the keys it
holds), the ``--section.field`` options, ``--device``. :func:`resolve` applies them in that order
through the config's own validation, so every layer is checked by the same rules, and records
the layer that set each key; :func:`annotated_toml` prints the result as TOML with the source of
each value beside it (``torchturbo config show``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w

from torchturbo.config import ConfigError, TurboConfig, read_table
from torchturbo.config.fields import ConfigField, config_fields
from torchturbo.config.options import Override

DEFAULT = "default"


@dataclass(frozen=True)
class Resolved:
    """A config and, per key (``precision.dtype``), the layer that set it."""

    config: TurboConfig
    sources: dict[str, str]


def value_of(config: TurboConfig, field: ConfigField) -> Any:
    """The value ``config`` holds for ``field``."""
    section = config.section(field.section) if field.section else config
    return getattr(section, field.name)


def resolve(
    *,
    preset: str | None = None,
    config_file: Path | None = None,
    overrides: Sequence[Override] = (),
    device: str | None = None,
) -> Resolved:
    """Defaults, then ``preset``, ``config_file``'s keys, ``overrides`` and ``device`` over them.

    Raises :class:`~torchturbo.config.ConfigError`: a file's problems name the file, an
    option's name the option.
    """
    config = TurboConfig()
    sources = {field.key: DEFAULT for field in config_fields()}
    if preset is not None:
        config = TurboConfig.preset(preset)
        for field in config_fields():
            if value_of(config, field) != field.default:
                sources[field.key] = f"--preset {preset}"
    if config_file is not None:
        config = _over_file(config, config_file, sources)
    config = _over_options(config, overrides, sources)
    if device is not None:
        config = config.replace(device=device)
        sources["device"] = "--device"
    return Resolved(config, sources)


def _over_file(config: TurboConfig, path: Path, sources: dict[str, str]) -> TurboConfig:
    # load(), not from_dict(): it also resolves a relative [compile] cache_dir against the file's
    # folder, where tune wrote the cache beside turbo.toml.
    config = TurboConfig.load(path, base=config)
    table = read_table(path)
    for key, value in table.items():  # from_dict accepted it: only known sections and keys
        names = value if isinstance(value, dict) else {"": value}
        for name in names:
            sources[f"{key}.{name}" if name else key] = str(path)
    return config


def _over_options(
    config: TurboConfig, overrides: Sequence[Override], sources: dict[str, str]
) -> TurboConfig:
    """Each section's options replaced together (fields valid only in combination, such as
    ``mode = 'selective'`` with ``every_n = 2``, are checked as a whole); every problem at once,
    each after the options it concerns."""
    by_section: dict[str, list[Override]] = {}
    for given in overrides:
        by_section.setdefault(given.field.section, []).append(given)
    problems: list[str] = []
    for section, options in by_section.items():
        try:
            config = config.replace(**{f"{section}__{o.field.name}": o.value for o in options})
        except ConfigError as err:
            named = ", ".join(dict.fromkeys(o.option for o in options))
            problems.extend(f"{named}: {problem}" for problem in err.problems)
            continue
        for o in options:
            sources[o.field.key] = o.option
    if problems:
        raise ConfigError(*problems)
    return config


def annotated_toml(resolved: Resolved, *, heading: str = "") -> str:
    """The config as TOML, each key followed by ``# <source>``; a key with no value (None, which
    TOML cannot hold) as a comment. The text reads back as the same config."""
    lines = [f"# {line}" for line in heading.splitlines()]
    current = None
    for field in config_fields():
        if field.section != current:
            current = field.section
            lines += ["", f"[{field.section}]"] if field.section else []
        value = value_of(resolved.config, field)
        source = resolved.sources[field.key]
        if value is None:
            lines.append(f"# {field.name}: not set  # {source}")
            continue
        plain = list(value) if isinstance(value, tuple) else value
        lines.append(f"{tomli_w.dumps({field.name: plain}).strip()}  # {source}")
    return "\n".join(lines) + "\n"
