"""The ``torchturbo`` parser: every command's arguments, each added by the command's module."""

from __future__ import annotations

import argparse

from torchturbo.cli import (
    bench,
    completion,
    config,
    doctor,
    export,
    launch,
    train,
    tune,
    version,
)
from torchturbo.cli.arguments import CommandParser, HelpFormatter, Parser, global_options

# The source article, named once here; the commands' help texts say "the article".
ARTICLE = "PyTorch深度学习性能优化10大实战技巧 (10 practical tips for PyTorch performance)"


def build_parser() -> argparse.ArgumentParser:
    """The ``torchturbo`` parser: the global options and every command (config options
    pending, see :meth:`~torchturbo.cli.arguments.Parser.with_config_options`)."""
    from torchturbo import __version__

    parser = Parser(
        prog="torchturbo",
        description=(
            "Make PyTorch training faster and leaner, and prove it by measurement: the "
            f"techniques of the article {ARTICLE}, implemented correctly, measured side by side "
            "on your model and kept only where they pay off."
        ),
        parents=[global_options(in_subcommand=False)],
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"torchturbo {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=CommandParser)

    for command in (version, bench, tune, doctor, export, train, launch, config):
        command.add_parser(commands)
    completion.add_parser(commands, full_parser)
    return parser


def full_parser() -> argparse.ArgumentParser:
    """The parser with every command's config options in place: what completion and the tests
    of the options and the docs read."""
    parser = build_parser()
    pending = [parser]
    while pending:
        current = pending.pop()
        if isinstance(current, Parser):
            current.with_config_options()
        for action in current._actions:
            if isinstance(action, argparse._SubParsersAction):
                pending.extend(action.choices.values())
    return parser
