"""Whether a checkpoint can be resumed into this run, checked before anything is restored.

torch's own loading stops at the first mismatch, with an error that names one side (``size
mismatch for body.0.weight``) or none: an Adam checkpoint loaded into SGD fails only at the
first step, with ``KeyError: 'momentum'``; a hand-edited ``state.json`` fails with a
``TypeError`` deep in the loader. The pure functions here compare what a checkpoint holds with
the live model, optimizer and loader and return one sentence per mismatch, naming both sides;
:func:`check_resumable` raises them together as one :class:`CheckpointError`, before the model
or the optimizer is touched.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchturbo.data.length import length_or_none
from torchturbo.resume.files import SHARDS, CheckpointError

#: The files every checkpoint of ``torchturbo.engine.state`` holds; ``WHOLE_STATE`` too unless the
#: model and optimizer are sharded (FSDP, in ``SHARDS/``, checked by torch.distributed.checkpoint).
REQUIRED_FILES = ("rng.pt", "state.json", "config.toml")
WHOLE_STATE = ("model.pt", "optimizer.pt")
#: 2: each rank's numpy and Python random state in ``random.json`` (1 kept rank 0's in
#: ``state.json``), the loss scale in ``precision.pt`` (1: ``scaler.pt``); 1 still loads.
STATE_VERSION = 2
READABLE_VERSIONS = (1, 2)
_MT_KEYS = 624  # words of a Mersenne Twister state (numpy and Python ``random``)
_INT64_MAX = 2**63 - 1
_STEP_IN_NAME = re.compile(r"ckpt-(\d+)$")


def check_resumable(
    path: Path,
    files: Mapping[str, Any],
    model: nn.Module,
    optimizer: Any,
    loader: Any,
    *,
    position_problems: Sequence[str] = (),
    carried_over: bool = False,
) -> None:
    """Raise one :class:`CheckpointError` listing every way checkpoint ``path`` (its ``files``)
    does not fit ``model``, ``optimizer`` and ``loader`` (None for a manual loop), with
    ``position_problems``, the ways its loader position does not fit this number of processes
    (``reliability.remap.world_problems``). ``carried_over``: the position is carried onto
    another number of ranks, so its per-rank batch count is not this loader's."""
    sharded = (path / SHARDS).is_dir()
    problems = missing_files(files, sharded=sharded)
    if not problems:
        state = files["state.json"]
        batches = None if carried_over else length_or_none(loader)
        problems = [*position_problems, *state_problems(state, batches, path)]
        plain_random = files.get("random.json", state)  # version 1 kept it in state.json
        if isinstance(plain_random, dict):
            python, numpy = plain_random.get("python"), plain_random.get("numpy")
            problems += _python_random_problems(python, numpy)
        if not sharded:
            problems += model_problems(files["model.pt"], model)
            problems += optimizer_problems(files["optimizer.pt"], optimizer, state)
        problems += random_state_problems(files["rng.pt"])
    if problems:
        count = f"{len(problems)} problems: " if len(problems) > 1 else ""
        raise CheckpointError(f"cannot resume from {str(path)!r}: {count}" + "; ".join(problems))


def check_steps(requested: int, saved: int, path: Path) -> None:
    """A run asked to train to step ``requested`` cannot resume from a checkpoint at ``saved``:
    it would train nothing and report the checkpoint's step as its own."""
    if requested < saved:
        raise CheckpointError(
            f"cannot train to optimizer step {requested} (--steps): the checkpoint resumed from, "
            f"{str(path)!r}, is already at step {saved}; ask for --steps {saved} or more"
        )


def lacking_files(path: Path, names: Collection[str]) -> str | None:
    """What checkpoint ``path``, whose manifest lists ``names``, lacks of the files every
    checkpoint holds (``files.read_latest`` then falls back, as from a corrupt file)."""
    problems = missing_files(dict.fromkeys(names), sharded=(path / SHARDS).is_dir())
    return "; ".join(problems) or None


def missing_files(files: Mapping[str, Any], *, sharded: bool = False) -> list[str]:
    required = REQUIRED_FILES if sharded else (*WHOLE_STATE, *REQUIRED_FILES)
    missing = [name for name in required if name not in files]
    if not missing:
        return []
    return [
        f"its manifest lists no {', '.join(missing)} (it lists {sorted(files)}): a checkpoint "
        f"holds {', '.join(required)}"
    ]


