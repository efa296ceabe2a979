"""The ``torchturbo`` command: argument parsing, error reporting and printing only.

Every command's work lives in its own module; this one maps arguments onto it. An error the
user can fix (bad argument, config, recipe code or data, checkpoint, file system) prints one
readable line, ``torchturbo CMD: error: ...``, and exits with code 2; warnings print one line
each. ``--debug`` shows the traceback instead; a bug of torchturbo always shows it (exit 1).

Every command that takes a config (bench, train, doctor, config show) takes every config field
as ``--section.field`` too (:mod:`torchturbo.config_options`), over ``--config`` and
``--preset`` (:mod:`torchturbo.config_resolve`).

Why hand-written on argparse: argparse is in the standard library, costs nothing at start-up
(``--help`` must not wait for torch), and shtab turns it into bash and zsh completion. Click and
Typer would be a dependency for the same subcommands and options, and none of the libraries
that build a CLI from dataclasses gives what the config options need (see
:mod:`torchturbo.config_options`); what is left by hand is the one-line error reporting below.
"""

from __future__ import annotations

import argparse
import contextlib
import dis
import re
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

from torchturbo.output.units import parse_duration, parse_size

EXIT_USAGE = 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, or a bad argument (already printed): its exit code
        return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
    if not hasattr(args, "run"):
        parser.print_help()
        return EXIT_USAGE
    try:
        with _warnings_as_lines(args.command):
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


def error_line(err: Exception, args: argparse.Namespace) -> str | None:
    """The one line for an error the user can fix; None for a bug of torchturbo (traceback).

    Those are: torchturbo's own errors (they name the field, file or function); failures of
    the user's code or data (``recipe.user_code_failure``); out of memory; the file system's
    errors; and ValueErrors that a ``raise`` in torchturbo's source threw on bad input.
    """
    import torch

    from torchturbo.recipe import describe_exception, is_torchturbo_error, user_code_failure

    if is_torchturbo_error(err):
        line = str(err)
    elif isinstance(err, torch.OutOfMemoryError):
        line = (
            f"out of memory: {describe_exception(err)}; lower the batch size, or let "
            "[reliability] auto_microbatch = true split it"
        )
    elif (failure := user_code_failure(err)) is not None:
        line = f"{failure}; --debug shows the traceback"
    elif isinstance(err, OSError):
        where = f": {str(err.filename)!r}" if err.filename is not None else ""
        line = f"{err.strerror or describe_exception(err)}{where}"
    elif isinstance(err, ValueError) and _raised_by_torchturbo(err):
        line = str(err)
    else:
        return None
    return _naming_the_option(" ".join(line.split()), args)


def _raised_by_torchturbo(err: BaseException) -> bool:
    """Whether a ``raise`` statement in torchturbo's source threw ``err`` (not torch, called by
    torchturbo with something it should have checked): the instruction that raised it, in the
    innermost frame, is a RAISE_VARARGS of torchturbo's code."""
    last = err.__traceback__
    while last is not None and last.tb_next is not None:
        last = last.tb_next
    if last is None:
        return False
    code = last.tb_frame.f_code
    ours = Path(code.co_filename).resolve().is_relative_to(Path(__file__).resolve().parent)
    instruction = code.co_code[last.tb_lasti] if 0 <= last.tb_lasti < len(code.co_code) else None
    return ours and instruction == dis.opmap["RAISE_VARARGS"]


def _naming_the_option(line: str, args: argparse.Namespace) -> str:
    """Add which option a path in the message came from: ``... (--checkpoint-dir)``."""
    for dest, value in vars(args).items():
        option = "--" + dest.replace("_", "-")
        quoted = isinstance(value, Path) and re.search(rf"'{re.escape(str(value))}[^']*'", line)
        if quoted and option not in line:
            return f"{line} ({option})"
    return line


