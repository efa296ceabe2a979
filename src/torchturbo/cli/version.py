"""``torchturbo version``: the versions, the device and whether bf16 is native here."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(commands: Any) -> None:
    """Add ``torchturbo version`` to the parser's ``commands``."""
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
    version.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from torchturbo.measure.machine import summary

    for key, value in summary().items():
        print(f"{key:<22} {value}")
    return 0
