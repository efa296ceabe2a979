"""Guards of a training step: non-finite losses and gradients, and batches loss_fn cannot read.

**Non-finite guard.** fp16 overflow is the GradScaler's job: it skips the step and lowers its
scale, and the engine counts the skip. What no scaler fixes is a loss or gradient that *stays*
non-finite (a bad learning rate, a log of zero, corrupt data). The guard folds a non-finite flag
of every micro-batch's loss into one device tensor (no sync per micro-step), adds the norm of the
gradients *as the optimizer will apply them* (after unscaling and clipping: a clipping
coefficient that is not finite turns finite gradients into NaN) when the window closes, and
reads it once per optimizer step. A non-finite step is skipped instead of writing NaN into the
weights; after ``patience`` non-finite steps in a row it raises :class:`NonFiniteError` naming
the step, the inputs of the last micro-batch when they hold NaN or inf, and the first module
whose output went non-finite. That module is found by re-running the forward of the failing
micro-batch with forward hooks on every module, only once the guard trips:
``torch.autograd.detect_anomaly`` would slow every step and names a backward node, not a module.
The inputs are inspected only then too: a NaN input that reaches no loss harms no weight.
:func:`refuse_nonfinite_state` keeps a checkpoint from ever holding non-finite weights.

**Batch structure.** A dataset that yields a structure ``loss_fn`` does not expect (a tuple where
it indexes a dict, a missing key) fails deep inside the user's code; :func:`call_loss_fn` re-raises
such errors as :class:`BatchError` with the batch's structure spelled out, and refuses what
``loss_fn`` returns when it is not a loss or ``(loss, count)``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

#: Errors that a batch of the wrong structure raises inside loss_fn.
_STRUCTURE_ERRORS = (TypeError, KeyError, IndexError, AttributeError, ValueError)


class BatchError(ValueError):
    """loss_fn could not read a batch; the message shows the batch's structure."""


class LossFnError(ValueError):
    """loss_fn does what torchturbo does for it (backward); the message says what to return."""


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
    """``loss_fn(model, batch)``, with structure errors re-raised naming the batch's structure,
    and an output that is neither a scalar loss tensor nor ``(loss, count)`` refused."""
    try:
        output = loss_fn(model, batch)
    except RuntimeError as err:
        if backward_inside(err):
            raise LossFnError(BACKWARD_INSIDE) from err
        if type(err) is RuntimeError and _SHAPE_ERROR.search(str(err)):
            raise BatchError(_cannot_take(err, batch)) from err
        raise
    except _STRUCTURE_ERRORS as err:
        if isinstance(err, BatchError) or type(err).__module__.startswith("torchturbo"):
            raise
        from torchturbo.recipe import describe_exception

        raise BatchError(
            f"loss_fn failed on a batch of structure {describe_batch(batch)}: "
            f"{describe_exception(err).rstrip(':')}. {_structure_fix(err, batch)}"
        ) from err
    if not _is_loss_output(output):
        raise BatchError(
            "loss_fn must return the batch's mean loss as a scalar float tensor, or (loss, count) "
            "with count a number or one-element tensor of the samples or tokens the mean is "
            f"over; it returned {describe_batch(output)}{_output_fix(output)}"
        )
    return output


#: The one fix for a loss_fn that runs backward itself, as a loop's step does.
BACKWARD_INSIDE = (
    "loss_fn calls backward() itself: return the loss and leave backward, the optimizer step "
    "and zero_grad to torchturbo (it calls backward on what loss_fn returns)"
)
#: What autograd says when backward runs on a graph a previous backward freed, or inside the
#: no_grad block of a forward-only measurement.
_BACKWARD_MESSAGES = (
    "backward through the graph a second time",
    "does not require grad and does not have a grad_fn",
)


#: torch's words for a tensor of the wrong shape, size or layout (not out of memory: that is
#: torch.OutOfMemoryError, or on CPU a RuntimeError about allocating, which the OOM guard reads).
_SHAPE_ERROR = re.compile(
    r"^(?!.*allocat).*(shape|size|channels|dimension|[0-9]D \(|to match target)", re.S
)


