"""A JSON Schema of turbo.toml, generated from the config dataclasses (``config schema``).

Editors complete and check TOML against a JSON Schema: with Even Better TOML (taplo) in VS Code,
a first line ``#:schema ./turbo.schema.json`` in turbo.toml, or an association in the settings.
The schema carries each key's type, choices, range, default and documentation; it cannot carry
the checks of how keys combine (fp16 with ``grad_scaler = false``) or of the machine, which the
commands make when they load the file. Draft 07, the newest draft those editors read.
"""

from __future__ import annotations

import math
from typing import Any, get_args, get_origin

from torchturbo.config import INT64_MAX, MAX_CUDA_INDEX, TurboConfig
from torchturbo.config.fields import ConfigField, config_fields

DRAFT = "http://json-schema.org/draft-07/schema#"


def config_schema() -> dict[str, Any]:
    """The schema: a table of sections, none of them required, no key beyond those known."""
    top: dict[str, Any] = {}
    sections: dict[str, dict[str, Any]] = {}
    for field in config_fields():
        if not field.section:
            top[field.name] = _device_schema(field)
            continue
        sections.setdefault(field.section, {})[field.name] = _field_schema(field)
    for name, properties in sections.items():
        section_type = type(TurboConfig().section(name))
        top[name] = {
            "type": "object",
            "description": " ".join((section_type.__doc__ or "").split()),
            "properties": properties,
            "additionalProperties": False,
        }
    return {
        "$schema": DRAFT,
        "title": "turbo.toml",
        "description": "A torchturbo config: `torchturbo tune` writes one, every command reads "
        "one with --config; `torchturbo config show` prints one with the source of each value.",
        "type": "object",
        "properties": top,
        "additionalProperties": False,
    }


def _device_schema(field: ConfigField) -> dict[str, Any]:
    indices = "|".join(str(index) for index in range(MAX_CUDA_INDEX + 1))
    return {
        "type": "string",
        "pattern": rf"^(?:auto|[a-z][a-z0-9_]*(?::(?:{indices}))?)$",
        "default": field.default,
        "description": field.doc,
    }


def _field_schema(field: ConfigField) -> dict[str, Any]:
    schema = _type_schema(field.value_type)
    if field.bounds is not None:
        schema.update(_range(field))
    if field.default is not None:
        schema["default"] = (
            list(field.default) if isinstance(field.default, tuple) else field.default
        )
    description = field.doc
    if field.optional and "None" not in description:
        description += " No key: None."
    schema["description"] = description.strip()
    return schema


def _type_schema(value_type: Any) -> dict[str, Any]:
    if get_origin(value_type) is tuple:
        return {"type": "array", "items": _type_schema(get_args(value_type)[0])}
    if get_args(value_type) and all(isinstance(a, str) for a in get_args(value_type)):
        return {"type": "string", "enum": list(get_args(value_type))}
    return {"type": {bool: "boolean", int: "integer", float: "number"}.get(value_type, "string")}


def _range(field: ConfigField) -> dict[str, Any]:
    bounds = field.bounds
    assert bounds is not None
    low = int(bounds.low) if field.value_type is int else bounds.low
    out: dict[str, Any] = {"exclusiveMinimum" if bounds.low_exclusive else "minimum": low}
    high = min(bounds.high, INT64_MAX) if field.value_type is int else bounds.high
    if not bounds.inf_allowed and math.isfinite(high):
        out["maximum"] = int(high) if field.value_type is int else high
    return out
