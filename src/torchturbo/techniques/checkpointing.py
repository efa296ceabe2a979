"""Activation checkpointing: keep block inputs, recompute block internals in backward.

Uses ``torch.utils.checkpoint.checkpoint`` with ``use_reentrant=False`` (the reentrant variant
ignores inputs that do not require grad, breaks with ``torch.autograd.grad`` and is slated for
removal) and ``preserve_rng_state=True`` so dropout draws the same mask when recomputed.

BatchNorm running statistics are restored after the recompute, so that checkpointing a block
updates them once per step, as without it (``_restore_norm_statistics``).

The forward of each chosen block is replaced on the instance rather than wrapping the block in
another module, so parameter names and ``state_dict`` keys stay exactly as the user wrote them
(checkpoints load into a model with or without checkpointing).

A *block* is a child of an ``nn.Sequential`` or ``nn.ModuleList`` that itself has submodules
(a residual block, a transformer layer, a U-Net stage), taken at the outermost level: a block
inside a block is not a separate block. Models with no such containers fall back to their direct
children that have parameters.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch.utils.checkpoint
from torch import nn

from torchturbo.base.blocks import find_blocks
from torchturbo.config import CheckpointConfig, TurboConfig
from torchturbo.techniques.framework.result import TechniqueResult, applied, not_applied
from torchturbo.techniques.framework.spec import Technique, TrainerArguments

#: Attribute set on every checkpointed module; measure/memory.py reads it to count the inputs
#: that checkpoint keeps alive through a closure rather than through saved-tensor hooks.
CHECKPOINTED_MARK = "_torchturbo_checkpointed"


def select_blocks(model: nn.Module, config: CheckpointConfig) -> list[tuple[str, nn.Module]]:
    """The blocks the config asks to checkpoint."""
    if config.mode == "off":
        return []
    if config.mode == "full":
        chosen = find_blocks(model)
    elif config.blocks:
        chosen = _outermost(_named(model, config.blocks))
    elif config.module_types or config.name_pattern:
        chosen = [
            (name, module)
            for name, module in model.named_modules()
            if name
            and (
                type(module).__name__ in config.module_types
                or (config.name_pattern and fnmatch.fnmatchcase(name, config.name_pattern))
            )
        ]
        chosen = _outermost(chosen)
    else:
        chosen = find_blocks(model)
    return chosen[:: config.every_n]


def _named(model: nn.Module, names: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    """The modules ``names`` name, in the model's order; an unknown name is a ValueError that
    lists the model's blocks (a typo should not silently checkpoint nothing)."""
    modules = dict(model.named_modules())
    unknown = [n for n in names if not n or n not in modules]
    if unknown:
        blocks = [n for n, _ in find_blocks(model)]
        more = f" (+{len(blocks) - 12} more)" if len(blocks) > 12 else ""
        shown = ", ".join(blocks[:12]) + more
        raise ValueError(
            f"[checkpointing] blocks: no module named {', '.join(map(repr, unknown))} in "
            f"{type(model).__name__}; its blocks are {shown or 'none'} (any qualified module "
            "name from model.named_modules() works)"
        )
    wanted = set(names)
    return [(n, m) for n, m in model.named_modules() if n in wanted]


