"""Gradient accumulation that is exact for micro-batches of different sizes.

The article divides each micro-batch loss by the number of micro-steps. That equals the full-batch
gradient only when every micro-batch has the same number of samples (or tokens): with a 30-sample
and a 2-sample micro-batch, the 2 samples weigh as much as the 30. The full-batch mean is
``sum_i count_i * mean_i / sum_i count_i``, and the total is only known at the end of the window.

So each micro-batch's mean loss is weighted by ``count_i / reference``, where ``reference`` is a
guess of the window total (first count x micro-steps) that keeps gradient magnitudes near their
usual scale (which matters for fp16), and when the window closes the accumulated gradients are
multiplied by ``reference / total``. The result is the full-batch gradient, up to rounding.
Counts stay tensors so that nothing forces a device sync mid-step.

BatchNorm is the exception no weighting fixes: its statistics are per micro-batch.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class AccumulationWindow:
    """Bookkeeping of one accumulation window: micro-steps seen, counts, the weight reference."""

    def __init__(self, micro_steps: int) -> None:
        if micro_steps < 1:
            raise ValueError(f"micro_steps must be >= 1, got {micro_steps}")
        self.micro_steps = micro_steps
        self.seen = 0
        self.total: torch.Tensor | None = None
        self.reference: torch.Tensor | None = None

    def weight(self, count: torch.Tensor) -> torch.Tensor:
        """The factor for this micro-batch's mean loss; records its count."""
        if self.reference is None:
            self.reference = count * self.micro_steps
        self.total = count if self.total is None else self.total + count
        self.seen += 1
        return count / self.reference

    @property
    def closing(self) -> bool:
        """True when the next micro-batch is the last one of the window."""
        return self.seen + 1 >= self.micro_steps

    def correction(self, total: torch.Tensor | None = None) -> torch.Tensor:
        """The factor that turns the accumulated gradients into the window's mean gradient.

        ``total`` overrides the local count (distributed code passes the all-reduced one).
        """
        if self.reference is None or self.total is None:
            raise RuntimeError("the accumulation window is empty: no micro-batch was added")
        return self.reference / (self.total if total is None else total)

    def reset(self) -> None:
        self.seen = 0
        self.total = None
        self.reference = None


def scale_gradients(params: Iterable[torch.nn.Parameter], factor: torch.Tensor) -> None:
    """Multiply every existing gradient by ``factor`` in place (one fused foreach op)."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, factor.to(grads[0].device))


@torch.no_grad()
def scale_and_clip_gradients(
    params: Iterable[torch.nn.Parameter], factor: torch.Tensor, max_norm: float, norm_type: float
) -> torch.Tensor:
    """:func:`scale_gradients`, then ``clip_grad_norm_``, as one pass over the gradients.

    The norm of the scaled gradients is ``factor`` times theirs, so the clip coefficient is
    known before anything is written and both multiplications fold into one: one read and write
    of every gradient per window instead of two. Same coefficient as torch's (``max_norm /
    (norm + 1e-6)``, at most 1, no host sync). Returns the scaled gradients' norm.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norm = torch.nn.utils.get_total_norm(grads, norm_type) * factor.to(grads[0].device)
    clip = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    torch._foreach_mul_(grads, factor.to(grads[0].device) * clip)
    return norm