def state_problems(state: Any, batches_per_epoch: int | None, path: Path) -> list[str]:
    """Counters, loader position and random-state words of ``state.json``, each in range."""
    if not isinstance(state, dict):
        return [f"state.json holds {type(state).__name__}, expected a JSON object"]
    problems = []
    if state.get("version") not in READABLE_VERSIONS:
        problems.append(
            f"state.json version = {state.get('version')!r}, expected one of {READABLE_VERSIONS}"
        )
    steps = state.get("optimizer_steps")
    for name, low, high in (
        ("optimizer_steps", 0, _INT64_MAX),
        ("skipped_steps", 0, steps if isinstance(steps, int) else _INT64_MAX),
        ("micro_batch_split", 1, 2**20),
    ):
        if not _in_range(state.get(name), low, high):
            problems.append(
                f"state.json {name} = {state.get(name)!r} is invalid: expected an int from {low} "
                f"to {high}"
            )
    named = _STEP_IN_NAME.search(path.name)
    if named and _is_int(steps) and int(named[1]) != steps:
        problems.append(
            f"state.json says optimizer step {steps}, the checkpoint is named for step "
            f"{int(named[1])}"
        )
    problems += _loader_problems(state.get("loader"), batches_per_epoch)
    return problems


def data_changes(state: Any, identity: Mapping[str, Any] | None) -> list[str]:
    """How this run's data (``identity``, ``reliability.epochs.data_identity``) differs from the
    data the checkpoint's position counts in, one phrase each; [] for a checkpoint that recorded
    none (an older torchturbo, or no loader)."""
    saved = state.get("data") if isinstance(state, dict) else None
    if not isinstance(saved, dict) or identity is None:
        return []
    changes = []
    if saved.get("samples") != identity.get("samples"):
        changes.append(
            f"the dataset has {identity.get('samples')} samples, the checkpoint's had "
            f"{saved.get('samples')}"
        )
    elif saved.get("lengths") != identity.get("lengths"):
        changes.append("the samples' lengths differ in order (the data was reordered or edited)")
    if saved.get("plan") != identity.get("plan"):
        changes.append(
            f"the batches are planned by {identity.get('plan')}, the checkpoint's by "
            f"{saved.get('plan')} ([data] batches)"
        )
    return changes


def data_problems(state: Any, identity: Mapping[str, Any] | None) -> list[str]:
    """The refusal of a mid-epoch resume onto changed data (``data_changes``): the position
    counts batches of the old data, so continuing would skip some samples and repeat others.
    At an epoch's start nothing is counted yet: no problem (the engine says so)."""
    position = state.get("loader") if isinstance(state, dict) else None
    changes = data_changes(state, identity)
    if not changes or not (isinstance(position, list) and len(position) == 2 and position[1]):
        return []
    epoch, batches = position
    return [
        f"{'; '.join(changes)}: its position (epoch {epoch}, {batches} batches in) counts in the "
        "data it was saved with, and continuing it here would skip some samples and train "
        f"others twice; resume with --next-epoch (Turbo.load(..., next_epoch=True)) to start "
        f"epoch {epoch + 1} from this checkpoint"
    ]


def model_problems(saved: Any, model: nn.Module) -> list[str]:
    """Parameter and buffer names and shapes of the checkpoint against ``model``'s."""
    if not isinstance(saved, Mapping):
        return [f"model.pt holds {type(saved).__name__}, expected a state_dict"]
    live = model.state_dict()
    problems = []
    missing = [name for name in live if name not in saved]
    unexpected = [name for name in saved if name not in live]
    if missing:
        problems.append(f"the model has {_names(missing)}, which the checkpoint lacks")
    if unexpected:
        problems.append(f"the checkpoint has {_names(unexpected)}, which the model lacks")
    for name in (n for n in live if n in saved):
        before, now = saved[name], live[name]
        if _shape(before) != _shape(now):
            problems.append(
                f"{name!r} is {_shape(before)} in the checkpoint and {_shape(now)} in the model"
            )
    return _at_most(problems, 4, "mismatches")


