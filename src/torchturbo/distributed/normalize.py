"""Exact loss normalization across ranks: the global mean gradient, whatever each rank counted.

With ``count`` samples or tokens per micro-batch, the target is the global mean gradient
``sum_r S_r / T``, where ``S_r`` is the gradient of rank r's *summed* loss over its window and
``T`` the count over all ranks and micro-steps. The engine's accumulation leaves ``S_r / ref_r``
in each rank's gradients (``ref_r`` = the rank's first count x micro-steps, different on each
rank) and multiplies by ``ref_r / reduce_count(total_r)`` after the reduction. DDP and FSDP
*average* over the W ranks, so without care the result is ``(1/W) sum_r S_r / ref_r``: every rank
weighs the same however many tokens it had, which is the mean of local means, not the global
mean. No factor applied after the reduction can fix that, so:

- before the reduction each rank multiplies its gradients by ``ref_r`` (DDP: in the comm hook, on
  the accumulated bucket; FSDP: on the gradient flowing out of the model's outputs, every
  micro-step), so the reduction averages ``S_r``: ``(1/W) sum_r S_r``;
- :func:`global_count` returns ``T x ref_r / W`` (one all-reduce of the count per window), so the
  engine's factor ``ref_r / reduce_count`` is ``W / T``, giving ``sum_r S_r / T`` on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchturbo.base.nested import map_tensors

#: This rank's count reference ``ref_r`` of the open accumulation window, read when needed.
Reference = Callable[[], torch.Tensor]


def global_count(total: torch.Tensor, *, reference: Reference, world_size: int) -> torch.Tensor:
    """``T x ref_r / W`` from this rank's ``total``: see the module docstring for why."""
    total = total.detach().clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total * reference() / world_size


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the incoming gradient by ``factor()``."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, factor: Reference) -> Any:
        ctx.factor = factor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor().to(grad.dtype), None


def scale_output_gradients(model: nn.Module, factor: Reference) -> None:
    """Scale every gradient that enters ``model`` through its outputs by ``factor()``.

    Backward is linear, so this scales all parameter gradients of the step, before FSDP reduces
    them. Tensors nested in any container :mod:`torchturbo.base.nested` sees into are
    covered; a loss term computed from the parameters directly (not through the outputs) would not
    be scaled.
    """

    def scale(tensor: torch.Tensor) -> torch.Tensor:
        return _ScaleGrad.apply(tensor, factor) if tensor.requires_grad else tensor

    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        return map_tensors(scale, output)

    model.register_forward_hook(hook)
