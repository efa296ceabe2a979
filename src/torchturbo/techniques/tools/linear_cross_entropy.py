"""A language model head and its cross-entropy, computed in chunks of tokens.

``cross_entropy(hidden @ weight.T + bias, labels)`` holds the ``[tokens x vocab]`` logits in
float32, and autograd keeps them (and their softmax) for the backward: at a 128k vocabulary,
8k tokens take 4 GiB per copy. Here the tokens go through the head a chunk at a time; each
chunk's logits give its loss and, at once, its gradients with respect to the hidden states, the
weight and the bias (``softmax - one_hot``), which are accumulated. Only one chunk's logits
exist at a time; what is kept for the backward is the gradients themselves (the size of the
hidden states, the weight and the bias), which the backward scales by the loss's gradient.

Gradients in the forward (as Liger-Kernel's fused linear cross-entropy does) rather than
recomputing each chunk's logits in the backward: the recompute runs the head's largest matrix
product a second time (four products of ``tokens x hidden x vocab`` instead of three, about a
third more work in the head), and the gradients kept instead cost no more than the weight's
own ``.grad``. Computed in the forward, they also see the forward's autocast, so a bf16 head
rounds as the plain head's autocast forward does. The cost: a forward whose loss is never
backpropagated did the gradients' work for nothing, so without grad mode only the loss is
computed.

Hand-written because the maintained implementations are CUDA kernels (Liger-Kernel's is
Triton) or live inside a trainer (torchtune, Unsloth); this one is plain PyTorch on any device.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from torchturbo.config.sections import CHUNK_TOKENS

#: The label that contributes nothing, as in ``torch.nn.functional.cross_entropy``.
IGNORE_INDEX = -100


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    chunk_tokens: int = CHUNK_TOKENS,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "mean",
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias).float(), labels)`` without the logits.

    ``hidden`` is ``[..., hidden]`` and ``labels`` the matching ``[...]`` class indices;
    labels equal to ``ignore_index`` count for nothing. ``reduction`` is "mean" (over the
    labels not ignored, NaN when there are none, as torch's) or "sum". The logits are computed
    in float32 (in the autocast dtype first, under autocast), ``chunk_tokens`` tokens at a time.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"linear_cross_entropy(reduction={reduction!r}): expected 'mean' or 'sum'")
    if chunk_tokens < 1:
        raise ValueError(f"linear_cross_entropy(chunk_tokens={chunk_tokens}): expected >= 1")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"linear_cross_entropy: hidden {tuple(hidden.shape)} and labels "
            f"{tuple(labels.shape)} do not match (labels must be {tuple(hidden.shape[:-1])})"
        )
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_labels = labels.reshape(-1)
    _check_labels(flat_labels, weight.shape[0], ignore_index)
    wants_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias)
    )
    if wants_grad:
        total = _ChunkedLinearCrossEntropy.apply(
            flat_hidden, weight, bias, flat_labels, chunk_tokens, ignore_index
        )
    else:
        total = _loss_only(flat_hidden, weight, bias, flat_labels, chunk_tokens, ignore_index)
    if reduction == "sum":
        return total
    return total / (flat_labels != ignore_index).sum()


def _check_labels(labels: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Refuse a label outside the vocabulary, as ``cross_entropy`` does (one sync per call;
    skipped while torch.compile traces, where reading a value would break the graph)."""
    if torch.compiler.is_compiling():
        return
    kept = labels[labels != ignore_index]
    if kept.numel() and (int(kept.min()) < 0 or int(kept.max()) >= vocab):
        bad = int(kept.min()) if int(kept.min()) < 0 else int(kept.max())
        raise IndexError(
            f"linear_cross_entropy: label {bad} is outside the vocabulary [0, {vocab}) "
            f"(and is not ignore_index={ignore_index})"
        )


def _chunk_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """One chunk's float32 logits (the product runs in the autocast dtype under autocast)."""
    return F.linear(hidden, weight, bias).float()