@contextlib.contextmanager
def _warnings_as_lines(command: str) -> Iterator[None]:
    """Show each warning as one ``torchturbo CMD: warning: ...`` line (Python shows two)."""

    def show(message: Any, *_args: Any, **_kwargs: Any) -> None:
        print(f"torchturbo {command}: warning: {' '.join(str(message).split())}", file=sys.stderr)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line (no usage block), exit code 2; a misspelt
    ``--section.field`` is refused with the closest option's name.

    A command that takes a config gets its ``--section.field`` options when it parses or shows
    its help (:meth:`with_config_options`): they import the config module, which every other
    command, and ``torchturbo --help``, would otherwise wait for (0.2 s of start-up, measured).
    """

    #: Set by _add_config_arguments: the command has --section.field options, added once.
    takes_config = False
    config_options_pending = False

    def with_config_options(self) -> _Parser:
        """This parser with its config options added, if it takes them and has not got them."""
        if self.config_options_pending:
            from torchturbo.config_options import add_config_options

            self.config_options_pending = False
            add_config_options(self)
        return self

    def format_help(self) -> str:
        self.with_config_options()
        return super().format_help()

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_known_args(  # type: ignore[override]  # typeshed overloads it on the namespace
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        tokens = list(sys.argv[1:] if args is None else args)
        if self.takes_config:
            from torchturbo.config_options import explicit, unknown_option

            known = self.with_config_options()._option_string_actions
            problem = unknown_option(tokens, known)
            if problem is not None:
                self.error(problem)
            tokens = explicit(tokens, known)
        return super().parse_known_args(tokens, namespace)


# The source article, named once here; help texts below say "the article".
ARTICLE = "PyTorch深度学习性能优化10大实战技巧 (10 practical tips for PyTorch performance)"
# Names from torchturbo.workloads.WORKLOADS, torchturbo.techniques.export.METHODS and
# torchturbo.runs.metrics_log.LOGGER_NAMES (tests keep them equal), listed here so that --help does
# not import torch.
WORKLOADS = ("vision", "segmentation", "text")
EXPORT_METHODS = ("export", "torchscript")
LOGGERS = ("tensorboard", "csv", "wandb", "mlflow")
#: The preset each command that takes a config starts from when neither --preset nor --config is
#: given (None: the defaults, fp32 eager); `config show COMMAND` resolves as COMMAND does.
DEFAULT_PRESETS = {"bench": "fast", "train": "baseline", "doctor": None}
COMPLETION_SHELLS = ("bash", "zsh")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends each option's default to its help, except where there is none to show; the
    usage line sums the config fields up as one ``[--SECTION.FIELD VALUE ...]``."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or _is_config_option(action):
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
        shown = [a for a in actions if not _is_config_option(a)]
        if len(shown) < len(actions):
            shown.append(argparse.Action(["--SECTION.FIELD"], "config", metavar="VALUE ..."))
        super().add_usage(usage, shown, groups, prefix)


def _is_config_option(action: argparse.Action) -> bool:
    """An option of torchturbo.config_options (told by its mark, not importing the module)."""
    return getattr(action, "config_option", False)


def _global_options(*, in_subcommand: bool) -> argparse.ArgumentParser:
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


class _CommandParser(_Parser):
    """A command's parser: shows its defaults and takes the global options after its name too."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(
            parents=[_global_options(in_subcommand=True)], formatter_class=_HelpFormatter, **kwargs
        )


def full_parser() -> argparse.ArgumentParser:
    """The parser with every command's config options in place: what completion and the tests
    of the options and the docs read."""
    parser = _parser()
    pending = [parser]
    while pending:
        current = pending.pop()
        if isinstance(current, _Parser):
            current.with_config_options()
        for action in current._actions:
            if isinstance(action, argparse._SubParsersAction):
                pending.extend(action.choices.values())
    return parser


