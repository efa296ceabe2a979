"""``torchturbo bench``: a config against the fp32 eager baseline, side by side in one run
(:func:`torchturbo.trials.variants.compare_configs`).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from torchturbo.cli.arguments import (
    DEFAULT_PRESETS,
    add_config_arguments,
    add_target_arguments,
    count,
)
from torchturbo.cli.shared import (
    check_output_file,
    chosen_config,
    config_label,
    format_of,
    load_target,
    notice_printer,
    say_emulated,
    with_status,
)


def add_parser(commands: Any) -> None:
    """Add ``torchturbo bench`` to the parser's ``commands``."""
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
    add_target_arguments(bench)
    add_config_arguments(bench, default_preset=DEFAULT_PRESETS["bench"])
    bench.add_argument(
        "--steps",
        type=count(2, what="timed steps per variant"),
        default=15,
        metavar="N",
        help="timed steps per variant",
    )
    bench.add_argument(
        "--json",
        type=Path,
        metavar="FILE",
        help="also write the rows as JSON here (-: to stdout, and the table to stderr)",
    )
    bench.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from torchturbo.config import TurboConfig
    from torchturbo.distributed import is_main_process, launched
    from torchturbo.trials.variants import compare_configs

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
    say_emulated(
        chosen.device,
        [format_of(config) for config in configs.values()],
        show=notice_printer(args.json),
    )
    with launched(chosen.device) as env:
        rows = with_status(
            f"bench {recipe.name}",
            lambda say: compare_configs(
                recipe,
                configs,
                baseline="baseline",
                repeats=max(2, args.steps // steps_per_repeat),
                steps_per_repeat=steps_per_repeat,
                on_progress=say,
            ),
            args.json,
        )
        if not is_main_process():
            return 0
    title = f"torchturbo bench: {recipe.name}"
    if env.is_distributed:
        title += f" ({env.world_size} processes, {env.backend})"
    from rich.console import Console

    from torchturbo.output.results_file import STDOUT
    from torchturbo.output.tables import print_rows

    # With --json -, stdout is the JSON alone (for jq and pipes): the table goes to stderr.
    print_rows(title, rows, Console(stderr=str(args.json) == STDOUT))
    if args.json:
        from torchturbo.output.results_file import write_results

        payload = {
            "workload": recipe.name,
            "processes": env.world_size,
            "results": [r.to_dict() for r in rows],
        }
        write_results(args.json, payload)
    return 0