def _outermost(named: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Drop modules nested in another chosen module: checkpointing both would recompute twice."""
    names = [n for n, _ in named]
    return [(n, m) for n, m in named if not any(n.startswith(o + ".") for o in names)]


def checkpoint_module(module: nn.Module) -> None:
    """Make ``module`` recompute its forward during backward instead of saving activations."""
    if getattr(module, CHECKPOINTED_MARK, False):
        return
    module.forward = functools.partial(_checkpointed_forward, module, module.forward)
    setattr(module, CHECKPOINTED_MARK, True)


def _checkpointed_forward(module: nn.Module, forward: Callable, *args: Any, **kwargs: Any) -> Any:
    """``forward`` under ``checkpoint``; eagerly with the recompute context that restores norm
    statistics, compiled without it.

    torch.compile accepts only ``TorchDispatchMode`` pairs as ``context_fn``, and needs none here:
    the compiled backward replays the recorded graph, whose buffer updates ran once, in forward.
    """
    contexts: dict[str, Any] = {}
    if not torch.compiler.is_compiling():
        contexts["context_fn"] = functools.partial(_recompute_contexts, module)
    return torch.utils.checkpoint.checkpoint(
        forward, *args, use_reentrant=False, preserve_rng_state=True, **contexts, **kwargs
    )


def _recompute_contexts(
    module: nn.Module,
) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """(forward context, recompute context) for ``checkpoint``'s ``context_fn``.

    The recompute runs the block's forward a second time in training mode, which would update
    BatchNorm running statistics twice per step (running_mean drifts towards the batch twice as
    fast, num_batches_tracked counts double). The recompute context restores them afterwards.
    """
    return contextlib.nullcontext(), _restore_norm_statistics(module)


_RUNNING_STAT_NORMS = (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.SyncBatchNorm,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
)


@contextlib.contextmanager
def _restore_norm_statistics(module: nn.Module) -> Iterator[None]:
    norms = [m for m in module.modules() if isinstance(m, _RUNNING_STAT_NORMS)]
    saved = [
        {name: buffer.clone() for name, buffer in norm.named_buffers(recurse=False)}
        for norm in norms
        if norm.training and norm.track_running_stats
    ]
    try:
        yield
    finally:
        tracked = [n for n in norms if n.training and n.track_running_stats]
        with torch.no_grad():
            for norm, buffers in zip(tracked, saved, strict=True):
                for name, value in buffers.items():
                    getattr(norm, name).copy_(value)


def apply_activation_checkpointing(model: nn.Module, config: CheckpointConfig) -> TechniqueResult:
    """Checkpoint the blocks chosen by ``config``; the result's ``targets`` are their names."""
    if config.mode == "off":
        return not_applied("checkpointing", "[checkpointing] mode = 'off'")
    chosen = select_blocks(model, config)
    if not chosen:
        return not_applied("checkpointing", "the config selected no block of this model")
    for _, module in chosen:
        checkpoint_module(module)
    return applied("checkpointing", tuple(name for name, _ in chosen))


def _by_type_or_name(config: CheckpointConfig) -> bool:
    return bool(config.blocks or config.module_types or config.name_pattern)


def _transform(model: nn.Module, config: TurboConfig, device: torch.device) -> TechniqueResult:
    return apply_activation_checkpointing(model, config.checkpointing)


def _hf_carries(config: TurboConfig) -> str | None:
    if _by_type_or_name(config.checkpointing):
        return None
    return "TrainingArguments' activation checkpointing checkpoints the model's own layers"


def _hf_arguments(config: TurboConfig, arguments: TrainerArguments) -> None:
    checkpointing = config.checkpointing
    if _by_type_or_name(checkpointing):
        arguments.note(
            "checkpointing",
            "mode",
            f"selective by module type or name: applied by {arguments.callback} (Trainer "
            "checkpoints every layer of the model's own choosing)",
        )
        return
    v5 = arguments.takes("train_sampling_strategy")
    name = "activation_checkpointing" if v5 else "gradient_checkpointing"
    arguments.kwargs[name] = True
    # Non-reentrant: the reentrant variant ignores inputs without grad and is being removed.
    options: dict[str, Any] = {"use_reentrant": False}
    if checkpointing.every_n > 1:
        if v5:
            options["every_n_layers"] = checkpointing.every_n
        else:
            arguments.note(
                "checkpointing",
                "every_n",
                f"{checkpointing.every_n} not carried: transformers 4 checkpoints every layer",
            )
    arguments.kwargs[f"{name}_kwargs"] = options


TECHNIQUE = Technique(
    name="checkpointing",
    section="checkpointing",
    doc="docs/techniques/checkpointing.md",
    requested=lambda config: config.checkpointing.mode != "off",
    transform=_transform,
    order=30,
    order_reason=(
        "checkpointing before compile: compile must see the checkpoint regions to keep them "
        "(torch.compile traces through checkpoint and honours its recompute boundaries)"
    ),
    carried_by={"transformers": _hf_carries},
    translations={"transformers": _hf_arguments},
)