def _parser() -> argparse.ArgumentParser:
    from torchturbo import __version__

    parser = _Parser(
        prog="torchturbo",
        description=(
            "Make PyTorch training faster and leaner, and prove it by measurement: the "
            f"techniques of the article {ARTICLE}, implemented correctly, measured side by side "
            "on your model and kept only where they pay off."
        ),
        parents=[_global_options(in_subcommand=False)],
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"torchturbo {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_CommandParser)

    version = commands.add_parser(
        "version",
        help="versions, device and bf16 support",
        description=(
            "Print the versions of torchturbo, torch and CUDA, the device torchturbo would use, "
            "the bf16 instructions the CPU's flags list, and whether bf16 is native here as a "
            "GEMM probe measures it (flags alone do not tell: bf16 autocast pays off only where "
            "it is native). Quote this with any figure you report."
        ),
    )
    version.set_defaults(run=_run_version)

    bench = commands.add_parser(
        "bench",
        help="measure a config against the fp32 baseline on a workload or recipe",
        description=(
            "Train the workload (or your recipe) with the fp32 eager baseline and with the chosen "
            "config side by side, interleaved in one process, and print step time (median and "
            "spread), throughput, MFU, memory and loss. Ratios are what to read: absolute times "
            "on a shared machine are noise. Under `torchrun --nproc-per-node N -m torchturbo "
            "bench ...` every variant trains as DDP or FSDP per [distributed], each rank on its "
            "own batches, the table adds gradient bytes and communication ms per step, and only "
            "rank 0 prints and writes."
        ),
    )
    _add_target_arguments(bench)
    _add_config_arguments(bench, default_preset=DEFAULT_PRESETS["bench"])
    bench.add_argument("--steps", type=int, default=15, metavar="N", help="timed steps per variant")
    bench.add_argument("--json", type=Path, metavar="FILE", help="also write the rows as JSON here")
    bench.set_defaults(run=_run_bench)

    tune = commands.add_parser(
        "tune",
        help="find the fastest correct config for a workload or recipe, with a report",
        description=(
            "Measure the candidates of every stage (data loader, precision, memory format, "
            "compile, memory, dynamic batching), the highest expected gain per second of "
            "measuring first, each against the current best in paired rounds on the same "
            "batches until the ratio is decided, and keep one only if it is faster beyond the "
            "noise, keeps the loss within tolerance of fp32, fits the memory budget and makes the "
            "whole planned job faster, one-time costs such as compiling included (the job's "
            "length: --planned-steps, else the recipe's, else assumed; the headline says "
            "which). What it compiles is kept in --out/compile-cache, which the written "
            "turbo.toml names so that train loads it. The whole run keeps to --time-budget; "
            "what it cannot measure in time is reported with the time it needs. Tuning again "
            "into the same --out reuses what was measured there, also after Ctrl-C (kept in "
            "interrupted.json). Writes turbo.toml, "
            "results.json, report.md and report.html to --out. Under "
            "torchrun every rank measures DDP/FSDP trials, rank 0 decides (its decisions are "
            "broadcast), DDP comm hooks and bucket sizes are tuned too, and rank 0 writes."
        ),
    )
    _add_target_arguments(tune)
    tune.add_argument(
        "--time-budget",
        type=parse_duration,
        default="5m",
        metavar="DURATION",
        help="wall time for the search, e.g. 90s, 5m, 1h",
    )
    tune.add_argument(
        "--memory-budget",
        type=parse_size,
        metavar="SIZE",
        help="total memory a step may use, e.g. 20GiB, 512MiB (default: no budget)",
    )
    tune.add_argument(
        "--planned-steps",
        type=int,
        default=None,
        metavar="N",
        help=(
            "steps (batches per process) of your real job: a candidate is kept only if the "
            "whole job, one-time costs such as compiling included, is faster with it "
            "(default: the recipe's planned_steps, which recipe_from_trainer and "
            "recipe_from_lightning take from the trainer; else 1,000, assumed)"
        ),
    )
    tune.add_argument(
        "--loss-tolerance",
        type=float,
        default=0.05,
        metavar="FRACTION",
        help="largest relative loss difference from fp32 over the first steps",
    )
    tune.add_argument(
        "--out", type=Path, default=Path("turbo-report"), metavar="DIR", help="output directory"
    )
    tune.add_argument(
        "--only", type=_stage_list, default=(), metavar="STAGE,...", help="run only these stages"
    )
    tune.add_argument(
        "--skip", type=_stage_list, default=(), metavar="STAGE,...", help="leave these stages out"
    )
    tune.set_defaults(run=_run_tune)

    doctor = commands.add_parser(
        "doctor",
        help="the article's 15-item checklist, judged on your model and loader",
        description=(
            "Inspect the model and loader (conv+BN pairs, misaligned dimensions, loader "
            "settings, varying shapes), profile a few training steps (time split, top "
            "operators, peak memory, input- or compute-bound) and print each checklist item "
            "with its state, evidence and, where a quick measurement gives one, the gain. Under "
            "torchrun the model runs as DDP/FSDP and 'communication efficiency' is judged from "
            "the gradient bytes and time counted per step."
        ),
    )
    _add_target_arguments(doctor)
    _add_config_arguments(doctor, default_preset=DEFAULT_PRESETS["doctor"])
    doctor.add_argument(
        "--trace", type=Path, metavar="DIR", help="write a Perfetto/chrome://tracing trace here"
    )
    doctor.add_argument("--steps", type=int, default=5, metavar="N", help="profiled steps")
    doctor.add_argument(
        "--json", type=Path, metavar="FILE", help="also write the diagnosis as JSON here"
    )
    doctor.set_defaults(run=_run_doctor)

    export = commands.add_parser(
        "export",
        help="write a deployment artefact (torch.export .pt2), reloaded and verified",
        description=(
            "Export the recipe's model with torch.export (or legacy TorchScript, which is in "
            "maintenance), reload the file and compare its outputs with the eager model's. The "
            "weights are the trained ones of a `torchturbo train` checkpoint with --checkpoint, "
            "else the recipe's initial ones."
        ),
    )
    _add_target_arguments(export)
    export.add_argument(
        "--out", type=Path, required=True, metavar="FILE", help="file to write (.pt2, or .pt)"
    )
    export.add_argument("--method", choices=EXPORT_METHODS, default="export", help="how to export")
    export.add_argument(
        "--checkpoint",
        type=Path,
        metavar="DIR",
        help="a `train --checkpoint-dir` (its newest valid checkpoint) or one ckpt-* in it",
    )
    export.add_argument(
        "--fuse", action="store_true", help="fold BatchNorm into the preceding convolutions first"
    )
    export.set_defaults(run=_run_export)

    train = commands.add_parser(
        "train",
        help="train a recipe with a config, checkpointing atomically; --resume continues exactly",
        description=(
            "Train for --steps optimizer steps with the given config, saving an atomic, "
            "checksummed checkpoint every --save-every steps to --checkpoint-dir. --resume "
            "continues from the newest valid checkpoint there (falling back to the previous one "
            "if the newest is corrupt) and reproduces the uninterrupted run bit for bit. Under "
            "`torchrun --nproc-per-node N -m torchturbo train ...` every rank trains its share "
            "of the data as DDP or FSDP per [distributed]; rank 0 writes and prints. "
            "Preemption: with --checkpoint-dir, SIGTERM, SIGUSR1, SIGUSR2 or Ctrl-C finishes "
            "the optimizer step under way (every rank the same one) and saves it; a second "
            "signal, or [reliability] stop_grace_s running out, stops at once and keeps the "
            "checkpoints already saved. Exit status: 0 trained to --steps; 75 stopped by a "
            "signal after saving (run again with --resume); 128+N stopped at once by signal N; "
            "2 a problem with the input, printed in one line."
        ),
    )
    _add_target_arguments(train)
    _add_config_arguments(train, default_preset=DEFAULT_PRESETS["train"])
    train.add_argument(
        "--steps", type=int, required=True, metavar="N", help="optimizer steps to train"
    )
    train.add_argument(
        "--checkpoint-dir",
        type=Path,
        metavar="DIR",
        help="where checkpoints go; with it, SIGTERM, SIGUSR1, SIGUSR2 or Ctrl-C finishes the "
        "step under way, saves it and exits with status 75 (a second signal, 2 s or more "
        "later, stops at once)",
    )
    train.add_argument(
        "--save-every",
        type=int,
        default=0,
        metavar="N",
        help="steps between checkpoints; 0 saves at the end only",
    )
    train.add_argument("--resume", action="store_true", help="continue from --checkpoint-dir")
    train.add_argument(
        "--activation-budget",
        type=parse_size,
        metavar="SIZE",
        help="bytes of activations one micro-batch may hold (e.g. 64MiB); above it the batch is "
        "split into smaller micro-batches with accumulation, and the split is reported",
    )
    train.add_argument(
        "--log-dir",
        type=Path,
        help="write each optimizer step's metrics (loss, throughput, MFU, memory, learning "
        "rate, skipped steps, micro-batch split) here, as TensorBoard event files and "
        "metrics.csv unless --logger says otherwise; under torchrun only rank 0 writes",
    )
    train.add_argument(
        "--logger",
        type=_logger_list,
        metavar="NAME,...",
        help="where the metrics go, of tensorboard, csv (both into --log-dir), wandb (a W&B run; "
        "WANDB_MODE=offline keeps it local) and mlflow (an MLflow run in --log-dir/mlruns, or "
        "MLFLOW_TRACKING_URI's); the run's config goes along (default: tensorboard,csv with "
        "--log-dir)",
    )
    train.set_defaults(run=_run_train)
    _add_config_command(commands)

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
    completion.set_defaults(run=_run_completion)
    return parser


def _add_config_command(commands: Any) -> None:
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
        dest="config_action", metavar="ACTION", parser_class=_CommandParser, required=True
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
        "--device", type=_device, metavar="DEVICE", help="cpu, cuda or cuda:N (default: auto)"
    )
    _add_config_arguments(show, default_preset=None)
    show.set_defaults(run=_run_config_show, command="config show")
    schema = actions.add_parser(
        "schema",
        help="the JSON Schema of turbo.toml (save it and point your editor at it)",
        description=(
            "Print the JSON Schema (draft 07) of turbo.toml: every key with its type, choices, "
            "range, default and meaning. With Even Better TOML in VS Code, save it as "
            "turbo.schema.json and start turbo.toml with the line `#:schema ./turbo.schema.json`."
        ),
    )
    schema.set_defaults(run=_run_config_schema, command="config schema")


