"""Recipe: what a user hands torchturbo, and loading one from ``file.py:function``.

A recipe holds *factories* rather than instances so that the tuner can build a fresh model and
optimizer from the same initial weights for every trial.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

LossFn = Callable[[nn.Module, Any], "torch.Tensor | tuple[torch.Tensor, int | torch.Tensor]"]


class RecipeError(ValueError):
    """A recipe could not be loaded or is malformed; the message says what to fix."""


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """A training workload: how to build the model and optimizer, compute the loss, read the data.

    ``loss_fn(model, batch)`` returns the mean loss of the batch, or ``(loss, count)`` where
    ``count`` is the number of samples or tokens the mean is over (needed for exact gradient
    accumulation over batches of different sizes). ``lengths`` (one per sample) enables dynamic
    batching; ``count_unit`` names what ``count`` counts ("samples" or "tokens").
    """

    name: str
    model: Callable[[], nn.Module]
    optimizer: Callable[[Any], torch.optim.Optimizer]
    loss_fn: LossFn
    dataset: Dataset
    batch_size: int
    collate: Callable[[list[Any]], Any] | None = None
    lengths: Sequence[int] | None = None
    count_unit: str = "samples"
    seed: int = 0
    #: Pad value per field for variable-length dict samples (e.g. ``{"input_ids":
    #: tokenizer.pad_token_id}``); unnamed fields pad with 0, label fields with -100.
    pad_values: Mapping[str, int] | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise RecipeError(
                f"Recipe {self.name!r}: batch_size must be a positive int, got {self.batch_size!r}"
            )
        if self.count_unit not in ("samples", "tokens"):
            raise RecipeError(
                f"Recipe {self.name!r}: count_unit must be 'samples' or 'tokens', "
                f"got {self.count_unit!r}"
            )
        if self.lengths is not None and len(self.lengths) != len(self.dataset):
            raise RecipeError(
                f"Recipe {self.name!r}: lengths has {len(self.lengths)} entries but the dataset "
                f"has {len(self.dataset)} samples; give one length per sample"
            )
        for attr in ("model", "optimizer", "loss_fn"):
            if not callable(getattr(self, attr)):
                raise RecipeError(f"Recipe {self.name!r}: {attr} must be callable")

    def collate_fn(self) -> Callable[[list[Any]], Any]:
        """The recipe's collate, else the padding collate (``torchturbo.data.collate``), which
        pads variable-length fields of dict samples and otherwise collates like torch's."""
        if self.collate is not None:
            return self.collate
        from torchturbo.data.collate import pad_collate

        return functools.partial(pad_collate, pad_values=self.pad_values)

    def build(self) -> tuple[nn.Module, torch.optim.Optimizer]:
        """A fresh model and optimizer, with initial weights fixed by ``seed``."""
        torch.manual_seed(self.seed)
        model = self.model()
        return model, self.optimizer(model.parameters())


def load_recipe(spec: str) -> Recipe:
    """Load ``path/to/file.py:function`` or ``package.module:function`` and call it.

    The function takes no arguments and returns a :class:`Recipe`.
    """
    if ":" not in spec:
        raise RecipeError(
            f"recipe {spec!r}: expected 'path/to/file.py:function' or 'package.module:function'"
        )
    where, _, func_name = spec.rpartition(":")
    module = _import_file(where) if where.endswith(".py") else _import_module(where)
    func = getattr(module, func_name, None)
    if func is None:
        public = sorted(n for n in vars(module) if not n.startswith("_"))
        raise RecipeError(f"recipe {spec!r}: {where} has no {func_name!r}; it defines {public}")
    if not callable(func):
        raise RecipeError(f"recipe {spec!r}: {func_name!r} is not a function")
    recipe = func()
    if not isinstance(recipe, Recipe):
        raise RecipeError(
            f"recipe {spec!r}: {func_name}() returned {type(recipe).__name__}, "
            "expected torchturbo.Recipe"
        )
    return recipe


def _import_file(path_str: str) -> Any:
    path = Path(path_str)
    if not path.is_file():
        raise RecipeError(f"recipe file {path_str!r} does not exist")
    module_name = f"torchturbo_recipe_{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise RecipeError(f"recipe file {path_str!r} cannot be imported as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling in workers need the module
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        raise RecipeError(f"recipe file {path_str!r} failed to import: {err!r}") from err
    return module


def _import_module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise RecipeError(f"recipe module {name!r} cannot be imported: {err}") from err
