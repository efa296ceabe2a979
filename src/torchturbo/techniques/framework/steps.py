"""What a technique does inside every training step the engine runs, and all of them composed.

A technique with a ``step`` hook (``Technique.step``) returns a :class:`StepHooks` for the run:
the context around a whole step (TF32's switches), the forward's context (autocast), the loss to
call backward on (a GradScaler's scaling), the gradients before clipping (unscaled), the
optimizer step (which a scaler may skip) and the state a checkpoint keeps (the loss scale). Every
method does nothing by default, so a technique overrides only its own, as Lightning Fabric's
precision plugins do; :class:`Steps` runs every requested technique's hooks in the registry's
order, and is all the engine knows of them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from torchturbo.techniques.framework.result import TechniqueResult


class StepHooks:
    """One technique's part of a training step; the defaults leave the step as it is."""

    #: What the technique does here (``Turbo.results``); None: nothing to report.
    result: TechniqueResult | None = None

    def step_context(self) -> contextlib.AbstractContextManager[Any]:
        """Held around a whole step: forward, backward and the optimizer."""
        return contextlib.nullcontext()

    def forward_context(self) -> contextlib.AbstractContextManager[Any]:
        """Held around the forward (the loss function's call)."""
        return contextlib.nullcontext()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The tensor to call ``backward`` on, from the (weighted) loss."""
        return loss

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Make the gradients the true ones, before clipping reads them."""

    def optimizer_step(self, optimizer: torch.optim.Optimizer, *, finite: bool) -> bool | None:
        """Step ``optimizer`` itself and return whether it skipped the step; None leaves the
        step to the next technique, or to the engine's plain ``optimizer.step()``."""
        return None

    def checks_finite(self) -> bool:
        """Whether its optimizer step skips non-finite gradients itself (a GradScaler does),
        so that the engine's guard need not read them."""
        return False

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of it (empty: nothing)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

    def older_state(self, files: dict[str, Any]) -> dict[str, Any] | None:
        """Its state as an older checkpoint format kept it among ``files`` (by file name),
        where the checkpoint has no ``<name>.pt`` of it; None: no older form."""
        return None


class Steps:
    """Every requested technique's step hooks, by name, run in the registry's order."""

    def __init__(self, hooks: Sequence[tuple[str, StepHooks]]) -> None:
        self.hooks = dict(hooks)

    def __getitem__(self, name: str) -> StepHooks:
        return self.hooks[name]

    @property
    def results(self) -> dict[str, TechniqueResult]:
        return {name: h.result for name, h in self.hooks.items() if h.result is not None}

    @contextlib.contextmanager
    def step_context(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for hooks in self.hooks.values():
                stack.enter_context(hooks.step_context())
            yield

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for hooks in self.hooks.values():
                stack.enter_context(hooks.forward_context())
            yield

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        for hooks in self.hooks.values():
            loss = hooks.scale_loss(loss)
        return loss

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        for hooks in reversed(self.hooks.values()):  # undone in the reverse of the scaling
            hooks.unscale_gradients(optimizer)

    def checks_finite(self) -> bool:
        return any(hooks.checks_finite() for hooks in self.hooks.values())

    def optimizer_step(self, optimizer: torch.optim.Optimizer, *, finite: bool) -> bool:
        """Step ``optimizer`` (the first technique that steps it, else a plain step unless the
        gradients are not ``finite``); returns whether the step was skipped."""
        for hooks in self.hooks.values():
            skipped = hooks.optimizer_step(optimizer, finite=finite)
            if skipped is not None:
                return skipped
        if finite:
            optimizer.step()
        return not finite

    def state_dict(self) -> dict[str, dict[str, Any]]:
        """Each technique's state, by name; techniques with nothing to keep are left out."""
        return {name: state for name, h in self.hooks.items() if (state := h.state_dict())}

    def load_state_dict(self, states: dict[str, dict[str, Any]]) -> None:
        for name, hooks in self.hooks.items():
            if name in states:
                hooks.load_state_dict(states[name])

    def states_in(self, files: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """Each technique's state from a checkpoint's ``files``: its ``<name>.pt``, else what
        an older format kept (:meth:`StepHooks.older_state`)."""
        found = {}
        for name, hooks in self.hooks.items():
            state = files.get(f"{name}.pt") or hooks.older_state(files)
            if state:
                found[name] = state
        return found
