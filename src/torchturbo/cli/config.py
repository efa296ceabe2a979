"""``torchturbo config show``: the resolved config with each value's source; ``config schema``:
the JSON Schema of turbo.toml.
"""

from __future__ import annotations

import argparse
from typing import Any

from torchturbo.cli.arguments import (
    DEFAULT_PRESETS,
    CommandParser,
    add_config_arguments,
    device_argument,
)
from torchturbo.cli.shared import resolved_config


def add_parser(commands: Any) -> None:
    """Add ``torchturbo config show`` and ``config schema`` to the parser's ``commands``."""
    config = commands.add_parser(
        "config",
        help="print the resolved config and where each value came from, or its JSON Schema",
        description=(
            "show: the config a command runs with, as TOML, each value followed by where it "
            "came from (the defaults, --preset, the --config file or a --section.field option; "
            "in that order, each over the last). schema: the JSON Schema of turbo.toml, for "
            "editors to complete and check the file with."
        ),
    )
    actions = config.add_subparsers(
        dest="config_action", metavar="ACTION", parser_class=CommandParser, required=True
    )
    show = actions.add_parser(
        "show",
        help="the resolved config as TOML, with the source of each value",
        description=(
            "Print the config that the given options resolve to, as TOML that --config reads "
            "back; after each value, where it came from. With COMMAND, resolve as that command "
            "does (bench starts from --preset fast)."
        ),
    )
    show.add_argument(
        "like",
        nargs="?",
        choices=tuple(DEFAULT_PRESETS),
        metavar="COMMAND",
        help=f"resolve as this command does: {', '.join(DEFAULT_PRESETS)}",
    )
    show.add_argument(
        "--device",
        type=device_argument,
        metavar="DEVICE",
        help="cpu, cuda or cuda:N, or another accelerator as torch names it (default: auto)",
    )
    add_config_arguments(show, default_preset=None)
    show.set_defaults(run=run_show, command="config show")
    schema = actions.add_parser(
        "schema",
        help="the JSON Schema of turbo.toml (save it and point your editor at it)",
        description=(
            "Print the JSON Schema (draft 07) of turbo.toml: every key with its type, choices, "
            "range, default and meaning. With Even Better TOML in VS Code, save it as "
            "turbo.schema.json and start turbo.toml with the line `#:schema ./turbo.schema.json`."
        ),
    )
    schema.set_defaults(run=run_schema, command="config schema")


def run_show(args: argparse.Namespace) -> int:
    from torchturbo.config.resolve import annotated_toml

    if args.like is not None:
        args.default_preset = DEFAULT_PRESETS[args.like]
    command = f"torchturbo {args.like}" if args.like else "a command"
    heading = (
        f"The config {command} runs with these options. After each value, where it came from:\n"
        "default < --preset < the --config file < a --section.field option or --device."
    )
    print(annotated_toml(resolved_config(args), heading=heading), end="")
    return 0


def run_schema(args: argparse.Namespace) -> int:
    import json

    from torchturbo.config.schema import config_schema

    print(json.dumps(config_schema(), indent=2))
    return 0
