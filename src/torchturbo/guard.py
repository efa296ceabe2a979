"""Guards of a training step: non-finite losses and gradients, and batches loss_fn cannot read.

**Non-finite guard.** fp16 overflow is the GradScaler's job: it skips the step and lowers its
scale, and the engine counts the skip. What no scaler fixes is a loss or gradient that *stays*
non-finite (a bad learning rate, a log of zero, corrupt data). The guard folds a non-finite flag
of every micro-batch's loss into one device tensor (no sync per micro-step), adds the gradient
norm when the window closes, and reads it once per optimizer step. Without a scaler it skips a
non-finite step instead of writing NaN into the weights; after ``patience`` non-finite steps in a
row it raises :class:`NonFiniteError` naming the step and the first module whose output went
non-finite. That module is found by re-running the forward of the failing micro-batch with
forward hooks on every module, only once the guard trips: ``torch.autograd.detect_anomaly``
would slow every step and names a backward node, not a module.

**Batch structure.** A dataset that yields a structure ``loss_fn`` does not expect (a tuple where
it indexes a dict, a missing key) fails deep inside the user's code; :func:`call_loss_fn` re-raises
such errors as :class:`BatchError` with the batch's structure spelled out.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

#: Errors that a batch of the wrong structure raises inside loss_fn.
_STRUCTURE_ERRORS = (TypeError, KeyError, IndexError, AttributeError, ValueError)


class BatchError(ValueError):
    """loss_fn could not read a batch; the message shows the batch's structure."""


class NonFiniteError(RuntimeError):
    """The loss or the gradients stayed non-finite; names the step and the first bad module."""


def describe_batch(batch: Any, depth: int = 0) -> str:
    """A one-line picture of a batch: ``{'x': Tensor[8, 3] float32, 'y': Tensor[8] int64}``."""
    if isinstance(batch, torch.Tensor):
        return f"Tensor{list(batch.shape)} {str(batch.dtype).removeprefix('torch.')}"
    if depth > 3:
        return "..."
    if isinstance(batch, Mapping):
        inner = ", ".join(f"{k!r}: {describe_batch(v, depth + 1)}" for k, v in batch.items())
        return "{" + inner + "}"
    if isinstance(batch, (list, tuple)):
        inner = ", ".join(describe_batch(v, depth + 1) for v in batch[:8])
        more = ", ..." if len(batch) > 8 else ""
        return f"{type(batch).__name__}({inner}{more})"
    return type(batch).__name__


def call_loss_fn(loss_fn: Callable[[nn.Module, Any], Any], model: nn.Module, batch: Any) -> Any:
    """``loss_fn(model, batch)``, with structure errors re-raised naming the batch's structure."""
    try:
        return loss_fn(model, batch)
    except _STRUCTURE_ERRORS as err:
        if isinstance(err, BatchError):
            raise
        raise BatchError(
            f"loss_fn failed on a batch of structure {describe_batch(batch)}: "
            f"{type(err).__name__}: {err}. Check that the dataset/collate output matches what "
            "loss_fn reads"
        ) from err


class NonFiniteGuard:
    """Counts consecutive optimizer steps with a non-finite loss or gradient; raises at patience."""

    def __init__(self, patience: int) -> None:
        self.patience = patience
        #: Consecutive non-finite optimizer steps so far.
        self.streak = 0
        self._flag: torch.Tensor | None = None
        self._rerun: Callable[[], Any] | None = None

    def observe(self, loss: torch.Tensor, rerun: Callable[[], Any]) -> None:
        """Fold this micro-batch's loss into the window's flag; keep how to re-run its forward."""
        if self.patience == 0:
            return
        bad = ~torch.isfinite(loss.detach())
        self._flag = bad if self._flag is None else self._flag | bad
        self._rerun = rerun

    def forget_window(self) -> None:
        """Drop the open window's flag (its micro-batches are about to be replayed)."""
        self._flag = None

    def window_nonfinite(
        self, params: Iterable[nn.Parameter], grad_norm: torch.Tensor | None, check_grads: bool
    ) -> bool:
        """Whether the closing window was non-finite (one host read); updates the streak.

        ``check_grads`` is False under a GradScaler, which checks the gradients itself.
        """
        if self.patience == 0:
            return False
        flag, self._flag = self._flag, None
        if check_grads:
            grads = [p.grad for p in params if p.grad is not None]
            if grad_norm is None and grads:
                grad_norm = torch.nn.utils.get_total_norm(grads, error_if_nonfinite=False)
            if grad_norm is not None:
                bad_grad = ~torch.isfinite(grad_norm)
                flag = bad_grad if flag is None else flag | bad_grad.to(flag.device)
        nonfinite = flag is not None and bool(flag)  # the one sync of the guard per step
        self.streak = self.streak + 1 if nonfinite else 0
        return nonfinite

    def raise_if_exhausted(self, model: nn.Module, optimizer_step: int) -> None:
        """Raise :class:`NonFiniteError` once ``patience`` non-finite steps came in a row."""
        if self.patience == 0 or self.streak < self.patience:
            return
        where = self._locate(model)
        raise NonFiniteError(
            f"the loss or gradients were non-finite for {self.streak} consecutive optimizer steps "
            f"(up to optimizer step {optimizer_step}); {where}. Lower the learning rate, check "
            "the data, or use [precision] dtype = 'bf16' for fp16 overflow"
        )

    def _locate(self, model: nn.Module) -> str:
        if self._rerun is None:
            return "no micro-batch was kept to locate it"
        try:
            name = first_nonfinite_module(model, self._rerun)
        except Exception as err:  # the NonFiniteError matters more than why locating failed
            return f"re-running the last micro-batch to locate it failed ({err})"
        if name is None:
            return (
                "re-running the last micro-batch's forward gave finite outputs in every module, "
                "so the non-finite values arose in backward or in an earlier micro-batch"
            )
        return (
            "re-running the last micro-batch's forward, the first module with a non-finite "
            f"output is {name!r}"
        )


def first_nonfinite_module(model: nn.Module, run: Callable[[], Any]) -> str | None:
    """The first module (in execution order) whose forward output holds a NaN or inf.

    Forward hooks fire when a module's forward returns, so a child is seen before its parent:
    the name returned is the innermost module where the values first went bad. ``run`` runs the
    forward, without gradients; the model's parameters and the batch are left as they are.
    """
    found: list[str] = []

    def hook(name: str, _module: nn.Module, _args: Any, output: Any) -> None:
        if not found and _has_nonfinite(output):
            found.append(name or type(model).__name__ + " (the whole model)")

    handles = [
        module.register_forward_hook(functools.partial(hook, name))
        for name, module in model.named_modules()
    ]
    try:
        with torch.no_grad():
            run()
    finally:
        for handle in handles:
            handle.remove()
    return found[0] if found else None


def _has_nonfinite(output: Any) -> bool:
    if isinstance(output, torch.Tensor):
        return output.is_floating_point() and not bool(torch.isfinite(output).all())
    if isinstance(output, Mapping):
        return any(_has_nonfinite(v) for v in output.values())
    if isinstance(output, (list, tuple)):
        return any(_has_nonfinite(v) for v in output)
    return False
