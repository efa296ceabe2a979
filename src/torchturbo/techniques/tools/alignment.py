"""TensorCore alignment: find dimensions that are not multiples of 8 (64 for vocabularies), and
pad classifier heads and embeddings so that results are unchanged.

GPU matmuls run on TensorCores fastest when M, N and K are multiples of 8 (fp16/bf16; 16 bytes),
and large vocabularies gain from multiples of 64 (nanoGPT pads 50257 to 50304). On CPU, oneDNN/MKL
tile by the vector width, so the effect is smaller or absent: docs/techniques/alignment.md has
the figures. The article "aligns" by truncating input columns, which silently drops data; here we
pad instead:

* :func:`pad_linear_classifier` adds zero output rows and hides the padded logits, either by
  slicing them off (same output shape) or by masking them with -inf (aligned output shape; softmax
  and cross-entropy give padded classes probability 0). Real logits, the loss and the gradients of
  the real parameters are unchanged, and the padded rows get zero gradient, so they stay zero.
* :func:`pad_embedding` adds zero rows that no valid id reaches: lookups are bit-identical.

Widths of hidden layers are not padded after the fact (that changes the next layer's input and
the maths); choose aligned widths when designing the model, as the audit suggests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from torchturbo.base.nested import named_tensors

_CONV_TYPES = (
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
)


@dataclass(frozen=True)
class Finding:
    """One dimension off the alignment: where, which, its value, and the next aligned value."""

    where: str  # module path ("" for the root) or "batch[i]" for an input tensor
    what: str  # e.g. "Linear.out_features", "batch size", "sequence length"
    value: int
    multiple: int

    @property
    def aligned(self) -> int:
        return round_up(self.value, self.multiple)

    def __str__(self) -> str:
        where = self.where or "<model>"
        return (
            f"{where}: {self.what}={self.value} is not a multiple of {self.multiple}"
            f" (-> {self.aligned})"
        )


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``value``."""
    _check_multiple("multiple", multiple)
    return -(-value // multiple) * multiple


def _check_multiple(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} is invalid: expected an int >= 1")


def _module_dims(
    module: nn.Module, multiple: int, vocab_multiple: int
) -> list[tuple[str, int, int]]:
    kind = type(module).__name__
    if isinstance(module, nn.Linear):
        return [
            (f"{kind}.in_features", module.in_features, multiple),
            (f"{kind}.out_features", module.out_features, multiple),
        ]
    if isinstance(module, _CONV_TYPES):
        return [
            (f"{kind}.in_channels", module.in_channels, multiple),
            (f"{kind}.out_channels", module.out_channels, multiple),
        ]
    if isinstance(module, nn.Embedding):
        return [
            (f"{kind}.num_embeddings", module.num_embeddings, vocab_multiple),
            (f"{kind}.embedding_dim", module.embedding_dim, multiple),
        ]
    return []


def _batch_dims(tensor: torch.Tensor) -> list[tuple[str, int]]:
    dims = [("batch size", tensor.shape[0])] if tensor.dim() >= 1 else []
    # Token ids (B, T) and activations (B, T, D) carry a sequence length in dim 1; images and
    # masks of other ranks do not, so only these two layouts are read.
    is_tokens = tensor.dim() == 2 and not tensor.is_floating_point()
    is_sequence = tensor.dim() == 3 and tensor.is_floating_point()
    if is_tokens or is_sequence:
        dims.append(("sequence length", tensor.shape[1]))
    return dims


def audit_alignment(
    model: nn.Module,
    example_batch: object = None,
    *,
    multiple: int = 8,
    vocab_multiple: int = 64,
) -> list[Finding]:
    """Every Linear/Conv/Embedding dimension, and batch/sequence size, that is off the alignment.

    ``example_batch`` may be a tensor or a (nested) tuple/list/dict of tensors; dim 0 is read as
    the batch size, dim 1 of integer (B, T) and float (B, T, D) tensors as the sequence length.
    """
    _check_multiple("multiple", multiple)
    _check_multiple("vocab_multiple", vocab_multiple)
    findings = [
        Finding(name, what, value, m)
        for name, module in model.named_modules()
        for what, value, m in _module_dims(module, multiple, vocab_multiple)
        if value % m
    ]
    # Inputs, masks and targets of one batch share its batch size: report each size once, at
    # the first tensor that carries it.
    seen: set[tuple[str, int]] = set()
    for name, tensor in named_tensors(example_batch):
        for what, value in _batch_dims(tensor):
            if value % multiple and (what, value) not in seen:
                seen.add((what, value))
                findings.append(Finding(name, what, value, multiple))
    return findings


class PaddedClassifier(nn.Module):
    """A Linear head whose out_features were padded with zero rows; padded logits hidden.

    ``output="slice"`` returns the real ``num_classes`` logits; ``output="masked"`` returns all
    ``padded`` logits with the padded ones at -inf (probability 0 under softmax).
    """

    pad_mask: torch.Tensor

    def __init__(self, linear: nn.Linear, padded: int, output: Literal["slice", "masked"]):
        super().__init__()
        self.num_classes = linear.out_features
        self.output = output
        weight = linear.weight.detach()
        extra = padded - self.num_classes
        self.weight = nn.Parameter(torch.cat([weight, weight.new_zeros(extra, weight.shape[1])]))
        if linear.bias is None:
            self.register_parameter("bias", None)
        else:
            bias = linear.bias.detach()
            self.bias = nn.Parameter(torch.cat([bias, bias.new_zeros(extra)]))
        pad_mask = torch.arange(padded, device=weight.device) >= self.num_classes
        self.register_buffer("pad_mask", pad_mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.weight, self.bias)
        if self.output == "slice":
            return logits[..., : self.num_classes]
        return logits.masked_fill(self.pad_mask, float("-inf"))


def pad_linear_classifier(
    linear: nn.Linear, multiple: int = 8, *, output: Literal["slice", "masked"] = "slice"
) -> PaddedClassifier:
    """Copy ``linear`` with out_features padded up to ``multiple`` (zero weights and bias).

    Use on the final classifier only: a hidden layer's padded outputs would feed the next layer.
    """
    if not isinstance(linear, nn.Linear):
        raise ValueError(
            f"pad_linear_classifier(linear={type(linear).__name__}): expected nn.Linear"
        )
    if output not in ("slice", "masked"):
        raise ValueError(f"pad_linear_classifier(output={output!r}): expected 'slice' or 'masked'")
    return PaddedClassifier(linear, round_up(linear.out_features, multiple), output)


def pad_embedding(embedding: nn.Embedding, multiple: int = 64) -> nn.Embedding:
    """Copy ``embedding`` with num_embeddings padded up to ``multiple`` with zero rows.

    Valid ids (< the original num_embeddings) look up exactly the same rows. If the embedding is
    tied to an output head, pad the head with :func:`pad_linear_classifier` (masked) as well.
    """
    if not isinstance(embedding, nn.Embedding):
        raise ValueError(
            f"pad_embedding(embedding={type(embedding).__name__}): expected nn.Embedding"
        )
    weight = embedding.weight.detach()
    extra = round_up(embedding.num_embeddings, multiple) - embedding.num_embeddings
    padded = torch.cat([weight, weight.new_zeros(extra, weight.shape[1])])
    return nn.Embedding.from_pretrained(
        padded,
        freeze=not embedding.weight.requires_grad,
        padding_idx=embedding.padding_idx,
        max_norm=embedding.max_norm,
        norm_type=embedding.norm_type,
        scale_grad_by_freq=embedding.scale_grad_by_freq,
        sparse=embedding.sparse,
    )