def _token_losses(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token losses (0 where ignored), the log-sum-exp per token and the kept mask."""
    kept = labels != ignore_index
    targets = torch.where(kept, labels, 0)
    lse = torch.logsumexp(logits, dim=-1)
    target_logits = logits.gather(1, targets.unsqueeze(1)).squeeze(1)
    return torch.where(kept, lse - target_logits, 0.0), lse, kept


def _loss_only(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    chunk_tokens: int,
    ignore_index: int,
) -> torch.Tensor:
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk_tokens):
        stop = start + chunk_tokens
        logits = _chunk_logits(hidden[start:stop], weight, bias)
        total = total + _token_losses(logits, labels[start:stop], ignore_index)[0].sum()
    return total


def _accumulate_product(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``total += a @ b``, in place where the dtypes allow (no ``[vocab x hidden]`` temporary);
    under autocast the product runs in its dtype and is added to the float32 total."""
    if a.dtype == b.dtype == total.dtype and not torch.is_autocast_enabled(total.device.type):
        total.addmm_(a, b)
    else:
        total += a @ b


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """The summed loss over the kept tokens; its gradients are computed in the forward."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        chunk_tokens: int,
        ignore_index: int,
    ) -> torch.Tensor:
        grad_hidden = torch.empty_like(hidden) if hidden.requires_grad else None
        # float32 accumulators: a bf16 sum over many chunks would lose the small ones.
        grad_weight = (
            torch.zeros_like(weight, dtype=torch.float32) if weight.requires_grad else None
        )
        grad_bias = (
            torch.zeros_like(bias, dtype=torch.float32)
            if bias is not None and bias.requires_grad
            else None
        )
        total = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, hidden.shape[0], chunk_tokens):
            stop = start + chunk_tokens
            chunk = hidden[start:stop]
            logits = _chunk_logits(chunk, weight, bias)
            chunk_labels = labels[start:stop]
            kept = chunk_labels != ignore_index
            targets = torch.where(kept, chunk_labels, 0)
            target_logits = logits.gather(1, targets.unsqueeze(1)).squeeze(1)
            # The softmax in the logits' own buffer, one exp per element, no temporary: a
            # chunk holds one [chunk x vocab] matrix at a time.
            peak = logits.amax(dim=1, keepdim=True)
            sums = logits.sub_(peak).exp_().sum(dim=1)
            lse = peak.squeeze(1) + sums.log()
            total += torch.where(kept, lse - target_logits, 0.0).sum()
            # d(loss)/d(logits) = softmax - one_hot(label), zero on ignored tokens.
            grad_logits = logits.div_(sums.unsqueeze(1))
            rows = kept.nonzero().squeeze(1)
            grad_logits[rows, chunk_labels[rows]] -= 1.0
            grad_logits.index_fill_(0, (~kept).nonzero().squeeze(1), 0.0)
            compute = grad_logits.to(chunk.dtype)
            if grad_hidden is not None:
                grad_hidden[start:stop] = compute @ weight
            if grad_weight is not None:
                _accumulate_product(grad_weight, compute.t(), chunk)
            if grad_bias is not None:
                grad_bias += grad_logits.sum(0)
        ctx.has = (grad_hidden is not None, grad_weight is not None, grad_bias is not None)
        ctx.hidden_dtype = hidden.dtype
        ctx.weight_dtype = weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        # Saved (not kept as attributes) so that memory counters see what the backward holds.
        ctx.save_for_backward(*(g for g in (grad_hidden, grad_weight, grad_bias) if g is not None))
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved = iter(ctx.saved_tensors)
        has_hidden, has_weight, has_bias = ctx.has
        grad_hidden = (next(saved) * grad_total).to(ctx.hidden_dtype) if has_hidden else None
        grad_weight = (next(saved) * grad_total).to(ctx.weight_dtype) if has_weight else None
        grad_bias = (next(saved) * grad_total).to(ctx.bias_dtype) if has_bias else None
        return grad_hidden, grad_weight, grad_bias, None, None, None
