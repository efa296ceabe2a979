"""``torchturbo doctor``: the article's checklist judged on a model and loader
(:mod:`torchturbo.doctor`).
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
    check_writable,
    chosen_config,
    format_of,
    load_target,
    notice_printer,
    say_emulated,
    with_status,
)


def add_parser(commands: Any) -> None:
    """Add ``torchturbo doctor`` to the parser's ``commands``."""
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
    add_target_arguments(doctor)
    add_config_arguments(doctor, default_preset=DEFAULT_PRESETS["doctor"])
    doctor.add_argument(
        "--trace", type=Path, metavar="DIR", help="write a Perfetto/chrome://tracing trace here"
    )
    doctor.add_argument(
        "--steps",
        type=count(1, what="profiled steps"),
        default=5,
        metavar="N",
        help="profiled steps",
    )
    doctor.add_argument(
        "--json",
        type=Path,
        metavar="FILE",
        help="also write the diagnosis as JSON here (-: to stdout, and the checklist to stderr)",
    )
    doctor.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from torchturbo.distributed import is_main_process, launched
    from torchturbo.doctor import diagnose, render

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
    say_emulated(
        device, ["bf16", format_of(config)] if config else ["bf16"], show=notice_printer(args.json)
    )
    with launched(device):
        diagnosis = with_status(
            f"doctor {recipe.name}",
            lambda say: diagnose(
                recipe,
                config=config,
                device=args.device,
                trace_dir=args.trace,
                profile_steps=args.steps,
                on_progress=say,
            ),
            args.json,
        )
        if not is_main_process():
            return 0
    from rich.console import Console

    from torchturbo.output.results_file import STDOUT

    # With --json -, stdout is the JSON alone (for jq and pipes): the checklist goes to stderr.
    render(diagnosis, Console(stderr=str(args.json) == STDOUT))
    if args.json:
        from torchturbo.output.results_file import write_results

        write_results(args.json, diagnosis.to_dict())
    return 0
