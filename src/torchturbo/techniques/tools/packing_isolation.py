"""Whether a model keeps packed documents apart: checked, never assumed, before packing is used.

:func:`check_isolation` runs a packed row of documents and the same documents one at a time
(unpacked, no padding, the model's own positions) through the model and compares the per-token
outputs, and the parameters' gradients of a fixed random projection of them summed over all
tokens (so every token's output reaches the gradients). A model that isolates documents gives the
same figures up to float32 rounding; one that leaks attention across documents, ignores
``position_ids`` (absolute positions counted along the whole row), or numbers its own positions
from elsewhere (RoBERTa's ``padding_idx + 1``) does not, and is refused with the reason.

The model is called as packed batches call it: ``input_ids`` [1, T] and ``position_ids``, plus
``document_ids`` and ``cu_seqlens`` when its forward names them (``data.packing``). It runs in
eval mode (dropout would differ between the two runs) and gradients are taken with
``torch.autograd.grad``, so neither its mode nor its ``.grad`` change.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchturbo.base.device import model_device, to_device
from torchturbo.data.packing import packed_collate, takes_boundaries

__all__ = ["TOLERANCE", "Isolation", "check_isolation", "isolation_documents"]

#: Largest relative difference allowed, on outputs (by the reference's largest magnitude) and on
#: each parameter's gradient (by its norm). float32 matmuls over rows of other lengths sum in
#: another order (about 1e-7 relative, measured on Llama and GPT-2); a leak moves them by 1e-2.
TOLERANCE = 1e-4


@dataclass(frozen=True)
class Isolation:
    """The verdict: ``ok``, and ``reason`` (why refused, or what was compared)."""

    ok: bool
    reason: str
    output_difference: float | None = None
    gradient_difference: float | None = None


def check_isolation(
    model: nn.Module,
    documents: Sequence[torch.Tensor],
    *,
    tolerance: float = TOLERANCE,
    position_ids_start: int = 0,
) -> Isolation:
    """Packed against unpacked on ``documents`` (1-D token id tensors, two or more)."""
    if len(documents) < 2:
        raise ValueError(f"check_isolation needs two or more documents, got {len(documents)}")
    parameters = inspect.signature(model.forward).parameters
    if "position_ids" not in parameters:
        return Isolation(
            False,
            f"{type(model).__name__}.forward takes no position_ids: the positions of a packed "
            "document would continue from the previous one",
        )
    training = model.training
    model.eval()
    try:
        return _compare(model, list(documents), tolerance, position_ids_start)
    finally:
        model.train(training)


def isolation_documents(samples: Sequence[Any], count: int = 3, longest: int = 32) -> list[Any]:
    """Up to ``count`` documents of two or more tokens from dict samples' ``input_ids``, cut to
    ``longest`` tokens (short keeps the check to a few milliseconds)."""
    documents = []
    for sample in samples:
        ids = sample.get("input_ids") if isinstance(sample, dict) else None
        if ids is None:
            continue
        ids = torch.as_tensor(ids)[:longest]
        if ids.dim() == 1 and ids.numel() >= 2:
            documents.append(ids)
        if len(documents) == count:
            break
    return documents


def _compare(model: nn.Module, documents: list[torch.Tensor], tol: float, start: int) -> Isolation:
    documents = [d.long() for d in documents]
    boundaries = takes_boundaries(model)
    differences = _differences(model, documents, boundaries, start)
    if differences is None:
        return Isolation(False, "the model's output is not one row per token")
    output_difference, gradient_difference = differences
    if output_difference <= tol and gradient_difference <= tol:
        return Isolation(
            True,
            f"{len(documents)} documents packed and alone agree within {tol:g} (outputs "
            f"{output_difference:.1e}, gradients {gradient_difference:.1e})",
            output_difference,
            gradient_difference,
        )
    reason = _diagnose(model, documents, boundaries, start, tol)
    return Isolation(
        False,
        f"{reason} (packed and alone differ by {output_difference:.2g} in the outputs, "
        f"{gradient_difference:.2g} in the gradients, tolerance {tol:g})",
        output_difference,
        gradient_difference,
    )


def _differences(
    model: nn.Module, documents: list[torch.Tensor], boundaries: bool, start: int
) -> tuple[float, float] | None:
    """Relative differences of the outputs and of the gradients, packed against alone."""
    params = [p for p in model.parameters() if p.requires_grad]
    generator = torch.Generator().manual_seed(0)
    alone = [_call(model, [d], boundaries, start) for d in documents]
    weights = [to_device(torch.randn(o.shape, generator=generator), o.device) for o in alone]
    packed = _call(model, documents, boundaries, start)
    if packed.shape[0] != sum(o.shape[0] for o in alone):
        return None
    reference = torch.cat(alone)
    output_difference = _relative(packed, reference)
    summed = torch.stack([(o * w).sum() for o, w in zip(alone, weights, strict=True)]).sum()
    unpacked = _gradients(summed, params)
    together = _gradients((packed * torch.cat(weights)).sum(), params)
    gradient_difference = max(
        (
            float((a - b).norm() / b.norm().clamp(min=1e-12))
            for a, b in zip(together, unpacked, strict=True)
        ),
        default=0.0,
    )
    return output_difference, gradient_difference


def _diagnose(
    model: nn.Module, documents: list[torch.Tensor], boundaries: bool, start: int, tol: float
) -> str:
    """Which of the known causes makes packed and unpacked differ."""
    with torch.no_grad():
        first = max(documents, key=len)
        own = _call(model, [first], boundaries, None)
        given = _call(model, [first], boundaries, start)
        if not _close(own, given, tol):
            hint = _start_hint(model, first, boundaries, own, tol)
            return (
                f"the model numbers its own positions from elsewhere than {start} (as RoBERTa "
                f"does from padding_idx + 1): packed position_ids from {start} shift its "
                f"position embeddings{hint}"
            )
        # Positions with a gap halfway: a model that reads position_ids sees another sequence
        # (a shift of all of them would not do: rotary embeddings only see differences).
        if _close(given, _call(model, [first], boundaries, start, gap=7), tol):
            return (
                "the model ignores position_ids: a packed document's positions continue from the "
                "previous one (absolute positions counted along the row)"
            )
        if _passes_without_cache(model, documents, boundaries, start, tol):
            return (
                "attention leaks across documents with config.use_cache = True: transformers "
                "then makes a cache and skips its packed-sequence mask; set "
                "model.config.use_cache = False (the Trainer does: TrainingArguments' use_cache "
                "defaults to False)"
            )
    return (
        "attention leaks across documents: the model builds no per-document mask from "
        "position_ids" + (" or document_ids" if boundaries else "")
    )


def _passes_without_cache(
    model: nn.Module, documents: list[torch.Tensor], boundaries: bool, start: int, tol: float
) -> bool:
    """Whether a Hugging Face model with ``config.use_cache = True`` isolates without it."""
    config: Any = getattr(model, "config", None)
    if not getattr(config, "use_cache", False):
        return False
    config.use_cache = False
    try:
        with torch.enable_grad():
            differences = _differences(model, documents, boundaries, start)
    finally:
        config.use_cache = True
    return differences is not None and max(differences) <= tol


def _start_hint(
    model: nn.Module, first: torch.Tensor, boundaries: bool, own: torch.Tensor, tol: float
) -> str:
    pad = getattr(getattr(model, "config", None), "pad_token_id", None)
    if isinstance(pad, int) and _close(own, _call(model, [first], boundaries, pad + 1), tol):
        return f"; its own positions start at {pad + 1} (position_ids_start={pad + 1})"
    return ""


def _call(
    model: nn.Module,
    documents: list[torch.Tensor],
    boundaries: bool,
    start: int | None,
    gap: int = 0,
) -> torch.Tensor:
    """The per-token output [T, ...] of one row; ``start`` None: the model's own positions;
    ``gap`` is added to the positions of the row's second half."""
    batch = packed_collate(
        [{"input_ids": d} for d in documents],
        boundaries=boundaries,
        position_ids_start=start or 0,
    )
    batch = to_device(batch, model_device(model))
    parameters = inspect.signature(model.forward).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    kwargs = {k: v for k, v in batch.items() if k != "labels" and (takes_any or k in parameters)}
    if start is None:
        del kwargs["position_ids"]
    elif gap:
        positions = kwargs["position_ids"]
        second_half = (
            torch.arange(positions.shape[1], device=positions.device) >= positions.shape[1] // 2
        )
        kwargs["position_ids"] = positions + gap * second_half
    output = model(**kwargs)
    for name in ("logits", "last_hidden_state"):
        if hasattr(output, name):
            output = getattr(output, name)
            break
    if isinstance(output, (tuple, list)):
        output = output[0]
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"the model returned {type(output).__name__}, not a tensor or logits")
    return output[0].float()


def _gradients(loss: torch.Tensor, params: list[nn.Parameter]) -> list[torch.Tensor]:
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params, strict=True)]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference, relative to the reference ``b``'s largest magnitude."""
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-6))


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    return a.shape == b.shape and _relative(a, b) <= tol