def _cannot_take(err: RuntimeError, batch: Any) -> str:
    """The model (or the loss) rejected the batch's shapes: where, what the batch is, the fix."""
    from torchturbo.recipe import describe_exception, user_code_failure

    failure = user_code_failure(err) or f"loss_fn raised {describe_exception(err)}"
    return (
        f"{failure}: the model cannot take a batch of structure {describe_batch(batch)}; make "
        "the dataset (or the collate function) yield what the model's forward expects, or "
        "adapt loss_fn to the batch"
    )


def _structure_fix(err: Exception, batch: Any) -> str:
    """The fix for a batch loss_fn could not read: unpacking it where the model was handed the
    whole list (``model(batch)``), else matching the dataset to what loss_fn reads."""
    kind = type(batch).__name__
    handed_whole = isinstance(batch, (list, tuple)) and re.search(
        rf"\b(got \({kind}|not {kind}|{kind} of \[)", str(err)
    )
    if handed_whole:
        return (
            f"A tensor was expected where loss_fn passed the whole batch (a {kind}): unpack it, "
            "e.g. inputs, targets = batch; return F.cross_entropy(model(inputs), targets)"
        )
    return "Check that the dataset/collate output matches what loss_fn reads"


def backward_inside(err: BaseException) -> bool:
    """Whether ``err`` is autograd refusing a backward that loss_fn ran itself."""
    return isinstance(err, RuntimeError) and any(m in str(err) for m in _BACKWARD_MESSAGES)


def _output_fix(output: Any) -> str:
    """How to turn what loss_fn returned into a loss, where the mistake is a known one."""
    loss = output[0] if isinstance(output, tuple) and output else output
    if output is None:
        return ": return the loss (torchturbo calls backward on it)"
    if isinstance(loss, (int, float)):
        return ": return the loss tensor itself, not loss.item() (backward needs its graph)"
    if isinstance(loss, torch.Tensor) and loss.dim() > 0 and loss.is_floating_point():
        return ": reduce it to the batch's mean, e.g. return losses.mean() (reduction='mean')"
    return ""


def _is_loss_output(output: Any) -> bool:
    if isinstance(output, tuple):
        if len(output) != 2:
            return False
        output, count = output
        count_is_number = isinstance(count, (int, float)) and not isinstance(count, bool)
        count_is_tensor = isinstance(count, torch.Tensor) and count.numel() == 1
        if not (count_is_number or count_is_tensor):
            return False
    return isinstance(output, torch.Tensor) and output.dim() == 0 and output.is_floating_point()


