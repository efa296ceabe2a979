"""argparse as the ``torchturbo`` commands use it: a parser whose errors are one line, the help
formatter, and the arguments and names several commands share.

Nothing here imports torch or the config module: ``--help`` must answer at once. A command
that takes a config gets its ``--section.field`` options when it parses or shows its help
(:meth:`Parser.with_config_options`).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from torchturbo.cli.tokens import TokenError, prepared
from torchturbo.output.suggest import did_you_mean

EXIT_USAGE = 2


class Parser(argparse.ArgumentParser):
    """argparse with its errors on one line (no usage block), exit code 2; a misspelt
    ``--section.field`` is refused with the closest option's name.

    A command that takes a config gets its ``--section.field`` options when it parses or shows
    its help (:meth:`with_config_options`): they import the config module, which every other
    command, and ``torchturbo --help``, would otherwise wait for (0.2 s of start-up, measured).
    """

    #: Set by add_config_arguments: the command has --section.field options, added once.
    takes_config = False
    config_options_pending = False

    def with_config_options(self) -> Parser:
        """This parser with its config options added, if it takes them and has not got them."""
        if self.config_options_pending:
            from torchturbo.config.options import add_config_options

            self.config_options_pending = False
            add_config_options(self)
        return self

    def format_help(self) -> str:
        self.with_config_options()
        return super().format_help()

    def error(self, message: str) -> NoReturn:
        self.exit(
            EXIT_USAGE, f"{self.prog}: error: {_suggesting(message)} (see {self.prog} --help)\n"
        )

    def parse_known_args(  # type: ignore[override]  # typeshed overloads it on the namespace
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        tokens = list(sys.argv[1:] if args is None else args)
        known = self.with_config_options()._option_string_actions
        commands = {
            name
            for action in self._actions
            if isinstance(action, argparse._SubParsersAction)
            for name in action.choices
        }
        try:
            tokens = prepared(tokens, known, commands)
        except TokenError as err:
            self.error(str(err))
        if self.takes_config:
            from torchturbo.config.options import explicit

            tokens = explicit(tokens, known)
        return super().parse_known_args(tokens, namespace)


_INVALID_CHOICE = re.compile(r"invalid choice: '(?P<value>[^']*)' \(choose from (?P<choices>.*)\)")


def _suggesting(message: str) -> str:
    """argparse's "invalid choice: 'fsat' (choose from ...)" with the closest choice."""
    match = _INVALID_CHOICE.search(message)
    if match is None:
        return message
    choices = [choice.strip().strip("'") for choice in match["choices"].split(",")]
    return message + did_you_mean(match["value"], choices)


# Names from torchturbo.workloads.WORKLOADS and SIZE_CHOICES,
# torchturbo.techniques.tools.export.METHODS and torchturbo.runs.metrics_log.LOGGER_NAMES (tests
# keep them equal), listed here so that --help does not import torch.
WORKLOADS = ("vision", "segmentation", "text")
SIZE_CHOICES = ("auto", "small", "large", "gpu")


EXPORT_METHODS = ("export", "torchscript")


LOGGERS = ("tensorboard", "csv", "wandb", "mlflow")


#: The preset each command that takes a config starts from when neither --preset nor --config is
#: given (None: the defaults, fp32 eager); `config show COMMAND` resolves as COMMAND does.
DEFAULT_PRESETS = {"bench": "fast", "train": "baseline", "doctor": None}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends each option's default to its help, except where there is none to show; the
    usage line sums the config fields up as one ``[--SECTION.FIELD VALUE ...]``."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or is_config_option(action):
            return action.help
        return super()._get_help_string(action)

    def _format_action_invocation(self, action: argparse.Action) -> str:
        invocation = getattr(action, "invocation", None)  # config_options.FlagOption's
        return invocation or super()._format_action_invocation(action)

    def add_usage(
        self,
        usage: str | None,
        actions: Any,
        groups: Any,
        prefix: str | None = None,
    ) -> None:
        shown = [a for a in actions if not is_config_option(a)]
        if len(shown) < len(actions):
            shown.append(argparse.Action(["--SECTION.FIELD"], "config", metavar="VALUE ..."))
        super().add_usage(usage, shown, groups, prefix)