def _add_target_arguments(parser: argparse.ArgumentParser) -> None:
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
        choices=("small", "large"),
        default="small",
        help="size of the built-in workload: small steps take 0.05-0.2 s on a 2-core CPU, "
        "large ones 1-5 s, as real models do",
    )
    parser.add_argument(
        "--device",
        type=_device,
        metavar="DEVICE",
        help="cpu, cuda or cuda:N (default: cuda when available)",
    )


def _device(text: str) -> str:
    """--device's value, checked like a config's ``device`` before any work starts."""
    from torchturbo.config import device_problem

    problem = device_problem(text, name="")
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


def _add_config_arguments(parser: argparse.ArgumentParser, *, default_preset: str | None) -> None:
    """--preset, --config and every config field as --section.field, in that precedence (the
    fields are added when the command runs: :meth:`_Parser.with_config_options`)."""
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
    if isinstance(parser, _Parser):
        parser.takes_config = parser.config_options_pending = True


def resolved_config(args: argparse.Namespace) -> Any:
    """The config of the command line and where each value came from
    (:class:`~torchturbo.config_resolve.Resolved`): the defaults, then --preset (the command's
    own without --config), --config's keys, the --section.field options and --device."""
    from torchturbo.config_resolve import resolve

    preset = args.preset or (None if args.config else args.default_preset)
    return resolve(
        preset=preset,
        config_file=args.config,
        overrides=args.config_overrides,
        device=args.device,
    )