class NonFiniteGuard:
    """Counts consecutive optimizer steps with a non-finite loss or gradient; raises at patience."""

    def __init__(self, patience: int) -> None:
        self.patience = patience
        #: Consecutive non-finite optimizer steps so far.
        self.streak = 0
        self._flag: torch.Tensor | None = None
        self._rerun: Callable[[], Any] | None = None
        self._batch: Any = None

    def observe(self, loss: torch.Tensor, rerun: Callable[[], Any], batch: Any = None) -> None:
        """Fold this micro-batch's loss into the window's flag; keep how to re-run its forward
        and (a reference to) its batch, to say what went wrong if the guard trips."""
        if self.patience == 0:
            return
        bad = ~torch.isfinite(loss.detach())
        self._flag = bad if self._flag is None else self._flag | bad
        self._rerun, self._batch = rerun, batch

    def forget_window(self) -> None:
        """Drop the open window's flag (its micro-batches are about to be replayed)."""
        self._flag = None

    def window_nonfinite(
        self, params: Iterable[nn.Parameter], grad_norm: torch.Tensor | None, check_grads: bool
    ) -> bool:
        """Whether the closing window was non-finite (one host read); updates the streak.

        Call it with the gradients as the optimizer will apply them: unscaled, and clipped when
        ``grad_norm`` (clipping's norm of the gradients *before* clipping) is given; they are then
        checked again, since clipping by a coefficient that is not finite makes them NaN.
        ``check_grads`` is False under a GradScaler, which skips steps whose gradients overflowed
        itself: then only gradients that clipping made non-finite count.
        """
        if self.patience == 0:
            return False
        flag, self._flag = self._flag, None
        grads = [p.grad for p in params if p.grad is not None]
        if grads and (check_grads or grad_norm is not None):
            applied = torch.nn.utils.get_total_norm(grads, error_if_nonfinite=False)
            bad_grad = ~torch.isfinite(applied)
            if not check_grads:  # the scaler's overflow is the scaler's to skip
                assert grad_norm is not None  # without check_grads, only reached with a norm
                bad_grad &= torch.isfinite(grad_norm).to(bad_grad.device)
            flag = bad_grad if flag is None else flag | bad_grad.to(flag.device)
        nonfinite = flag is not None and bool(flag)  # the one sync of the guard per step
        self.streak = self.streak + 1 if nonfinite else 0
        return nonfinite

    def raise_if_exhausted(self, model: nn.Module, optimizer_step: int) -> None:
        """Raise :class:`NonFiniteError` once ``patience`` non-finite steps came in a row."""
        if self.patience == 0 or self.streak < self.patience:
            return
        raise NonFiniteError(
            f"the loss or gradients were non-finite for {self.streak} consecutive optimizer steps "
            f"(up to optimizer step {optimizer_step}); {self._diagnose(model)}. Lower the "
            "learning rate, check the data, or use [precision] dtype = 'bf16' for fp16 overflow"
        )

    def raise_if_ending_nonfinite(self, model: nn.Module, optimizer_step: int) -> None:
        """Raise :class:`NonFiniteError` when a run ends inside a non-finite streak shorter than
        the patience: its last steps were skipped, its last loss is NaN, it did not succeed."""
        if self.patience == 0 or self.streak == 0:
            return
        raise NonFiniteError(
            f"the run ended with {self.streak} non-finite optimizer step(s) in a row, skipped "
            f"(up to optimizer step {optimizer_step}; [reliability] nonfinite_patience = "
            f"{self.patience} would have stopped it later); {self._diagnose(model)}"
        )

    def _diagnose(self, model: nn.Module) -> str:
        """The last micro-batch's non-finite inputs if any, else the first non-finite module."""
        inputs = nonfinite_tensors(self._batch, "batch")
        if inputs:
            more = f" and {len(inputs) - 1} more" if len(inputs) > 1 else ""
            return f"the last micro-batch's inputs are not finite: {inputs[0]}{more}"
        return self._locate(model)

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


def nonfinite_tensors(tree: Any, name: str, depth: int = 0) -> list[str]:
    """``"batch[0]: 12 of 32 values are NaN or inf"`` for each floating tensor of a nested
    structure (dicts, lists, tuples) that holds any; [] when all are finite."""
    if isinstance(tree, torch.Tensor):
        tree = tree.to_local() if hasattr(tree, "to_local") else tree  # a DTensor: this shard
        if not tree.is_floating_point() or bool(torch.isfinite(tree).all()):
            return []
        bad = int((~torch.isfinite(tree)).sum())
        return [f"{name}: {bad} of {tree.numel()} values are NaN or inf"]
    if depth > 8:
        return []
    items: Iterable[tuple[Any, Any]] | None = tree.items() if isinstance(tree, Mapping) else None
    if items is None and isinstance(tree, (list, tuple)):
        items = enumerate(tree)
    return [
        found
        for key, value in items or ()
        for found in nonfinite_tensors(value, f"{name}[{key!r}]", depth + 1)
    ]


def refuse_nonfinite_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Raise :class:`NonFiniteError` when a weight, buffer or optimizer state is NaN or inf.

    Called before a checkpoint is written: saving it would keep useless weights and, as the
    newest checkpoints are kept, push out the last good one.
    """
    bad = nonfinite_tensors(model.state_dict(), "model") or nonfinite_tensors(
        optimizer.state_dict()["state"], "optimizer state"
    )
    if bad:
        raise NonFiniteError(
            f"refusing to save a checkpoint of non-finite weights: {bad[0]}"
            + (f" (and {len(bad) - 1} more tensor{'s' * (len(bad) > 2)})" if len(bad) > 1 else "")
            + "; the checkpoints already saved are kept"
        )
