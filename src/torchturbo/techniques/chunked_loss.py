"""Chunked loss: a causal language model's loss without its ``[tokens x vocab]`` logits.

A Hugging Face causal LM computes ``lm_head(hidden)`` for every token and then the
cross-entropy of those float32 logits: at a 128k vocabulary they dominate training memory.
:func:`apply_chunked_loss` replaces the model's ``forward`` on the instance (that of each
outermost causal LM a wrapper such as a LightningModule holds; parameters and ``state_dict``
keys are unchanged) so that, when labels are passed with gradients enabled, it
runs the model's body, shifts the labels as ``transformers``' ``ForCausalLMLoss`` does and
computes the loss with ``linear_cross_entropy`` (``techniques/tools/linear_cross_entropy.py``)
on the output embeddings' weight (tied or not) and bias; the output then carries the loss and
no logits. Without labels, or without gradients (generation, evaluation), the model runs as
before.

A model whose forward does more between its body and the loss (logit soft-capping, scaling,
an auxiliary loss) would be trained on another loss, so the patch is checked when applied: a
few tokens through both paths must give the same loss, or the model is left as it was, with
the reason. In plain PyTorch, call ``linear_cross_entropy`` in the loss function instead.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from torchturbo.base.device import to_device
from torchturbo.base.language_models import language_models, output_embedding
from torchturbo.config import TurboConfig
from torchturbo.config.sections import CHUNK_TOKENS
from torchturbo.techniques.framework import levers
from torchturbo.techniques.framework.facts import Facts
from torchturbo.techniques.framework.proposal import (
    Candidate,
    StageContext,
    candidate,
    memory_not_needed,
)
from torchturbo.techniques.framework.result import TechniqueResult, applied, not_applied
from torchturbo.techniques.framework.spec import Lever, Stage, Technique
from torchturbo.techniques.tools.linear_cross_entropy import (
    IGNORE_INDEX,
    linear_cross_entropy,
)

#: Set on a model whose forward computes its loss in chunks.
CHUNKED_MARK = "_torchturbo_chunked_loss"
#: Set False on such a model to have its forward compute the loss as its own again
#: (``Technique.toggle``); the patch stays, so a wrapper around it (accelerate's autocast) too.
CHUNKED_ON = "_torchturbo_chunked_loss_on"
#: Arguments of a causal LM's forward that its body does not take.
_HEAD_ARGUMENTS = ("labels", "logits_to_keep", "num_items_in_batch", "shift_labels")
#: Relative difference allowed between the chunked and the model's own loss when checking the
#: patch: float32 sums in another order differ by ~1e-6; a soft-capped or scaled head by far more.
_CHECK_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8}
_HALF_CHECK_TOLERANCE = 2e-2
#: Config fields of models whose forward changes the logits after the head (Gemma-2's
#: soft-capping, Cohere's and Granite's scaling): refused outright, since on a freshly
#: initialised model the logits are too small for the check to see soft-capping.
_LOGIT_CHANGES = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def apply_chunked_loss(model: nn.Module, chunk_tokens: int = CHUNK_TOKENS) -> TechniqueResult:
    """Make every outermost causal LM in ``model`` (itself, or one a LightningModule or another
    wrapper holds) compute its training loss in chunks; the result's targets are their names
    ("" for ``model`` itself). See the module docstring."""
    found = language_models(model)
    if not found:
        return not_applied(
            "chunked_loss", "the model has no linear LM head (get_output_embeddings)"
        )
    reasons = {name: _patch(module, chunk_tokens) for name, module in found}
    targets = tuple(name for name, why in reasons.items() if not why)
    if not targets:
        return not_applied("chunked_loss", "; ".join(why for why in reasons.values()))
    return applied("chunked_loss", targets)


def _patch(model: nn.Module, chunk_tokens: int) -> str:
    """Replace the causal LM's forward by the chunked one; why not, or "" when done."""
    if getattr(model, CHUNKED_MARK, False):
        return ""
    head, body, why = _head_and_body(model)
    if why:
        return why
    assert head is not None and body is not None
    original = model.forward
    patched = functools.wraps(original)(
        functools.partial(_chunked_forward, model, original, body, head, chunk_tokens)
    )
    mismatch = _check(model, head, original, patched)
    if mismatch:
        return mismatch
    model.forward = patched
    setattr(model, CHUNKED_MARK, True)
    return ""