def is_config_option(action: argparse.Action) -> bool:
    """An option of torchturbo.config.options (told by its mark, not importing the module)."""
    return getattr(action, "config_option", False)


def global_options(*, in_subcommand: bool) -> argparse.ArgumentParser:
    """Options every command takes, before or after the command name.

    In a subcommand the default is SUPPRESS, so that ``torchturbo --debug tune`` is not undone
    by the subcommand's own default.
    """
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument(
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS if in_subcommand else False,
        help="show the traceback of an error instead of one line",
    )
    return options


class CommandParser(Parser):
    """A command's parser: shows its defaults and takes the global options after its name too."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(
            parents=[global_options(in_subcommand=True)], formatter_class=HelpFormatter, **kwargs
        )


def add_target_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "recipe",
        nargs="?",
        help="your recipe: path/to/file.py:function or package.module:function",
    )
    # The choices are shown, not enforced by argparse: an unknown name is then reported by
    # get_workload in one line with the choices, like every other user error.
    parser.add_argument(
        "--workload",
        default="vision",
        metavar="{" + ",".join(WORKLOADS) + "}",
        help="built-in workload when no recipe is given",
    )
    parser.add_argument(
        "--size",
        choices=SIZE_CHOICES,
        default="auto",
        help="size of the built-in workload: small steps take 0.05-0.2 s on a 2-core CPU, "
        "large ones 1-5 s, as real models do; gpu widens the model and sizes the batch for the "
        "device from its measured rate and memory; auto: gpu on a GPU, else small",
    )
    parser.add_argument(
        "--device",
        type=device_argument,
        metavar="DEVICE",
        help="cpu, cuda or cuda:N, or another accelerator as torch names it (mps, xpu) "
        "(default: cuda when available)",
    )


def device_argument(text: str) -> str:
    """--device's value, checked like a config's ``device`` before any work starts."""
    from torchturbo.config import device_problem

    problem = device_problem(text, name="")
    if problem is None and text != "auto":
        import torch

        try:
            torch.device(text)
        except RuntimeError:
            problem = f"{text!r} is invalid: torch knows no device of that name"
    if problem is not None:
        raise argparse.ArgumentTypeError(problem + did_you_mean(text, ("auto", "cpu", "cuda")))
    return text


#: The largest count an int option takes: torch counts steps in int64.
INT64_MAX = 2**63 - 1


def count(low: int, high: int = INT64_MAX, *, what: str = "") -> Callable[[str], int]:
    """An argparse ``type`` for an int option from ``low`` to ``high``: a value out of range
    is refused with the range (argparse adds the option's name), ``what`` saying what it
    counts: ``argument --planned-steps: 0 is out of range: expected an int >= 1 (...)``."""
    shown = f"an int >= {low}" if high == INT64_MAX else f"an int from {low} to {high}"
    shown += f" ({what})" if what else ""

    def read(text: str) -> int:
        try:
            value = int(text.strip().replace("_", ""))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an int: expected {shown}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is out of range: expected {shown}")
        return value

    return read


def fraction(text: str) -> float:
    """An argparse ``type`` for a fraction strictly between 0 and 1 (``0.05``)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is out of range: expected a fraction between 0 and 1, e.g. 0.05 for 5%"
        )
    return value


def add_config_arguments(parser: argparse.ArgumentParser, *, default_preset: str | None) -> None:
    """--preset, --config and every config field as --section.field, in that precedence (the
    fields are added when the command runs: :meth:`Parser.with_config_options`)."""
    default = f" (default: {default_preset})" if default_preset else ""
    parser.add_argument(
        "--preset",
        choices=("baseline", "fast"),
        help=f"a named config{default}; --config's keys go over the one given, or over the "
        "defaults when none is",
    )
    parser.add_argument(
        "--config", type=Path, metavar="FILE", help="a TOML config file, e.g. a tuned turbo.toml"
    )
    parser.set_defaults(default_preset=default_preset, config_overrides=[])
    if isinstance(parser, Parser):
        parser.takes_config = parser.config_options_pending = True
