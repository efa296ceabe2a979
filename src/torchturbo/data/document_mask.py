"""Attention masks that keep packed documents apart, for plain PyTorch models.

A packed row holds several documents; attention must not cross from one to another. Hugging Face
models build that mask themselves from ``position_ids`` that restart (``masking_utils``); a model
of one's own builds it from the packed batch's ``document_ids`` [B, T]:

- :func:`document_mask`: a boolean ``[B, 1, T, T]`` mask for
  ``torch.nn.functional.scaled_dot_product_attention`` (True = may attend), block-diagonal and
  causal within each block when ``causal``. Dense: it costs ``T x T`` per row, the quadratic cost
  of the whole packed row.
- :func:`flex_document_mask`: the same rule as a ``flex_attention`` ``BlockMask``, which skips the
  blocks that lie outside every document (compile ``flex_attention`` for its speed).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["document_mask", "flex_document_mask"]


def document_mask(document_ids: torch.Tensor, *, causal: bool) -> torch.Tensor:
    """Boolean ``[B, 1, T, T]``: query ``i`` may attend key ``j`` of the same document (and
    ``j <= i`` when ``causal``)."""
    ids = _check(document_ids)
    mask = ids.unsqueeze(2) == ids.unsqueeze(1)
    if causal:
        length = ids.shape[1]
        mask &= torch.ones(length, length, dtype=torch.bool, device=ids.device).tril()
    return mask.unsqueeze(1)


def flex_document_mask(document_ids: torch.Tensor, *, causal: bool) -> Any:
    """A ``flex_attention`` ``BlockMask`` for the documents of ``document_ids`` [B, T]."""
    from torch.nn.attention.flex_attention import create_block_mask

    ids = _check(document_ids)

    def same_document(batch: Any, head: Any, query: Any, key: Any) -> Any:
        keep = ids[batch, query] == ids[batch, key]
        return keep & (query >= key) if causal else keep

    rows, length = ids.shape
    return create_block_mask(same_document, rows, None, length, length, device=ids.device)


def _check(document_ids: torch.Tensor) -> torch.Tensor:
    if document_ids.dim() != 2 or document_ids.is_floating_point():
        raise ValueError(
            "document_ids must be an integer tensor [batch, tokens], got shape "
            f"{tuple(document_ids.shape)} and dtype {document_ids.dtype}"
        )
    return document_ids
