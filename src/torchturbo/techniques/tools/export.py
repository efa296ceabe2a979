"""Export an eval-mode model as a deployment artefact, and prove the artefact by reloading it.

``method="export"`` (the default) uses ``torch.export.export`` to capture the whole forward as
an ATen graph with its weights, and ``torch.export.save`` to write a ``.pt2`` file: the program
``torch.export.load`` reads back, and the input AOTInductor and ExecuTorch compile from.
``method="torchscript"`` (``torch.jit.trace`` + ``torch.jit.save``) is kept only for runtimes
that still need it: TorchScript is in maintenance mode, and recent torch deprecates its entry
points (a DeprecationWarning in 2.13, a FutureWarning in 2.14).

Either way the written file is loaded back and run on the example inputs, and, when the batch
dimension is exported as dynamic, on a batch of twice the size, and the outputs are compared with
the eager model's; an artefact that disagrees raises :class:`ExportVerificationError` instead of
being handed over.

The example inputs are copied before export: ``torch.export.save`` stores them with the program,
and a view (the first rows of a large tensor) would carry its whole storage into the file.
:func:`export_recipe` exports the recipe's initial weights, or trained ones read from a
``torchturbo train`` checkpoint, optionally with BatchNorm folded first.
"""

from __future__ import annotations

import contextlib
import io
import os
import time
import warnings
from collections.abc import Callable, Iterator, Sized
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchturbo.output.results_file import write_atomic
from torchturbo.recipe import Recipe

_SUFFIXES = {"export": ".pt2", "torchscript": ".pt"}
METHODS = tuple(_SUFFIXES)
# The artefact runs the same ATen kernels on the same weights as eager, so outputs normally agree
# bit for bit; graph-level decompositions may reorder a reduction, which float32 rounding turns
# into a few ulps. 1e-5 of the output's magnitude allows that and nothing a real bug would cause.
RTOL = 1e-5


class ExportVerificationError(RuntimeError):
    """The reloaded artefact's outputs differ from the eager model's."""


@dataclass(frozen=True)
class ExportReport:
    """What :func:`export_model` wrote and how it was checked.

    ``max_rel_diff`` is the largest ``max|artefact - eager| / max|eager|`` over the checked
    batches (``checked_batch_sizes``); it is below ``tolerance`` or the export would have failed.
    """

    path: Path
    method: str
    size_bytes: int
    #: Bytes of the model's parameters and buffers: the floor of the artefact's size.
    weights_bytes: int
    export_s: float
    dynamic_batch: bool
    checked_batch_sizes: tuple[int, ...]
    max_rel_diff: float
    tolerance: float = RTOL


def export_model(
    model: nn.Module,
    example_inputs: tuple[Any, ...],
    path: str | os.PathLike[str],
    *,
    method: str = "export",
    dynamic_batch: bool = True,
) -> ExportReport:
    """Export the eval-mode ``model`` called as ``model(*example_inputs)`` to ``path``; verify it.

    ``example_inputs`` may hold tensors and dicts/lists/tuples of tensors (e.g. a batch dict).
    With ``dynamic_batch`` the leading dimension of every input tensor is one symbolic batch size
    (the example batch must then be >= 2: torch.export specialises sizes 0 and 1). ``path`` must
    end in ``.pt2`` for ``"export"`` and ``.pt`` for ``"torchscript"``.
    """
    if method not in METHODS:
        raise ValueError(f"export_model(method={method!r}) is invalid: choose one of {METHODS}")
    path = Path(path)
    if path.suffix != _SUFFIXES[method]:
        raise ValueError(
            f"export_model(path={str(path)!r}) is invalid for method={method!r}: "
            f"the file name must end in {_SUFFIXES[method]!r}"
        )
    if not isinstance(example_inputs, tuple):
        raise ValueError(
            f"export_model(example_inputs=...) must be a tuple of positional arguments, "
            f"got {type(example_inputs).__name__}"
        )
    training = [name or "<root>" for name, m in model.named_modules() if m.training]
    if training:
        raise ValueError(
            f"export_model(model) needs an eval-mode model, but {training[:3]} are in training "
            "mode (dropout and BatchNorm would be exported in their training behaviour). "
            "Call model.eval() first."
        )
    batch = _batch_size(example_inputs) if dynamic_batch else None
    if dynamic_batch and (batch is None or batch < 2):
        raise ValueError(
            f"export_model(dynamic_batch=True) needs example inputs with a batch of >= 2 in "
            f"their leading dimension, got {batch}; pass a larger example or dynamic_batch=False"
        )
    # Copies own exactly their elements: a view would carry its whole storage into the file.
    example_inputs = _map_tensors(example_inputs, lambda t: t.detach().clone())
    path.parent.mkdir(parents=True, exist_ok=True)
    begin = time.perf_counter()
    load = _WRITERS[method](model, example_inputs, path, dynamic_batch)
    export_s = time.perf_counter() - begin
    loaded = load()
    checks = [example_inputs]
    if dynamic_batch:
        checks.append(_map_tensors(example_inputs, _double_batch))
    diffs = [_compare(model, loaded, inputs) for inputs in checks]
    return ExportReport(
        path=path,
        method=method,
        size_bytes=path.stat().st_size,
        weights_bytes=weights_bytes(model),
        export_s=export_s,
        dynamic_batch=dynamic_batch,
        checked_batch_sizes=tuple(_batch_size(inputs) or 0 for inputs in checks),
        max_rel_diff=max(diffs),
    )