def optimizer_problems(saved: Any, optimizer: Any, state: Any) -> list[str]:
    """Optimizer type, parameter groups and hyperparameters of the checkpoint against
    ``optimizer``'s."""
    if not (isinstance(saved, Mapping) and {"state", "param_groups"} <= saved.keys()):
        return ["optimizer.pt is not an optimizer state_dict (no 'state' and 'param_groups')"]
    kind = type(optimizer).__name__
    saved_kind = state.get("optimizer") if isinstance(state, dict) else None
    if saved_kind is not None and saved_kind != kind:
        return [f"the checkpoint's optimizer is {saved_kind}, this run's is {kind}"]
    groups, live_groups = saved["param_groups"], optimizer.param_groups
    if not isinstance(groups, list) or len(groups) != len(live_groups):
        count = len(groups) if isinstance(groups, list) else groups
        return [
            f"the checkpoint's optimizer has {count} parameter group(s), this run's "
            f"{kind} has {len(live_groups)}"
        ]
    problems = []
    for index, (group, live) in enumerate(zip(groups, live_groups, strict=True)):
        params = group.get("params") if isinstance(group, dict) else None
        if not isinstance(params, list) or len(params) != len(live["params"]):
            held = len(params) if isinstance(params, list) else "no"
            problems.append(
                f"parameter group {index} holds {held} parameters in the checkpoint and "
                f"{len(live['params'])} in this run's {kind}"
            )
        elif saved_kind is None and (lacking := sorted(_hyperparameters(optimizer) - set(group))):
            # Checkpoints without the optimizer's name: its hyperparameters tell the type.
            problems.append(
                f"the checkpoint's parameter group {index} lacks {', '.join(lacking)}, which "
                f"{kind} needs: it was saved from another optimizer type (it has "
                f"{', '.join(sorted(set(group) - {'params'}))})"
            )
    return problems


def random_state_problems(rng: Any) -> list[str]:
    """The random states of ``rng.pt`` have the sizes this torch and numpy read back."""
    if not isinstance(rng, Mapping):
        return [f"rng.pt holds {type(rng).__name__}, expected a dict of random states"]
    problems = []
    expected = torch.get_rng_state()
    for name in ("torch", "loader_torch"):
        value = rng.get(name)
        if name == "loader_torch" and value is None:
            continue
        if not (isinstance(value, torch.Tensor) and value.dtype == expected.dtype):
            problems.append(f"rng.pt {name} is {_shape(value)}, expected a torch RNG state")
        elif value.shape != expected.shape:
            problems.append(
                f"rng.pt {name} has {value.numel()} bytes, this torch's RNG state "
                f"{expected.numel()}"
            )
    keys = rng.get("numpy_keys")
    if not (isinstance(keys, torch.Tensor) and keys.shape == (_MT_KEYS,)):
        problems.append(f"rng.pt numpy_keys is {_shape(keys)}, expected {_MT_KEYS} words")
    return problems


def _loader_problems(loader: Any, batches_per_epoch: int | None) -> list[str]:
    if loader is None:
        return []
    if not (isinstance(loader, list) and len(loader) == 2 and all(map(_is_int, loader))):
        return [f"state.json loader = {loader!r} is invalid: expected [epoch, batches] or null"]
    epoch, batches = loader
    high = _INT64_MAX if batches_per_epoch is None else batches_per_epoch - 1
    if epoch < 0 or not 0 <= batches <= high:
        return [
            f"state.json loader position = epoch {epoch}, batch {batches} is out of range: "
            f"this run's loader has {batches_per_epoch} batches per epoch"
        ]
    return []


def _python_random_problems(python: Any, numpy: Any) -> list[str]:
    problems = []
    internal = python[1] if isinstance(python, list) and len(python) == 3 else None
    if not (
        isinstance(internal, list)
        and len(internal) == _MT_KEYS + 1
        and all(map(_is_int, internal))
        and (python[2] is None or isinstance(python[2], float))
    ):
        problems.append("the saved python state is not a random.getstate() of Python's generator")
    if not (
        isinstance(numpy, list)
        and len(numpy) == 3
        and _in_range(numpy[0], 0, _MT_KEYS)
        and numpy[1] in (0, 1)
        and isinstance(numpy[2], (int, float))
    ):
        problems.append("the saved numpy state is not the tail of a numpy.random.get_state()")
    return problems


def _hyperparameters(optimizer: Any) -> set[str]:
    """The optimizer's hyperparameters that its step reads, without the bool/None switches that
    torch versions add and fill in when loading an older state (foreach, fused, maximize...)."""
    defaults = getattr(optimizer, "defaults", {})
    return {name for name, value in defaults.items() if not isinstance(value, (bool, type(None)))}


def _names(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:3])
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return f"{len(names)} entr{'y' if len(names) == 1 else 'ies'} ({shown}{more})"


def _at_most(problems: list[str], count: int, what: str) -> list[str]:
    if len(problems) <= count:
        return problems
    return [*problems[:count], f"{len(problems) - count} more {what}"]


def _shape(value: Any) -> Any:
    return list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _in_range(value: Any, low: int, high: int) -> bool:
    return _is_int(value) and low <= value <= high