def chosen_config(args: argparse.Namespace) -> Any:
    """The TurboConfig of the command line (:func:`resolved_config`), checked against this
    machine and launch: errors raise, warnings print one line each."""
    return checked_against_environment(resolved_config(args).config, args)


def config_label(args: argparse.Namespace) -> str:
    """A config's name in a table: the file's or the preset's, with the options over it."""
    base = args.config.name if args.config else (args.preset or args.default_preset or "fp32")
    return " ".join([base, *(given.text for given in args.config_overrides)])


def checked_against_environment(config: Any, args: argparse.Namespace) -> Any:
    """``config``, once :func:`~torchturbo.config.check_environment` found no error in it.

    With an error, the warnings join it in the one error line: every problem at once.
    """
    from torchturbo.config import ConfigError, Environment, check_environment

    errors, cautions = check_environment(config, Environment.current())
    if errors:
        source = str(args.config) if getattr(args, "config", None) else ""
        raise ConfigError(*errors, *cautions, where=source)
    for caution in cautions:
        print(f"torchturbo {args.command}: warning: {caution}", file=sys.stderr)
    return config


def load_target(args: argparse.Namespace) -> Any:
    """The recipe named on the command line, or the built-in workload."""
    if args.recipe:
        from torchturbo.recipe import load_recipe

        return load_recipe(args.recipe)
    from torchturbo.workloads import get_workload

    return get_workload(args.workload, args.size)


def _run_config_show(args: argparse.Namespace) -> int:
    from torchturbo.config_resolve import annotated_toml

    if args.like is not None:
        args.default_preset = DEFAULT_PRESETS[args.like]
    command = f"torchturbo {args.like}" if args.like else "a command"
    heading = (
        f"The config {command} runs with these options. After each value, where it came from:\n"
        "default < --preset < the --config file < a --section.field option or --device."
    )
    print(annotated_toml(resolved_config(args), heading=heading), end="")
    return 0


def _run_config_schema(args: argparse.Namespace) -> int:
    import json

    from torchturbo.config_schema import config_schema

    print(json.dumps(config_schema(), indent=2))
    return 0


def _run_completion(args: argparse.Namespace) -> int:
    import shtab

    print(shtab.complete(full_parser(), shell=args.shell), end="")
    return 0


def _run_version(args: argparse.Namespace) -> int:
    from torchturbo.measure.summary import summary

    for key, value in summary().items():
        print(f"{key:<22} {value}")
    return 0