def _toggle(model: nn.Module, on: bool) -> bool:
    """The chunked loss of every language model in ``model`` that has the patch, on or (``on``
    False) off: its forward computes the loss as its own does; whether any had it. The patch
    and whatever wraps it stay (accelerate wraps the forward in autocast): a flag the chunked
    forward reads, flipped between steps, so tuning inside the run can measure it on the job's
    steps."""
    patched = [lm for _, lm in language_models(model) if getattr(lm, CHUNKED_MARK, False)]
    for lm in patched:
        setattr(lm, CHUNKED_ON, on)
    return bool(patched)


def _head_and_body(model: nn.Module) -> tuple[nn.Linear | None, nn.Module | None, str]:
    """The model's linear LM head and the body that computes its input, or why there are none."""
    head = output_embedding(model)
    if not isinstance(head, nn.Linear):
        return None, None, "the model has no linear LM head (get_output_embeddings)"
    body = getattr(model, "base_model", model)
    if body is model or not isinstance(body, nn.Module):
        return None, None, "the model has no base model (base_model_prefix) to run under the head"
    config = getattr(model, "config", None)
    changes = [name for name in _LOGIT_CHANGES if getattr(config, name, None) is not None]
    if changes:
        return (
            None,
            None,
            (
                f"its forward changes the logits after the head ({', '.join(changes)}): chunking "
                "the plain head's cross-entropy would train another loss"
            ),
        )
    return head, body, ""


def _chunked_forward(
    model: nn.Module,
    original: Callable[..., Any],
    body: nn.Module,
    head: nn.Linear,
    chunk_tokens: int,
    *args: Any,
    **kwargs: Any,
) -> Any:
    arguments = _named_arguments(original, args, kwargs)
    if (
        not getattr(model, CHUNKED_ON, True)
        or arguments is None
        or arguments.get("labels") is None
        or not torch.is_grad_enabled()
        or arguments.get("logits_to_keep", 0)
    ):
        return original(*args, **kwargs)
    labels = arguments["labels"]
    return_dict = arguments.pop("return_dict", None)
    outputs = body(**_body_arguments(body, arguments))
    loss = causal_lm_loss(
        outputs[0],
        head,
        labels,
        chunk_tokens=chunk_tokens,
        num_items_in_batch=arguments.get("num_items_in_batch"),
        shift_labels=arguments.get("shift_labels"),
    )
    output = _output_type(original)(loss=loss, logits=None, **_carried(outputs, original))
    if return_dict is None:
        return_dict = getattr(getattr(model, "config", None), "return_dict", True)
    return output if return_dict else output.to_tuple()


def _named_arguments(
    forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any] | None:
    """The call's arguments by name, those taken by ``**kwargs`` among them; None when some
    went to ``*args`` and have no name to pass on by."""
    signature = inspect.signature(forward)
    arguments = dict(signature.bind(*args, **kwargs).arguments)
    for name, parameter in signature.parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            arguments |= arguments.pop(name, {})
        elif parameter.kind is inspect.Parameter.VAR_POSITIONAL and arguments.pop(name, ()):
            return None
    return arguments


def _body_arguments(body: nn.Module, arguments: dict[str, Any]) -> dict[str, Any]:
    """The forward's arguments the body takes (all of them when it takes ``**kwargs``)."""
    passed = {k: v for k, v in arguments.items() if k not in _HEAD_ARGUMENTS}
    parameters = inspect.signature(body.forward).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return passed
    return {k: v for k, v in passed.items() if k in parameters}