def export_recipe(
    recipe: Recipe,
    path: str | os.PathLike[str],
    *,
    method: str = "export",
    batch_size: int = 2,
    checkpoint: str | os.PathLike[str] | None = None,
    fuse: bool = False,
) -> ExportReport:
    """Build ``recipe``'s model, load its weights, and export it in eval mode.

    The weights are the recipe's initial ones (fixed by its seed), or with ``checkpoint`` the
    trained ones of a ``torchturbo train`` checkpoint: a ``--checkpoint-dir`` (its newest
    checkpoint that verifies) or one ``ckpt-*`` directory in it. ``fuse`` folds BatchNorm into
    the preceding convolutions (:func:`~torchturbo.techniques.tools.fusion.fuse_for_inference`).
    The example inputs are whatever ``recipe.loss_fn`` passes to the model on the first
    ``batch_size`` samples of the dataset, so any recipe works without naming its input format.
    """
    torch.manual_seed(recipe.seed)
    model = recipe.model()
    if checkpoint is not None:
        load_trained_weights(model, checkpoint, recipe.name)
    model.eval()
    inputs = capture_model_inputs(model, recipe, batch_size)
    if fuse:
        from torchturbo.techniques.tools.fusion import fuse_for_inference

        model, _ = fuse_for_inference(model)
    return export_model(model, inputs, path, method=method)


def load_trained_weights(
    model: nn.Module, checkpoint: str | os.PathLike[str], recipe_name: str = "recipe"
) -> Path:
    """Load the model weights of a ``torchturbo train`` checkpoint into ``model``; its path.

    Strict: a checkpoint of another model (missing or unexpected keys, other shapes) raises
    ValueError naming the checkpoint, rather than exporting a half-loaded model.
    """
    from torchturbo.resume.files import MANIFEST, CheckpointError, list_checkpoints, read_latest

    root = Path(checkpoint)
    # Said here rather than by read_latest, whose words are about resuming.
    if not (root / MANIFEST).exists() and not list_checkpoints(root):
        where = "does not exist" if not root.exists() else "holds no checkpoint (ckpt-*/)"
        raise CheckpointError(f"no trained weights to export: {str(root)!r} {where}")
    path, files = read_latest(root)
    state = files.get("model.pt")
    if not isinstance(state, dict):
        raise ValueError(f"checkpoint {str(path)!r} holds no model.pt: not a train checkpoint")
    try:
        model.load_state_dict(state)
    except RuntimeError as error:
        detail = " ".join(str(error).split())
        raise ValueError(
            f"checkpoint {str(path)!r} does not fit {recipe_name!r}'s model: {detail[:300]}"
        ) from None
    return path


def weights_bytes(model: nn.Module) -> int:
    """Bytes of the parameters and buffers of ``model``, each storage counted once."""
    storages = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


class _Captured(Exception):
    """Raised by the capture hook to stop the loss function once the model's inputs are known."""


