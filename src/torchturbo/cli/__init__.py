"""The ``torchturbo`` command: argument parsing, error reporting and printing only.

Each command has a module here (``bench``, ``tune``, ``doctor``, ``export``, ``train``,
``config``, ``completion``, ``version``) that adds its arguments to the parser (``parser``) and
maps them onto the library, where the work lives; ``arguments`` holds what several commands
share, ``tokens`` what the command line is made into before argparse reads it (did-you-mean
for any misspelt option, ``--flag=true``, negative values), ``shared`` what they do around
their work, ``errors`` the error classifier. An error the
user can fix (bad argument, config, recipe code or data, checkpoint, file system) prints one
readable line, ``torchturbo CMD: error: ...``, and exits with code 2; warnings print one line
each. ``--debug`` shows the traceback instead; a bug of torchturbo always shows it (exit 1).

Every command that takes a config (bench, train, doctor, config show) takes every config field
as ``--section.field`` too (:mod:`torchturbo.config.options`), over ``--config`` and
``--preset`` (:mod:`torchturbo.config.resolve`).

Why hand-written on argparse: argparse is in the standard library, costs nothing at start-up
(``--help`` must not wait for torch), and shtab turns it into bash and zsh completion. Click and
Typer would be a dependency for the same subcommands and options, and none of the libraries
that build a CLI from dataclasses gives what the config options need (see
:mod:`torchturbo.config.options`); what is left by hand is the one-line error reporting below.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from torchturbo.cli.arguments import EXIT_USAGE
from torchturbo.cli.errors import error_line, warnings_as_lines
from torchturbo.cli.parser import build_parser, full_parser

__all__ = ["full_parser", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, or a bad argument (already printed): its exit code
        return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
    if not hasattr(args, "run"):
        parser.print_help()
        return EXIT_USAGE
    try:
        with warnings_as_lines(args.command):
            return args.run(args) or 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        line = None if args.debug else error_line(err, args)
        if line is None:
            raise
        print(f"torchturbo {args.command}: error: {line}", file=sys.stderr)
        return EXIT_USAGE