def _run_bench(args: argparse.Namespace) -> int:
    from torchturbo.config import TurboConfig
    from torchturbo.distributed import is_main_process, launched
    from torchturbo.measure.compare import compare_configs

    if args.steps < 2:
        raise ValueError(f"--steps {args.steps} is too few: give at least 2 timed steps")
    if args.json:
        check_output_file(args.json, "--json")
    chosen = chosen_config(args)
    baseline = TurboConfig(device=chosen.device)
    configs = {"baseline": baseline}
    name = config_label(args)
    if chosen != baseline:
        configs[name] = chosen
    recipe = load_target(args)
    steps_per_repeat = 3 if args.steps >= 6 else 1
    say_emulated(chosen.device, [format_of(config) for config in configs.values()])
    with launched(chosen.device) as env:
        rows = _with_status(
            f"bench {recipe.name}",
            lambda say: compare_configs(
                recipe,
                configs,
                baseline="baseline",
                repeats=max(2, args.steps // steps_per_repeat),
                steps_per_repeat=steps_per_repeat,
                on_progress=say,
            ),
        )
        if not is_main_process():
            return 0
    title = f"torchturbo bench: {recipe.name}"
    if env.is_distributed:
        title += f" ({env.world_size} processes, {env.backend})"
    from torchturbo.output.tables import print_rows

    print_rows(title, rows)
    if args.json:
        from torchturbo.output.results_file import write_results

        payload = {
            "workload": recipe.name,
            "processes": env.world_size,
            "results": [r.to_dict() for r in rows],
        }
        write_results(args.json, payload)
    return 0


def _logger_list(text: str) -> tuple[str, ...]:
    """``wandb,csv`` as a tuple of logger names, each one torchturbo.runs.metrics_log can open."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    if not names or any(name not in LOGGERS for name in names):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give logger names separated by commas, of {', '.join(LOGGERS)}"
        )
    return names


def _stage_list(text: str) -> tuple[str, ...]:
    """``precision,compile`` as a tuple of stage names (checked against the stages by the tuner)."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r}: give stage names separated by commas")
    return names


#: The folder beside turbo.toml that holds what tuning compiled (see techniques/compile.py).
COMPILE_CACHE = "compile-cache"


