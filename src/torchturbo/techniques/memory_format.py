"""channels_last (NHWC) memory format for convolutional models.

oneDNN on CPU and cuDNN on TensorCores run convolutions fastest in NHWC, and avoid layout
conversions when both weights and inputs use it. Models without 4-D convolutions gain nothing,
so they are left alone and the reason is returned for the report.
"""

from __future__ import annotations

import torch
from torch import nn

from torchturbo.base.nhwc import has_2d_convolutions
from torchturbo.config import TurboConfig
from torchturbo.techniques.framework.facts import Facts
from torchturbo.techniques.framework.levers import Expectation
from torchturbo.techniques.framework.proposal import Candidate, StageContext, candidate
from torchturbo.techniques.framework.result import TechniqueResult, applied, not_applied
from torchturbo.techniques.framework.spec import Lever, Stage, Technique


def apply_channels_last(model: nn.Module) -> TechniqueResult:
    """Convert the model's 4-D parameters and buffers to channels_last in place.

    Not applied (with the reason) when the model has no 2-D convolutions.
    """
    if not has_2d_convolutions(model):
        return not_applied(
            "channels_last",
            "no Conv2d/ConvTranspose2d in the model: channels_last only changes 4-D tensors",
        )
    # Module.to takes memory_format (see its docstring); torch's type stubs omit it.
    model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    return applied("channels_last")


def memory_format_stage(ctx: StageContext) -> list[Candidate] | str:
    expectation = channels_last_gain(ctx.facts)
    layout = ctx.best.replace(memory_format__channels_last=True)
    candidates = [candidate("channels_last", layout, expectation)]
    if ctx.device.type == "cuda" and expectation.applicable:
        # cuDNN autotuning re-runs for every new input shape: only where shapes are fixed.
        tuned = layout.replace(backend__cudnn_benchmark=True)
        if ctx.facts.shapes_vary:
            why = "batch shapes vary: cuDNN would autotune again for every new shape"
            candidates.append(Candidate("channels_last+cudnn_benchmark", tuned, not_applicable=why))
        else:
            candidates.append(
                Candidate(
                    "channels_last+cudnn_benchmark",
                    tuned,
                    expectation.gain,
                    evidence=expectation.evidence,
                )
            )
    return candidates


def _transform(model: nn.Module, config: TurboConfig, device: torch.device) -> TechniqueResult:
    return apply_channels_last(model)


#: channels_last gains up to this fraction on a model whose FLOPs are all in 2-D convolutions.
CHANNELS_LAST_GAIN = 0.25


def channels_last_gain(facts: Facts) -> Expectation:
    if not facts.has_convolutions:
        return Expectation(None, "the model has no 2-D convolutions: channels_last changes nothing")
    gain = 1 + CHANNELS_LAST_GAIN * facts.conv_share
    return Expectation(gain, f"{facts.conv_share:.0%} of the forward FLOPs are 2-D convolutions")


TECHNIQUE = Technique(
    name="channels_last",
    section="memory_format",
    doc="docs/techniques/channels_last.md",
    requested=lambda config: config.memory_format.channels_last,
    transform=_transform,
    order=20,
    order_reason=(
        "layout before compile, so that the compiled graph is traced with NHWC strides; "
        "weights only: a convolution with NHWC weights returns NHWC, so the layout reaches the "
        "rest of the network from the first convolution on"
    ),
    channels_last_inputs=True,
    stage=Stage("memory_format", 30, memory_format_stage),
    levers=(Lever("channels_last", channels_last_gain),),
)
