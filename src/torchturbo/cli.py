"""The ``torchturbo`` command: argument parsing, error reporting and printing only.

Every command's work lives in its own module; this one maps arguments onto it. User errors
(bad config, recipe, value) print one readable line and exit with code 2; ``--debug`` shows the
traceback instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

EXIT_USAGE = 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return EXIT_USAGE
    try:
        return args.run(args) or 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        if args.debug or not _is_user_error(err):
            raise
        print(f"torchturbo {args.command}: error: {err}", file=sys.stderr)
        return EXIT_USAGE


def _is_user_error(err: Exception) -> bool:
    from torchturbo.config import ConfigError
    from torchturbo.recipe import RecipeError

    return isinstance(err, (ConfigError, RecipeError, ValueError, FileNotFoundError, OSError))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torchturbo",
        description="Make PyTorch training faster and leaner, and prove it by measurement.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    version = commands.add_parser("version", help="versions, device and bf16 support")
    version.set_defaults(run=_run_version)

    bench = commands.add_parser(
        "bench",
        help="measure a config against the fp32 baseline on a workload or recipe",
        description=(
            "Train the workload (or your recipe) with the fp32 eager baseline and with the chosen "
            "config side by side, interleaved in one process, and print step time (median and "
            "spread), throughput, MFU, memory and loss. Ratios are what to read: absolute times "
            "on a shared machine are noise."
        ),
    )
    _add_target_arguments(bench)
    choice = bench.add_mutually_exclusive_group()
    choice.add_argument(
        "--preset", choices=("baseline", "fast"), default="fast", help="a named config"
    )
    choice.add_argument("--config", type=Path, help="a TOML config file (e.g. a tuned turbo.toml)")
    bench.add_argument("--steps", type=int, default=15, help="timed steps per variant (default 15)")
    bench.add_argument("--json", type=Path, help="also write the rows as JSON here")
    bench.set_defaults(run=_run_bench)
    return parser


def _add_target_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "recipe",
        nargs="?",
        help="your recipe: path/to/file.py:function or package.module:function",
    )
    parser.add_argument(
        "--workload",
        default="vision",
        help="built-in workload when no recipe is given: vision, segmentation, text",
    )
    parser.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available)")


def load_target(args: argparse.Namespace) -> Any:
    """The recipe named on the command line, or the built-in workload."""
    if args.recipe:
        from torchturbo.recipe import load_recipe

        return load_recipe(args.recipe)
    from torchturbo.workloads import get_workload

    return get_workload(args.workload)


def _run_version(args: argparse.Namespace) -> int:
    from torchturbo.system import summary

    for key, value in summary().items():
        print(f"{key:<22} {value}")
    return 0


def _run_bench(args: argparse.Namespace) -> int:
    from torchturbo.bench import compare_configs
    from torchturbo.config import TurboConfig
    from torchturbo.report import print_rows

    if args.steps < 2:
        raise ValueError(f"--steps {args.steps} is too few: give at least 2 timed steps")
    chosen = TurboConfig.load(args.config) if args.config else TurboConfig.preset(args.preset)
    if args.device:
        chosen = chosen.replace(device=args.device)
    baseline = TurboConfig(device=chosen.device)
    configs = {"baseline": baseline}
    name = args.config.name if args.config else args.preset
    if chosen != baseline:
        configs[name] = chosen
    recipe = load_target(args)
    steps_per_repeat = 3 if args.steps >= 6 else 1
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
    print_rows(f"torchturbo bench: {recipe.name}", rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {"workload": recipe.name, "results": [r.to_dict() for r in rows]}
        args.json.write_text(json.dumps(payload, indent=2))
    return 0


def _with_status(title: str, work: Callable[[Callable[[str], None]], Any]) -> Any:
    """Run ``work(say)`` under a live status line that ``say`` updates."""
    from rich.console import Console

    console = Console(stderr=True)
    with console.status(title) as status:
        return work(lambda message: status.update(f"{title}: {message}"))


if __name__ == "__main__":
    raise SystemExit(main())
