"""float8 training: the model's nn.Linear layers run their three matmuls in fp8 (torchao).

Hopper and Ada GPUs (compute capability >= 8.9) have fp8 tensor cores at twice the bf16 rate
(H100 SXM: 1979 against 989 dense TFLOP/s). torchao's ``convert_to_float8_training`` swaps each
``nn.Linear`` for a ``Float8Linear`` that casts input, weight and output gradient to fp8 with a
dynamic per-tensor scale (e4m3 forward, e5m2 for gradients) and multiplies with
``torch._scaled_mm``; parameters stay in their dtype and keep their identity, so an optimizer
built before the swap still holds them. Everything else (attention, norms, convolutions) runs in
the configured ``[precision] dtype``, normally bf16. The win needs large matmuls and, in
practice, ``torch.compile`` to fuse the casts; the tuner adopts it only by measured speed and the
same loss-parity rule as bf16 (e4m3 keeps 3 mantissa bits: a Linear's output differs from fp32 by
about 5% per element, against 0.4% for bf16).

torchao is optional (``pip install 'torchturbo[float8]'``) and imported only where float8 can
run, so CPU users never load it.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from torchturbo.config import TurboConfig
from torchturbo.measure.native import emulated
from torchturbo.techniques.framework.facts import Facts
from torchturbo.techniques.framework.levers import Expectation
from torchturbo.techniques.framework.proposal import Candidate, StageContext, candidate
from torchturbo.techniques.framework.result import TechniqueResult, applied, not_applied
from torchturbo.techniques.framework.spec import Lever, Stage, Technique, TrainerArguments

#: torch._scaled_mm needs both dimensions of each fp8 operand divisible by 16.
ALIGNMENT = 16


def float8_unavailable(device: torch.device | str) -> str | None:
    """Why float8 training cannot run on ``device``, or None when it can."""
    reason = emulated(device, "fp8")
    if reason is not None:
        return reason
    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed: pip install 'torchturbo[float8]'"
    return None


def convertible_linears(model: nn.Module) -> list[str]:
    """Names of the nn.Linear layers float8 can convert (both dimensions divisible by 16)."""
    return [name for name, module in model.named_modules() if _convertible(module)]


def apply_float8_training(model: nn.Module, device: torch.device | str) -> TechniqueResult:
    """Convert ``model``'s Linear layers in place for float8 training on ``device``.

    Not applied, with the reason, when nothing was converted (the hardware, torchao missing,
    no Linear of a suitable shape); else ``targets`` names the converted layers. Call it with
    the model already on ``device``.
    """
    targets = tuple(convertible_linears(model))
    reason = float8_unavailable(device) or convert_linears(model)
    return applied("float8", targets) if reason is None else not_applied("float8", reason)


def convert_linears(model: nn.Module) -> str | None:
    """Swap every convertible Linear for torchao's Float8Linear, on any device.

    ``apply_float8_training`` checks the hardware first; this does not, so that the conversion
    and its numerics can be tested where no fp8 unit exists (torch runs ``_scaled_mm`` on CPU,
    slowly). Returns None when layers were converted, else why none was.
    """
    if isinstance(model, nn.Linear):
        return "the model is a bare nn.Linear: torchao cannot swap a root module in place"
    if not convertible_linears(model):
        return f"no nn.Linear has both dimensions divisible by {ALIGNMENT}, as fp8 matmuls need"
    from torchao.float8 import convert_to_float8_training

    convert_to_float8_training(model, module_filter_fn=lambda module, _: _convertible(module))
    return None


def _convertible(module: nn.Module) -> bool:
    return (
        type(module) is nn.Linear
        and module.in_features % ALIGNMENT == 0
        and module.out_features % ALIGNMENT == 0
    )


def float8_stage(ctx: StageContext) -> list[Candidate] | str:
    """On top of the best precision (bf16 where it won): Linear matmuls in fp8, judged by the
    same speed and loss-parity rules as bf16."""
    unavailable = float8_unavailable(ctx.device)
    if unavailable:
        return unavailable
    if not convertible_linears(ctx.recipe.model()):
        return f"no nn.Linear has both dimensions divisible by {ALIGNMENT}, as fp8 matmuls need"
    return [candidate("float8", ctx.best.replace(precision__float8=True), float8_gain(ctx.facts))]


def _transform(model: nn.Module, config: TurboConfig, device: torch.device) -> TechniqueResult:
    return apply_float8_training(model, device)


def float8_lever(facts: Facts) -> Expectation:
    """The doctor's float8 lever: not applicable, with the reason, where fp8 cannot run."""
    unavailable = float8_unavailable(facts.device)
    if unavailable:
        return Expectation(None, f"float8 cannot pay off here: {unavailable}")
    return float8_gain(facts)


def _hf_arguments(config: TurboConfig, arguments: TrainerArguments) -> None:
    arguments.note(
        "precision",
        "float8",
        f"applied by {arguments.callback} (the Trainer has no argument for torchao's float8 "
        "Linears)",
    )


#: float8 Linear layers on top of bf16: fp8 GEMMs run ~2x bf16 on Hopper tensor cores, less end
#: to end (casts, the layers left in bf16); torchao reports 1.2-1.5x on large Transformers.
FLOAT8_GAIN = 1.2


def float8_gain(facts: Facts) -> Expectation:
    """The prior where fp8 units exist (the float8 technique asks that first)."""
    return Expectation(FLOAT8_GAIN, "fp8 matmuls in the Linear layers, on top of bf16")


TECHNIQUE = Technique(
    name="float8",
    section="precision",
    fields=("float8",),
    doc="docs/techniques/float8.md",
    requested=lambda config: config.precision.float8,
    transform=_transform,
    order=10,
    order_reason=(
        "float8 swaps Linear modules (keeping their parameters) before anything wraps or traces "
        "them; the model must already be on its device"
    ),
    stage=Stage("float8", 20, float8_stage),
    levers=(Lever("float8", float8_lever),),
    translations={"transformers": _hf_arguments},
)
