"""What the judgments read: every fact and measurement the doctor gathered, in one place, and
the thresholds that turn shares of time or memory into a verdict."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchturbo.config import TurboConfig
from torchturbo.doctor.data_facts import DatasetFacts, LoaderFacts
from torchturbo.doctor.diagnosis import Bound
from torchturbo.doctor.gains import Gain
from torchturbo.doctor.model_facts import ModelFacts
from torchturbo.doctor.profiling import ProfileResult
from torchturbo.measure.device_busy import regime
from torchturbo.measure.memory import memory_capacity
from torchturbo.recipe import Recipe

#: Input wait above this share of the step is worth fixing in the loader...
LOADER_SHARE = 0.05
#: ...unless it is below this, in seconds per step: fetching a ready batch from a DataLoader costs
#: ~50 us of Python, which on a tiny model's sub-millisecond step is a "share" nobody can remove.
LOADER_MIN_WAIT_S = 1e-3
#: Input wait above this share of the step makes the run input-bound: removing it gains more
#: than a compute technique of similar effort (1.25x and up).
INPUT_BOUND_SHARE = 0.2
#: A dataset above this share of RAM is "huge": workers' copies or growth would not fit.
MEMMAP_RAM_SHARE = 0.25
#: Peak memory above this share of the device's capacity counts as memory pressure.
MEMORY_PRESSURE = 0.8
#: Padding above this share (random batches minus sorted ones) is worth bucketing away.
PADDING_GAP = 0.05
#: Communication above this share of the step is worth compressing or overlapping better.
COMM_SHARE = 0.2


@dataclass(frozen=True)
class Findings:
    """Everything the judgments read."""

    recipe: Recipe
    config: TurboConfig
    device: torch.device
    model: ModelFacts
    loader: LoaderFacts
    dataset: DatasetFacts
    profile: ProfileResult
    #: Tensors whose non-batch dims varied across the batches drawn (data_facts.varying_shapes).
    varying: list[str]
    #: Variants against their reference ("bf16" and "channels_last" against the config,
    #: "bf16+channels_last" against "bf16"), as the tuner judges them; None if not run.
    speedups: dict[str, Gain] | None
    #: The measured precision variant's name ("bf16" or "fp16"), or why there is none.
    precision_variant: str | None
    precision_reason: str
    #: Why the variants were not measured, when their trials failed.
    comparison_error: str | None
    fold: Gain | None
    #: Padding share of random and of length-sorted batches, when the recipe has lengths.
    padding: tuple[float, float] | None
    #: Bytes of the linear LM head's float32 logits in one forward (``Facts.logits_bytes``);
    #: None for a model without one.
    logits_bytes: int | None = None

    @property
    def step_seconds(self) -> float:
        return sum(self.profile.breakdown.values())

    @property
    def input_share(self) -> float:
        step = self.step_seconds
        return self.profile.breakdown["input_wait"] / step if step else 0.0

    @property
    def loader_matters(self) -> bool:
        """Input wait large enough, relatively and absolutely, to be worth fixing."""
        wait = self.profile.breakdown["input_wait"]
        return self.input_share >= LOADER_SHARE and wait >= LOADER_MIN_WAIT_S

    @property
    def bound(self) -> Bound:
        if self.input_share >= INPUT_BOUND_SHARE:
            return "input-bound"
        return (
            "launch-bound"
            if regime(self.profile.device_busy) == "launch-bound"
            else ("compute-bound")
        )

    @property
    def memory_capacity(self) -> int:
        return memory_capacity(self.device)

    @property
    def memory_share(self) -> float:
        return self.profile.peak.peak_bytes / self.memory_capacity