def _run_tune(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.text import Text

    from torchturbo.distributed import is_main_process, launched
    from torchturbo.output.live import TuneLine
    from torchturbo.output.table_fit import print_table
    from torchturbo.tune.plots import plots_left_out
    from torchturbo.tune.report import (
        incremental_table,
        keep_interrupted,
        read_previous,
        write_report,
    )
    from torchturbo.tune.search import TuneInterrupted, TuneOptions, tune
    from torchturbo.tune.stages import PRECISION_FORMATS
    from torchturbo.tune.summary import headline

    options = TuneOptions(
        time_budget_s=args.time_budget,
        memory_budget=args.memory_budget,
        planned_steps=args.planned_steps,
        loss_tolerance=args.loss_tolerance,
        device=args.device,
        only=args.only,
        skip=args.skip,
        compile_cache_dir=str(args.out / COMPILE_CACHE),
    )
    check_writable(args.out)
    previous = read_previous(args.out)
    recipe = load_target(args)
    console = Console()  # the terminal's width; 80 columns when piped
    say_emulated(
        args.device or "auto",
        PRECISION_FORMATS,
        lambda notice: console.print(notice, markup=False, highlight=False),
    )
    line = TuneLine(f"tune {recipe.name}", options.time_budget_s)
    with launched(args.device or "auto"):
        try:
            with _live_on_rank_zero(line):
                config, result = tune(
                    recipe,
                    options,
                    on_progress=line.report,
                    previous=previous,
                )
        except TuneInterrupted as interrupted:
            if is_main_process() and interrupted.measured:
                kept = keep_interrupted(args.out, interrupted.partial)
                console.print(
                    Text(
                        f"interrupted: {interrupted.measured} measured candidate(s) kept in "
                        f"{kept}; the same command measures the rest"
                    )
                )
            raise
        if not is_main_process():
            return 0
    results = result.to_dict()
    # The report's "how to use" line repeats what the user typed to name the target.
    results["recipe"] = args.recipe or f"--workload {recipe.name}"
    if config.compile.cache_dir:  # relative to turbo.toml, which sits beside it
        config = config.replace(compile__cache_dir=COMPILE_CACHE)
    paths = write_report(args.out, results, config.to_toml())
    if result.reuse_note:
        console.print(Text(result.reuse_note))
    if (left_out := plots_left_out()) is not None:
        console.print(Text(f"plots left out of the report: {left_out}"))
    print_table(console, incremental_table(results))
    console.print(Text(headline(results)))
    console.print(Text(f"report: {paths['html']}"))
    console.print(Text(f"use it: torchturbo bench {results['recipe']} --config {paths['config']}"))
    return 0


def _run_doctor(args: argparse.Namespace) -> int:
    from torchturbo.distributed import is_main_process, launched
    from torchturbo.doctor import diagnose, render

    if args.steps < 1:
        raise ValueError(f"--steps {args.steps} is too few: profile at least 1 step")
    # Without --config, --preset or a config option the doctor diagnoses the fp32 baseline.
    chosen = args.config or args.preset or args.config_overrides
    config = chosen_config(args) if chosen else None
    if args.trace:
        check_writable(args.trace, "--trace")
    if args.json:
        check_output_file(args.json, "--json")
    recipe = load_target(args)
    device = args.device or (config.device if config else "auto")
    # bf16: the precision the doctor times against the config where it is native.
    say_emulated(device, ["bf16", format_of(config)] if config else ["bf16"])
    with launched(device):
        diagnosis = _with_status(
            f"doctor {recipe.name}",
            lambda say: diagnose(
                recipe,
                config=config,
                device=args.device,
                trace_dir=args.trace,
                profile_steps=args.steps,
                on_progress=say,
            ),
        )
        if not is_main_process():
            return 0
    render(diagnosis)
    if args.json:
        from torchturbo.output.results_file import write_results

        write_results(args.json, diagnosis.to_dict())
    return 0


def _run_export(args: argparse.Namespace) -> int:
    from torchturbo.output.tables import format_bytes
    from torchturbo.recipe import describe_exception
    from torchturbo.techniques.export import export_recipe

    check_output_file(args.out, "--out")
    recipe = load_target(args)
    try:
        report = export_recipe(
            recipe, args.out, method=args.method, checkpoint=args.checkpoint, fuse=args.fuse
        )
    except Exception as err:  # torch.export/jit refusing the user's model is about the model
        capturing = ("torch/export/", "torch/jit/")
        frames = [f.f_code.co_filename for f, _ in traceback.walk_tb(err.__traceback__)]
        if isinstance(err, OSError) or not any(c in f for f in frames for c in capturing):
            raise
        raise ValueError(
            f"{args.method} could not capture the model of recipe {recipe.name!r}: "
            f"{describe_exception(err)}; --debug shows the traceback"
        ) from err
    which = "trained weights" if args.checkpoint else "initial weights: no --checkpoint"
    print(
        f"wrote {report.path}: {format_bytes(report.size_bytes)} "
        f"({format_bytes(report.weights_bytes)} of {which}) in {report.export_s:.1f} s"
    )
    print(
        f"reloaded and checked at batch sizes {report.checked_batch_sizes}: max relative "
        f"difference {report.max_rel_diff:.1e} (tolerance {report.tolerance:.0e})"
    )
    return 0


#: Seconds between plain progress lines of ``train`` when its output is not a terminal.
PROGRESS_EVERY_S = 30.0


def _run_train(args: argparse.Namespace) -> int:
    from torchturbo.reliability.preemption import StopNow, stop_on_signals

    # From here on, not only once training runs: importing torch and building the recipe take
    # seconds, and a SIGTERM then would kill the run instead of stopping it after one step.
    try:
        with stop_on_signals(args.checkpoint_dir is not None):
            return _train_command(args)
    except StopNow as stop:
        from torchturbo.distributed import main_print

        main_print(
            f"{stop}: stopped at once, inside a step; the checkpoints already in "
            f"{args.checkpoint_dir} are intact, --resume goes on from the newest"
        )
        return stop.exit_status


def _train_command(args: argparse.Namespace) -> int:
    from torchturbo.config import INT64_MAX
    from torchturbo.distributed import is_main_process, launched, main_print
    from torchturbo.reliability.preemption import EXIT_STOPPED
    from torchturbo.runs.train import TrainInterrupted, train

    if not 1 <= args.steps <= INT64_MAX:
        raise ValueError(f"--steps {args.steps} is invalid: expected 1 to 2**63 - 1 steps")
    if not 0 <= args.save_every <= INT64_MAX:
        raise ValueError(
            f"--save-every {args.save_every} is invalid: expected >= 0 (0 = at the end only)"
        )
    if args.resume and args.checkpoint_dir is None:
        raise ValueError("--resume needs --checkpoint-dir to know where to resume from")
    if args.save_every and args.checkpoint_dir is None:
        raise ValueError("--save-every needs --checkpoint-dir to know where to save")
    config = chosen_config(args)
    if args.activation_budget:
        config = config.replace(reliability__memory_budget_bytes=args.activation_budget)
    recipe = load_target(args)
    # Under torchrun every rank trains its share of each batch (the engine wraps the model per
    # [distributed]); rank 0 writes the checkpoints, the logs and prints.
    loggers = _train_loggers(args.log_dir, args.logger, config.to_dict())
    with (
        launched(config.device),
        loggers as logger,
        _train_progress(f"train {recipe.name}", args.steps) as on_progress,
    ):
        try:
            result = train(
                recipe,
                config,
                steps=args.steps,
                checkpoint_dir=args.checkpoint_dir,
                save_every=args.save_every,
                resume=args.resume,
                on_event=main_print,
                logger=logger,
                on_progress=on_progress,
            )
        except TrainInterrupted as stopped:
            again = "again" if args.resume else "with --resume"
            main_print(
                f"{stopped.signal_name}: stopped after optimizer step "
                f"{stopped.optimizer_steps} and saved it in {stopped.saved}; run the same "
                f"command {again} to go on from there",
                flush=True,  # a peer's exit may make torchrun end this process any moment
            )
            return EXIT_STOPPED
        if not is_main_process():
            return 0
    if result.first_step_s is not None:
        later = "" if result.later_step_s is None else f", then {result.later_step_s:.3f} s a step"
        print(f"first step {result.first_step_s:.2f} s (one-time costs included){later}")
    loss = "n/a" if result.last_loss is None else f"{result.last_loss:.4f}"
    print(
        f"trained to optimizer step {result.optimizer_steps}, last loss {loss}"
        + (f" ({result.skipped_steps} steps skipped)" if result.skipped_steps else "")
        + ", micro-batch "
        f"split {result.micro_batch_split} (size {result.micro_batch_size}); "
        f"resumed from {result.resumed_from}; last checkpoint {result.saved}"
    )

    return 0


@contextlib.contextmanager
def _train_progress(title: str, steps: int) -> Iterator[Callable[[Any], None]]:
    """``train``'s ``on_progress`` on rank 0: a live line on a terminal, else a plain line every
    :data:`PROGRESS_EVERY_S` seconds (and nothing on other ranks)."""
    from rich.console import Console

    from torchturbo.distributed import is_main_process
    from torchturbo.output.live import TrainLine, live

    line = TrainLine(title, steps)
    if not is_main_process():
        yield lambda progress: None
    elif Console(stderr=True).is_terminal:
        with live(line):
            yield line.report
    else:

        def report(progress: Any) -> None:
            line.report(progress)
            if line.due(PROGRESS_EVERY_S):
                print(line.plain(), flush=True)

        yield report


def format_of(config: Any) -> str:
    """The number format a config's matmuls use: fp8 with float8, else its precision."""
    return "fp8" if config.precision.float8 else config.precision.dtype


def say_emulated(device: str, formats: Sequence[str], show: Callable[[str], None] = print) -> None:
    """Say once, before a run, which of ``formats`` this hardware only emulates (rank 0)."""
    from torchturbo.distributed import is_main_process
    from torchturbo.engine import resolve_device
    from torchturbo.measure.native import emulation_notice

    if not is_main_process():
        return
    notice = emulation_notice(resolve_device(device), formats)
    if notice is not None:
        show(notice)


@contextlib.contextmanager
def _train_loggers(
    log_dir: Path | None, names: Sequence[str] | None, config: dict[str, Any]
) -> Iterator[Any]:
    """``train --log-dir/--logger``'s loggers (rank 0 writes, other ranks log to nothing), with
    the run's ``config``, closed at the end; None with neither option."""
    if log_dir is None and names is None:
        yield None
        return
    from torchturbo.runs.metrics_log import open_loggers

    with open_loggers(log_dir, names, config=config) as loggers:
        for note in loggers.notes:
            print(f"{'--logger' if names else '--log-dir'}: {note}")
        yield loggers


def check_writable(directory: Path, option: str = "--out") -> None:
    """Fail before hours of tuning, not after, when the output directory cannot be written.

    The directory (and its parents) is created if missing; errors name ``option`` and the path.
    """
    import os
    import tempfile

    where = f"{option} {str(directory)!r}"
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"{where} is not a directory; give a directory to write into")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if not os.access(directory, os.W_OK):
            raise PermissionError(13, os.strerror(13))
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as err:
        raise ValueError(f"{where} cannot be written: {err.strerror or err}") from err


def check_output_file(path: Path, option: str) -> None:
    """Fail before the work, not after, when ``path`` cannot be written as a file."""
    where = f"{option} {str(path)!r}"
    if path.is_dir():
        raise ValueError(f"{where} is a directory; give a file name")
    check_writable(path.parent, option=f"the directory of {option}")


def _with_status(title: str, work: Callable[[Callable[[str], None]], Any]) -> Any:
    """Run ``work(say)`` under a live status line that ``say`` updates (rank 0 only)."""
    from torchturbo.output.live import StatusLine

    line = StatusLine(title)
    with _live_on_rank_zero(line):
        return work(line.report)


@contextlib.contextmanager
def _live_on_rank_zero(line: Any) -> Iterator[None]:
    """The live line on rank 0; other ranks draw nothing."""
    from torchturbo.distributed import is_main_process
    from torchturbo.output.live import live

    with live(line) if is_main_process() else contextlib.nullcontext():
        yield


if __name__ == "__main__":
    raise SystemExit(main())