def causal_lm_loss(
    hidden: torch.Tensor,
    head: nn.Linear,
    labels: torch.Tensor,
    *,
    chunk_tokens: int = CHUNK_TOKENS,
    num_items_in_batch: torch.Tensor | int | None = None,
    shift_labels: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """``transformers``' ``ForCausalLMLoss`` of ``head(hidden)``, in chunks: token ``t``
    predicts label ``t + 1`` (the last predicts nothing) unless ``shift_labels`` are given; the
    mean over labels not ignored, or the sum over ``num_items_in_batch`` when given."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    shift_labels = shift_labels.to(hidden.device)
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = linear_cross_entropy(
        hidden,
        head.weight,
        shift_labels,
        head.bias,
        chunk_tokens=chunk_tokens,
        ignore_index=ignore_index,
        reduction=reduction,
    )
    if num_items_in_batch is None:
        return loss
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def _output_type(original: Callable[..., Any]) -> type[Any]:
    """The output class the model's forward declares (``CausalLMOutputWithPast`` if none)."""
    declared = inspect.signature(original).return_annotation
    if isinstance(declared, type) and dataclasses.is_dataclass(declared):
        return declared
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return CausalLMOutputWithPast


def _carried(outputs: Any, original: Callable[..., Any]) -> dict[str, Any]:
    """The body's outputs that the model's output class has a field for (cache, hidden
    states, attentions), by name."""
    names = {f.name for f in dataclasses.fields(_output_type(original))} - {"loss", "logits"}
    return {name: getattr(outputs, name) for name in names if hasattr(outputs, name)}


def _check(
    model: nn.Module, head: nn.Linear, original: Callable[..., Any], patched: Callable[..., Any]
) -> str:
    """Why the chunked loss differs from the model's own on a few tokens, or ""."""
    ids = torch.randint(head.weight.shape[0], (1, 8), generator=torch.Generator().manual_seed(0))
    ids = to_device(ids, head.weight.device)
    modes = {module: module.training for module in model.modules()}
    model.eval()  # no dropout: both paths must see the same network
    try:
        with torch.enable_grad():
            expected = original(input_ids=ids, labels=ids).loss
            got = patched(input_ids=ids, labels=ids).loss
    except Exception as error:  # any failure means: leave the model as it was, and say why
        return f"the chunked forward failed on the model: {type(error).__name__}: {error}"
    finally:
        for module, training in modes.items():
            module.training = training
    tolerance = _CHECK_TOLERANCE.get(head.weight.dtype, _HALF_CHECK_TOLERANCE)
    difference = float((got - expected).detach().abs() / expected.detach().abs().clamp(min=1e-12))
    if difference > tolerance:
        return (
            f"the model's own loss differs from its head's cross-entropy by {difference:.2g} "
            f"(> {tolerance:g}): its forward changes the logits or the loss (soft-capping, "
            "scaling, an auxiliary loss), so chunking would train another loss"
        )
    return ""


# -- the doctor's lever and the tuner's stage ---------------------------------------------------

#: Logits above this share of what a forward holds for backward make chunking worth measuring
#: for speed as well: the plain head writes, reads and differentiates all of them.
SPEED_SHARE = 0.3
#: The step's speed-up per unit of the logits' share: in benchmarks/chunked_loss.py on the
#: 2-core CPU the head alone (logits ~all of its memory) ran 1.07x (vocab 32k) to 1.16x (128k)
#: faster chunked. A prior that orders the tuner's work, not a promise: the tuner measures.
CHUNKED_LOSS_GAIN = 0.1


def expectation(facts: Facts) -> levers.Expectation:
    """The logits' share of the activations a forward holds, and the gain it may buy."""
    if facts.logits_bytes is None or not facts.activation_bytes:
        return levers.Expectation(
            None, "no [tokens x vocab] logits from a linear LM head seen in a forward"
        )
    share = min(1.0, facts.logits_bytes / facts.activation_bytes)
    evidence = (
        f"the float32 logits take {facts.logits_bytes / 2**20:.0f} MiB, {share:.0%} of the "
        f"{facts.activation_bytes / 2**20:.0f} MiB a forward holds for backward"
    )
    if share < SPEED_SHARE:
        return levers.Expectation(None, f"{evidence}: too small a share to matter")
    return levers.Expectation(1 + CHUNKED_LOSS_GAIN * share, evidence)


def chunked_loss_stage(ctx: StageContext) -> list[Candidate] | str:
    """Over a memory budget: the chunked loss, judged by fitting; under it (or with no budget),
    a speed candidate where the logits are a large share of the activations."""
    if ctx.best.chunked_loss.enabled:
        return "the loss is chunked already"
    expected = expectation(ctx.facts)
    on = ctx.best.replace(chunked_loss__enabled=True)
    over = memory_not_needed(ctx, "chunking the loss", "chunking the loss") is None
    if over and ctx.facts.logits_bytes is not None:
        return [Candidate("chunked_loss", on, expected.gain, evidence=expected.evidence)]
    return [candidate("chunked_loss", on, expected)]


def _transform(model: nn.Module, config: TurboConfig, device: torch.device) -> TechniqueResult:
    return apply_chunked_loss(model, config.chunked_loss.chunk_tokens)


TECHNIQUE = Technique(
    name="chunked_loss",
    section="chunked_loss",
    doc="docs/techniques/chunked_loss.md",
    requested=lambda config: config.chunked_loss.enabled,
    transform=_transform,
    toggle=_toggle,
    order=35,
    order_reason=(
        "chunked loss before compile: compile must trace the patched forward, and after "
        "checkpointing, which wraps the body's blocks, not the model's forward"
    ),
    stage=Stage("chunked_loss", 62, chunked_loss_stage, fits_memory=True, from_facts=True),
    levers=(Lever("chunked loss", expectation),),
)
