"""``torchturbo completion bash|zsh``: a completion script of every command and option."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

COMPLETION_SHELLS = ("bash", "zsh")


def add_parser(commands: Any, full_parser: Callable[[], argparse.ArgumentParser]) -> None:
    """Add ``torchturbo completion`` to the parser's ``commands``; its script is read from
    ``full_parser()``, passed in so that this module need not import the parser it is part of."""
    completion = commands.add_parser(
        "completion",
        help="print a bash or zsh completion script",
        description=(
            "Print the completion script of every command and option (config fields "
            "included) for the shell. bash: `torchturbo completion bash > "
            "~/.local/share/bash-completion/completions/torchturbo`; zsh: `torchturbo "
            "completion zsh > ~/.zfunc/_torchturbo` with ~/.zfunc in $fpath before compinit."
        ),
    )
    completion.add_argument("shell", choices=COMPLETION_SHELLS, help="the shell to complete in")
    completion.set_defaults(run=run, full_parser=full_parser)


def run(args: argparse.Namespace) -> int:
    import shtab

    print(shtab.complete(args.full_parser(), shell=args.shell), end="")
    return 0