def capture_model_inputs(model: nn.Module, recipe: Recipe, batch_size: int) -> tuple[Any, ...]:
    """The positional arguments ``recipe.loss_fn`` calls ``model`` with on a first batch."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"capture_model_inputs(batch_size={batch_size!r}): expected an int >= 1")
    dataset = recipe.dataset
    if not isinstance(dataset, Sized):
        raise ValueError(
            f"recipe {recipe.name!r}: its dataset ({type(dataset).__name__}) has no len(), and "
            "export_model reads the first samples by index"
        )
    count = min(batch_size, len(dataset))
    collate = recipe.collate_fn()
    batch = collate([dataset[i] for i in range(count)])
    captured: list[tuple[Any, ...]] = []

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if kwargs:
            raise ValueError(
                f"recipe {recipe.name!r} calls its model with keyword arguments {sorted(kwargs)}; "
                "export_model takes positional inputs only"
            )
        captured.append(args)
        raise _Captured

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            recipe.loss_fn(model, batch)
    except _Captured:
        pass
    finally:
        handle.remove()
    if not captured:
        raise ValueError(f"recipe {recipe.name!r}: loss_fn never called the model's forward")
    return captured[0]


def _export(
    model: nn.Module, example_inputs: tuple[Any, ...], path: Path, dynamic_batch: bool
) -> Callable[[], Callable[..., Any]]:
    dynamic_shapes = None
    if dynamic_batch:
        batch = torch.export.Dim("batch")
        dynamic_shapes = tuple(
            _map_tensors(arg, lambda t: {0: batch} if t.dim() else None, other=None)
            for arg in example_inputs
        )
    program = torch.export.export(model, example_inputs, dynamic_shapes=dynamic_shapes)
    _save(lambda buffer: torch.export.save(program, buffer), path)
    return lambda: torch.export.load(path).module()


def _torchscript(
    model: nn.Module, example_inputs: tuple[Any, ...], path: Path, dynamic_batch: bool
) -> Callable[[], Callable[..., Any]]:
    # Tracing records no shape guards: any batch size runs, so dynamic_batch only adds a check.
    # torch.jit.{trace,save,load} emit DeprecationWarning in recent torch (and the test suite
    # turns warnings into errors). The legacy path is chosen on purpose here, so only those
    # messages are silenced, only around these calls.
    with _jit_deprecation_silenced():
        # check_trace reruns the model to compare; the reloaded file is checked instead, below.
        scripted = torch.jit.trace(model, example_inputs, check_trace=False)
        _save(lambda buffer: torch.jit.save(scripted, buffer), path)

    def load() -> Callable[..., Any]:
        with _jit_deprecation_silenced():
            return torch.jit.load(str(path))

    return load


def _save(write: Callable[[io.BytesIO], None], path: Path) -> None:
    """Serialize into memory, then write the file atomically. torch's archive writer, given a
    path, aborts the process when a write fails (a full disk: std::ios error, then a throw in
    its destructor); here a failed write is an OSError naming the path."""
    buffer = io.BytesIO()
    write(buffer)
    write_atomic(path, buffer.getvalue())


# method -> writer(model, example_inputs, path, dynamic_batch) returning a loader of the file.
_WRITERS: dict[str, Callable[..., Callable[[], Callable[..., Any]]]] = {
    "export": _export,
    "torchscript": _torchscript,
}


def _double_batch(t: torch.Tensor) -> torch.Tensor:
    """A batch twice as large, of different content: the example, then it reversed."""
    return torch.cat([t, t.flip(0)]) if t.dim() else t


# What torch says about its own TorchScript entry points: "`torch.jit.trace` is deprecated" (a
# DeprecationWarning in 2.13, a FutureWarning in 2.14), "... is not supported in Python 3.14+".
_JIT_NOTICE = r"`torch\.jit\.\w+` is "


@contextlib.contextmanager
def _jit_deprecation_silenced() -> Iterator[None]:
    with warnings.catch_warnings():
        for category in (DeprecationWarning, FutureWarning):
            warnings.filterwarnings("ignore", message=_JIT_NOTICE, category=category)
        yield


def _compare(model: nn.Module, loaded: Callable[..., Any], inputs: tuple[Any, ...]) -> float:
    with torch.no_grad():
        expected = model(*inputs)
        actual = loaded(*inputs)
    expected_tensors, actual_tensors = _tensors(expected), _tensors(actual)
    if len(expected_tensors) != len(actual_tensors):
        raise ExportVerificationError(
            f"reloaded artefact returned {len(actual_tensors)} tensors, eager "
            f"{len(expected_tensors)}"
        )
    worst = 0.0
    for want, got in zip(expected_tensors, actual_tensors, strict=True):
        if want.shape != got.shape:
            raise ExportVerificationError(
                f"reloaded artefact returned shape {tuple(got.shape)}, eager {tuple(want.shape)}"
            )
        want, got = want.double(), got.double()
        scale = max(want.abs().max().item(), 1e-30)
        worst = max(worst, (got - want).abs().max().item() / scale)
    if worst > RTOL:
        raise ExportVerificationError(
            f"reloaded artefact differs from the eager model by {worst:.2e} of the output's "
            f"magnitude (tolerance {RTOL:.0e}) at batch {_batch_size(inputs)}"
        )
    return worst


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], Any], other: Any = ...) -> Any:
    """Apply ``fn`` to every tensor in nested tuples/lists/dicts; others kept (or -> ``other``)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn, other) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(v, fn, other) for v in value)
    return value if other is ... else other


def _tensors(value: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    _map_tensors(value, found.append)
    return found


def _batch_size(inputs: tuple[Any, ...]) -> int | None:
    """The common leading size of all input tensors, or None if they disagree or have none."""
    sizes = {t.shape[0] for t in _tensors(inputs) if t.dim() >= 1}
    return sizes.pop() if len(sizes) == 1 else None
