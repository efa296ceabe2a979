"""What several commands do around their work: resolve and check the config of the command line,
load the recipe or workload, check output paths before hours of work, say which number formats
are emulated, and draw a live status line on rank 0.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any


def resolved_config(args: argparse.Namespace) -> Any:
    """The config of the command line and where each value came from
    (:class:`~torchturbo.config.resolve.Resolved`): the defaults, then --preset (the command's
    own without --config), --config's keys, the --section.field options and --device."""
    from torchturbo.config.resolve import resolve

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
    from torchturbo.distributed import is_main_process
    from torchturbo.workloads import get_workload

    recipe = get_workload(args.workload, args.size, device=getattr(args, "device", None))
    sizing = recipe.extras.get("sizing")
    if sizing is not None and is_main_process():
        print(sizing.describe(recipe.name), file=sys.stderr)
    return recipe


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


def notice_printer(json_path: Path | None) -> Callable[[str], None]:
    """Where a command's notes go: stdout, or stderr when ``--json -`` makes stdout the JSON."""
    if json_path is not None and str(json_path) == "-":
        return lambda text: print(text, file=sys.stderr)
    return print


def check_writable(directory: Path, option: str = "--out") -> None:
    """Fail before hours of tuning, not after, when ``directory`` could not be written.

    Nothing is left behind: a directory that does not exist yet is not created (the command
    creates it when it writes), its nearest existing parent is checked instead. Errors name
    ``option`` and the path.
    """
    import os
    import tempfile

    from torchturbo.base.paths import loop_words, symlink_loop

    where = f"{option} {str(directory)!r}"
    if (loop := symlink_loop(directory)) is not None:
        raise ValueError(f"{where}: {loop_words(loop)}")
    existing = directory
    while not existing.exists() and existing != existing.parent:
        if existing.is_symlink():  # a dangling link: writing through it needs its target
            raise ValueError(f"{where} is a link to {os.readlink(existing)!r}, which is missing")
        existing = existing.parent
    if not existing.is_dir():
        name = (
            "is not a directory" if existing == directory else f"is under {str(existing)!r}, a file"
        )
        raise ValueError(f"{where} {name}; give a directory to write into")
    try:
        if not os.access(existing, os.W_OK | os.X_OK):
            raise PermissionError(13, os.strerror(13))
        # access() does not see read-only mounts or /proc; a probe removed at once does.
        if existing == directory:
            with tempfile.TemporaryFile(dir=directory):
                pass
        else:
            os.rmdir(tempfile.mkdtemp(dir=existing))
    except OSError as err:
        raise ValueError(f"{where} cannot be written: {err.strerror or err}") from err


def check_output_file(path: Path, option: str) -> None:
    """Fail before the work, not after, when ``path`` cannot be written as a file (``-``:
    standard output, always writable)."""
    where = f"{option} {str(path)!r}"
    if str(path) == "-":
        return
    if path.is_dir():
        raise ValueError(f"{where} is a directory; give a file name")
    check_writable(path.parent, option=f"the directory of {option}")


def with_status(
    title: str, work: Callable[[Callable[[str], None]], Any], json_path: Path | None = None
) -> Any:
    """Run ``work(say)`` under a live status line that ``say`` updates (rank 0 only); its
    plain lines go to stderr when ``--json -`` makes stdout the JSON."""
    from torchturbo.output.live import StatusLine

    line = StatusLine(title)
    stream = sys.stderr if json_path is not None and str(json_path) == "-" else None
    with live_on_rank_zero(line, stream):
        return work(line.report)


@contextlib.contextmanager
def live_on_rank_zero(line: Any, stream: Any = None) -> Iterator[None]:
    """The live line on rank 0 (plain lines on ``stream`` where there is no terminal); other
    ranks draw nothing."""
    from torchturbo.distributed import is_main_process
    from torchturbo.output.live import live

    with live(line, stream=stream) if is_main_process() else contextlib.nullcontext():
        yield
