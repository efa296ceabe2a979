"""``torchturbo export``: a deployment artefact, reloaded and verified
(:mod:`torchturbo.techniques.tools.export`).
"""

from __future__ import annotations

import argparse
import traceback
from pathlib import Path
from typing import Any

from torchturbo.cli.arguments import EXPORT_METHODS, add_target_arguments
from torchturbo.cli.shared import check_output_file, load_target


def add_parser(commands: Any) -> None:
    """Add ``torchturbo export`` to the parser's ``commands``."""
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
    add_target_arguments(export)
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
    export.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from torchturbo.output.tables import format_bytes
    from torchturbo.recipe import describe_exception
    from torchturbo.techniques.tools.export import export_recipe

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
