"""Quick measured gains for the doctor's items, by the tuner's own measurement and rule.

Training variants (bf16, channels_last) run as fresh ``trials.trial.Trial`` s on the same fixed
batches; each is timed against its reference in paired rounds and decided by the tuner's
sequential rule (``tune.search.compare``, ``techniques.framework.decide``), capped at a few
rounds: a diagnosis, not a tuning run. So a figure the doctor prints means what the tuner's
would, and a gain that does not clear the noise reads "within noise", never "recommended".
Conv→BatchNorm folding is timed the same way on the eval-mode forward it is valid for.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.conv import _ConvNd
from torch.nn.utils.fusion import fuse_conv_bn_eval

from torchturbo.config import TurboConfig
from torchturbo.recipe import Recipe
from torchturbo.techniques.framework.decide import RatioEstimate, describe
from torchturbo.trials.trial import Trial
from torchturbo.tune.search.compare import compare

#: Rounds per comparison: enough to decide a clear gain (3-5 rounds), few enough for a diagnosis.
MAX_ROUNDS = 6


@dataclass(frozen=True)
class Gain:
    """A variant against its reference, as the tuner would judge it."""

    against: str
    speed: RatioEstimate
    #: What the figure describes when it differs from the config, e.g. "eager, without compile".
    note: str = ""

    @property
    def faster(self) -> bool:
        return self.speed.decision == "faster"

    def describe(self) -> str:
        note = f", {self.note}" if self.note else ""
        return f"~{describe(self.speed)} against {self.against}{note}"


def deciding(gains: Sequence[Gain]) -> Gain:
    """Of one lever's measurements (alone, on top of another), the one its verdict rests on:
    the largest that is faster, else the first. The checklist item and the lever both show it,
    so that one verdict has one figure."""
    faster = [gain for gain in gains if gain.faster]
    return max(faster, key=lambda gain: gain.speed.ratio) if faster else gains[0]


def measure_variants(
    recipe: Recipe,
    variants: Mapping[str, tuple[TurboConfig, str | None]],
    batches: list[Any],
    *,
    note: str = "",
) -> dict[str, Gain]:
    """Train each variant on a fresh model and time it against its reference variant (the first
    one has none): ``{name: (config, reference name)}`` -> ``{name: Gain}``."""
    trials: dict[str, Trial] = {}
    try:
        for name, (config, _) in variants.items():
            trials[name] = Trial(recipe, config, batches)
            trials[name].step()  # the first step carries one-time costs: keep it out of timing
        gains = {}
        for name, (_, reference) in variants.items():
            if reference is None:
                continue
            measured = compare(
                trials[reference],
                trials[name],
                against=reference,
                device=trials[name].turbo.device,
                max_rounds=MAX_ROUNDS,
                may_continue=lambda seconds: True,
            )
            gains[name] = Gain(reference, measured.comparison.speed, note)
        return gains
    finally:
        for trial in trials.values():
            trial.close()


class _Forward:
    """A plain callable as ``tune.search.compare`` sees a trial: the same input every call, one
    count."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.step = fn
        self.step_seconds: float | None = None
        self.batches: list[Any] = []

    def align_with(self, other: Any) -> None:
        """Every call takes the same input: nothing to align."""

    def recent_count(self, steps: int) -> float:
        return float(steps)


def fold_gain(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], Any],
    batch: Any,
    pairs: list[tuple[str, str]],
    device: torch.device,
) -> Gain | None:
    """Eval-mode forward with each (conv, norm) pair folded into the conv, against unfolded.

    None when folding changes the loss beyond float32 rounding: then the pairs were not what
    they seemed (a norm reading something besides the conv), and no gain is claimed.
    """
    reference = copy.deepcopy(model).eval()
    folded = copy.deepcopy(reference)
    for conv_name, norm_name in pairs:
        conv, norm = folded.get_submodule(conv_name), folded.get_submodule(norm_name)
        # The pairs are conv_bn_pairs': a Conv1-3d and the BatchNorm1-3d that reads only it.
        assert isinstance(conv, _ConvNd) and isinstance(norm, _BatchNorm)
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
    measured = compare(
        _Forward(forward(reference)),  # type: ignore[arg-type]
        _Forward(forward(folded)),  # type: ignore[arg-type]
        against="unfolded",
        device=device,
        max_rounds=MAX_ROUNDS,
        may_continue=lambda seconds: True,
        cycle=1,  # every call runs the same batch
    )
    return Gain("unfolded", measured.comparison.speed, "eval-mode forward")
