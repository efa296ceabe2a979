"""Liger-Kernel: the Triton kernels LLM trainers enable on GPUs, applied by Liger's own patches.

Liger-Kernel (linkedin/Liger-Kernel) replaces a Hugging Face causal LM's RMSNorm, rotary
embedding and SwiGLU MLP by fused Triton kernels, and its head and cross-entropy by a fused
linear cross-entropy that never holds the logits (its own figures: +20% throughput, -60% memory
on Llama-3-8B). The Trainer exposes it as ``TrainingArguments(use_liger_kernel=True)``, which
calls ``liger_kernel.transformers._apply_liger_kernel_to_instance`` on the model; this technique
calls the same function, the one that dispatches on ``config.model_type`` to Liger's
``apply_liger_kernel_to_<model>`` with the instance, so the engine, the Lightning callback and
the tuner get what the Trainer gets. Liger's patches also replace functions and classes of the
``transformers`` modeling module process-wide (rotary embedding, the MLP class), as under the
Trainer: models of that type built later in the process are Liger's too.

Where it runs: Triton kernels on CUDA (Liger also targets ROCm and XPU; torchturbo runs CUDA),
with the package installed (``pip install 'torchturbo[liger]'``, an extra: it needs triton,
which a CPU machine has no use for). Elsewhere it is not applied and the tuner and the doctor
say why. With ``[chunked_loss]`` on, Liger's fused linear cross-entropy is left off: the chunked
loss computes the head's loss itself.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from torch import nn

from torchturbo.config import TurboConfig
from torchturbo.techniques.framework.facts import Facts
from torchturbo.techniques.framework.levers import Expectation
from torchturbo.techniques.framework.proposal import Candidate, StageContext, candidate
from torchturbo.techniques.framework.result import TechniqueResult, applied, not_applied
from torchturbo.techniques.framework.spec import Lever, Stage, Technique, TrainerArguments

NAME = "liger_kernel"
#: Liger's own figure for Llama-3-8B on GPUs (+20% throughput), the prior the tuner orders by.
LIGER_GAIN = 1.2


def liger_unavailable(device: torch.device | str) -> str | None:
    """Why Liger-Kernel cannot run on ``device``, or None when it can."""
    kind = torch.device(device).type
    if kind != "cuda":
        return f"Liger-Kernel's kernels are Triton kernels for CUDA GPUs; this device is {kind}"
    if not torch.cuda.is_available():
        return f"Liger-Kernel's kernels need CUDA, which this torch ({torch.__version__}) has not"
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel is not installed: pip install 'torchturbo[liger]'"
    return None


def language_model(model: nn.Module) -> tuple[nn.Module, str] | None:
    """The outermost module with a Hugging Face ``config.model_type`` (the model, or the one
    a LightningModule holds), with that type; None without one."""
    for module in model.modules():
        model_type = getattr(getattr(module, "config", None), "model_type", None)
        if isinstance(model_type, str):
            return module, model_type
    return None


def apply_liger_kernel(
    model: nn.Module, device: torch.device | str, *, chunked_loss: bool = False
) -> TechniqueResult:
    """Patch ``model``'s Hugging Face causal LM with Liger-Kernel for its model type (the
    instance in place); not applied, with the reason, where Liger cannot run or has no patch
    for the type. ``chunked_loss`` leaves the head and its loss to the chunked loss."""
    reason = liger_unavailable(device)
    if reason is not None:
        return not_applied(NAME, reason)
    found = language_model(model)
    if found is None:
        return not_applied(NAME, "no Hugging Face model (config.model_type) to patch")
    target, model_type = found
    from liger_kernel.transformers import monkey_patch

    if model_type not in monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN:
        return not_applied(NAME, f"Liger-Kernel has no patch for model type {model_type!r}")
    options: dict[str, Any] = {}
    if chunked_loss:
        options = {"fused_linear_cross_entropy": False, "cross_entropy": False}
    monkey_patch._apply_liger_kernel_to_instance(model=target, **options)
    return applied(NAME, (model_type,))


def _transform(model: nn.Module, config: TurboConfig, device: torch.device) -> TechniqueResult:
    return apply_liger_kernel(model, device, chunked_loss=config.section("chunked_loss").enabled)


def liger_lever(facts: Facts) -> Expectation:
    """The doctor's Liger line: not applicable, with the reason, where it cannot run."""
    reason = liger_unavailable(facts.device)
    if reason is not None:
        return Expectation(None, reason)
    return Expectation(
        LIGER_GAIN,
        "fused RMSNorm, RoPE, SwiGLU and linear cross-entropy kernels (Liger's figure on "
        "Llama-3-8B: +20% throughput)",
    )


def liger_stage(ctx: StageContext) -> list[Candidate] | str:
    """Liger on top of the current best, where it can run and has a patch for the model."""
    reason = liger_unavailable(ctx.device)
    if reason is not None:
        return reason
    if ctx.best.section(NAME).enabled:
        return "Liger-Kernel is on already"
    found = language_model(ctx.recipe.model())
    if found is None:
        return "the model is not a Hugging Face model (no config.model_type)"
    on = ctx.best.replace(liger_kernel__enabled=True)
    return [candidate("liger_kernel", on, liger_lever(ctx.facts))]


def _hf_arguments(config: TurboConfig, arguments: TrainerArguments) -> None:
    if arguments.takes("use_liger_kernel"):
        arguments.kwargs["use_liger_kernel"] = True
    else:
        arguments.note("liger_kernel", "enabled", f"applied by {arguments.callback}")


def _hf_carries(config: TurboConfig) -> str | None:
    return "TrainingArguments(use_liger_kernel=True)"


TECHNIQUE = Technique(
    name=NAME,
    section=NAME,
    doc="docs/techniques/liger_kernel.md",
    requested=lambda config: config.section(NAME).enabled,
    transform=_transform,
    order=5,
    order_reason=(
        "Liger first: it swaps the norm and MLP modules and the causal LM's forward in place, "
        "as the Trainer does before anything else touches the model; float8, checkpointing "
        "and compile then see Liger's modules"
    ),
    carried_by={"transformers": _hf_carries},
    stage=Stage("liger_kernel", 25, liger_stage),
    levers=(Lever("Liger-Kernel", liger_lever),),
    translations={"transformers": _hf_arguments},
)
