"""The first step of ``torchturbo train`` with and without the compile cache tuning leaves.

``tune`` compiles into ``compile-cache/`` beside turbo.toml (inductor's cache folder: graphs,
AOTAutograd results and the built C++ kernels) and turbo.toml names it, so ``train --config
turbo.toml`` loads what tuning compiled. This script measures what that saves, each run a fresh
process (``torchturbo train``, which prints its first step's seconds), in rounds of one cold
run then one warm run on a fresh folder:

* ``cold``: compile on, an empty cache folder and an empty TMPDIR (inductor's default folder,
  where it keeps the C++ precompiled header), so that nothing left on the machine helps;
* ``warm``: the same config with the folder a previous process filled, as after ``tune``.

The recipe is :func:`recipe`: a small CNN on fixed-size images, so that the steps are cheap next
to the compile they follow on a shared 2-core CPU.

    python benchmarks/compile_cache.py --rounds 2 --json benchmarks/results/compile_cache.json
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchturbo.config import TurboConfig
from torchturbo.output.results_file import write_results
from torchturbo.recipe import Recipe

_FIRST = re.compile(r"first step (?P<first>[0-9.]+) s .*?then (?P<later>[0-9.]+) s a step")


class SmallConv(nn.Module):
    """Two conv blocks and a linear head: a model whose compile is the cost, not its steps."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.Conv2d(32, 32, 3, padding=1),
            nn.ReLU(),
        )
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).mean(dim=(2, 3)))


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def recipe() -> Recipe:
    """Learnable synthetic 32x32 images (label: the brightest channel), batches of 32."""
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(512, 3, 32, 32, generator=generator)
    labels = images.mean(dim=(2, 3)).argmax(dim=1)
    return Recipe(
        name="small-conv",
        model=SmallConv,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        loss_fn=_loss,
        dataset=torch.utils.data.TensorDataset(images, labels),
        batch_size=32,
    )


def run_train(config: Path, steps: int, inductor_home: Path) -> dict[str, float]:
    """One fresh ``torchturbo train`` process; its first step's and later steps' seconds."""
    # The config's folder is the only cache in play: inductor's default one lives under TMPDIR.
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["TMPDIR"] = str(inductor_home)
    command = [
        sys.executable,
        "-m",
        "torchturbo",
        "train",
        f"{__file__}:recipe",
        "--config",
        str(config),
        "--steps",
        str(steps),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    match = _FIRST.search(done.stdout)
    if done.returncode or match is None:
        raise RuntimeError(f"train failed ({done.returncode}): {done.stderr[-2000:]}")
    return {"first_s": float(match["first"]), "later_s": float(match["later"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="cold/warm pairs (2)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run (20)")
    parser.add_argument("--json", type=Path, help="write the results to this JSON file")
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {"cold": [], "warm": []}
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        for r in range(args.rounds):
            # A fresh folder per round: its cold run fills it, its warm run reads it.
            folder = root / f"round{r}"
            folder.mkdir()
            config = folder / "turbo.toml"
            TurboConfig(device="cpu").replace(
                compile__mode="default", compile__cache_dir="compile-cache"
            ).save(config)
            order = ("cold", "warm")
            # Inductor's default folder (under TMPDIR) holds the C++ precompiled header, whose
            # path is part of every kernel's cache key: one per round, shared by its two runs,
            # as on a machine where train follows tune.
            home = folder / "tmp"
            home.mkdir()
            for way in order:
                runs[way].append(run_train(config, args.steps, home))
                print(f"round {r + 1} {way}: {runs[way][-1]}", flush=True)
    cold = statistics.median(x["first_s"] for x in runs["cold"])
    warm = statistics.median(x["first_s"] for x in runs["warm"])
    later = statistics.median(x["later_s"] for x in runs["cold"] + runs["warm"])
    cold_compile, warm_compile = cold - later, warm - later
    print(
        f"first step: cold {cold:.1f} s, warm {warm:.1f} s; compile share "
        f"(first step - a later step): cold {cold_compile:.1f} s, warm {warm_compile:.1f} s = "
        f"{warm_compile / cold_compile:.2f}x of cold"
    )
    results: dict[str, Any] = {
        "benchmark": "compile_cache",
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "runs": runs,
        "cold_first_s": cold,
        "warm_first_s": warm,
        "later_step_s": later,
        "warm_over_cold_compile": warm_compile / cold_compile,
    }
    if args.json:
        write_results(args.json, results)


if __name__ == "__main__":
    main()
