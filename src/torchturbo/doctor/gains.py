"""Quick measured gains for the doctor's items: a few interleaved steps, not a benchmark.

Training variants (bf16, channels_last) run as fresh ``bench.Trial`` s on the same fixed batches,
timed side by side with ``measure.timing.measure_interleaved``; Conv→BatchNorm folding is timed on
the eval-mode forward it is valid for. The figures are rough (3 steps each on a possibly busy
machine) and are quoted with the run's noise band; ``torchturbo bench`` and the tuner measure
properly.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.utils.fusion import fuse_conv_bn_eval

from torchturbo.bench import Trial
from torchturbo.config import TurboConfig
from torchturbo.measure.timing import measure_interleaved, noise_band
from torchturbo.recipe import Recipe

#: Timed steps per variant.
REPEATS = 3
#: A gain is reported as one only above this, or above the run's noise band if that is larger.
MIN_GAIN = 0.05
#: Above this noise band the figures are flagged: the machine was too busy to trust them.
NOISY = 0.5


@dataclass(frozen=True)
class Speedups:
    """Speed of each variant relative to the first (the user's config), from one interleaved run."""

    ratios: dict[str, float]
    #: The largest relative IQR among the variants (measure.timing.noise_band).
    noise: float
    repeats: int
    #: What the figures describe when it differs from the config, e.g. "eager, without compile".
    note: str = ""

    def beats(self, ratio: float) -> bool:
        """Whether ``ratio`` is a gain beyond the noise of this run."""
        return ratio > 1 + max(MIN_GAIN, self.noise)

    def describe(self, ratio: float) -> str:
        notes = [f"noise ±{self.noise:.0%}", *([self.note] if self.note else [])]
        if self.noise > NOISY:
            notes.append("a busy machine: rerun when it is quiet")
        return f"~{ratio:.2f}x measured over {self.repeats} steps ({', '.join(notes)})"


def measure_configs(
    recipe: Recipe, configs: Mapping[str, TurboConfig], batches: list[Any]
) -> Speedups:
    """Train each config on a fresh model, interleaved; ratios against the first config."""
    trials: dict[str, Trial] = {}
    try:
        for name, config in configs.items():
            trials[name] = Trial(recipe, config, batches)
        device = next(iter(trials.values())).turbo.device
        timings = measure_interleaved(
            {name: trial.step for name, trial in trials.items()},
            device=device,
            warmup=1,
            repeats=REPEATS,
            steps_per_repeat=1,
        )
    finally:
        for trial in trials.values():
            trial.close()
    base = timings[next(iter(configs))].median
    ratios = {name: base / timing.median for name, timing in timings.items()}
    return Speedups(ratios, noise_band(timings), REPEATS)


def fold_speedup(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], Any],
    batch: Any,
    pairs: list[tuple[str, str]],
    device: torch.device,
) -> Speedups | None:
    """Eval-mode forward with each (conv, norm) pair folded into the conv, against unfolded.

    None when folding changes the loss beyond float32 rounding: then the pairs were not what
    they seemed (a norm reading something besides the conv), and no gain is claimed.
    """
    reference = copy.deepcopy(model).eval()
    folded = copy.deepcopy(reference)
    for conv_name, norm_name in pairs:
        conv, norm = folded.get_submodule(conv_name), folded.get_submodule(norm_name)
        folded.set_submodule(conv_name, fuse_conv_bn_eval(conv, norm))
        folded.set_submodule(norm_name, nn.Identity())

    def forward(module: nn.Module) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            with torch.no_grad():
                out = loss_fn(module, batch)
            return out[0] if isinstance(out, tuple) else out

        return run

    # Folding reorders float32 arithmetic: agreement to ~1e-4 relative is rounding, not error.
    if not torch.allclose(forward(reference)(), forward(folded)(), rtol=1e-3, atol=1e-4):
        return None
    timings = measure_interleaved(
        {"unfolded": forward(reference), "folded": forward(folded)},
        device=device,
        warmup=1,
        repeats=REPEATS,
        steps_per_repeat=1,
    )
    ratio = timings["unfolded"].median / timings["folded"].median
    return Speedups({"unfolded": 1.0, "folded": ratio}, noise_band(timings), REPEATS)
