"""Recipe: what a user hands torchturbo, loading one from ``file.py:function``, and naming the
user function that failed.

A recipe holds *factories* rather than instances so that the tuner can build a fresh model and
optimizer from the same initial weights for every trial.

**The boundary around user code.** An exception raised by the user's code is the user's to fix,
and deserves one line that says which of their functions failed and with what, not a traceback
through torchturbo. The recipe function and the factories are called through :func:`call_user`,
which names them by role ("the model factory"); everything else (dataset items, collate,
``loss_fn`` and the model it runs) is attributed after the fact by :func:`user_code_failure`,
which reads the traceback: the DataLoader's fetch frame marks a failure of the dataset or the
collate function, and frames in files that belong to neither torchturbo, torch nor an installed
package mark the user's code. Wrapping the dataset or the loss function instead would change
their types, which the doctor and the data loaders inspect.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import re
import site
import sys
import sysconfig
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset

from torchturbo.data.length import length_or_none

LossFn = Callable[[nn.Module, Any], "torch.Tensor | tuple[torch.Tensor, int | torch.Tensor]"]


class RecipeError(ValueError):
    """A recipe could not be loaded or is malformed; the message says what to fix."""


class UserCodeError(RecipeError):
    """A function of the user's recipe raised; the message names the function and the error."""


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
    #: How many steps (batches of ``batch_size`` per process) the real job will train, and where
    #: that figure comes from ("the Trainer's max_steps=500"): the tuner weighs one-time costs
    #: such as compiling against it. None: not known (``--planned-steps`` may give it).
    planned_steps: int | None = None
    planned_steps_source: str = "the recipe"
    extras: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not _is_int(self.batch_size) or self.batch_size < 1:
            raise RecipeError(
                f"Recipe {self.name!r}: batch_size must be a positive int, got {self.batch_size!r}"
            )
        if not _is_int(self.seed) or not -(2**63) <= self.seed < 2**63:
            raise RecipeError(
                f"Recipe {self.name!r}: seed must be an int that fits int64 (torch.manual_seed), "
                f"got {self.seed!r}"
            )
        if self.planned_steps is not None and (
            not _is_int(self.planned_steps) or self.planned_steps < 1
        ):
            raise RecipeError(
                f"Recipe {self.name!r}: planned_steps must be a positive int or None, "
                f"got {self.planned_steps!r}"
            )
        size = length_or_none(self.dataset)
        if size == 0:
            raise RecipeError(
                f"Recipe {self.name!r}: the dataset is empty (len(dataset) == 0): there is nothing "
                "to train on"
            )
        if self.count_unit not in ("samples", "tokens"):
            raise RecipeError(
                f"Recipe {self.name!r}: count_unit must be 'samples' or 'tokens', "
                f"got {self.count_unit!r}"
            )
        if self.lengths is not None and isinstance(self.dataset, IterableDataset):
            raise RecipeError(
                f"Recipe {self.name!r}: lengths are given, but the dataset is a stream "
                f"({type(self.dataset).__name__}, an IterableDataset), which has no index to "
                "attach a length to: drop lengths= (a stream trains on its own batches, [data] "
                "batches = 'rows'), or make the dataset map-style (__len__ and __getitem__) to "
                "plan batches by length"
            )
        if self.lengths is not None and len(self.lengths) != size:
            samples = "no len()" if size is None else f"{size} samples"
            raise RecipeError(
                f"Recipe {self.name!r}: lengths has {len(self.lengths)} entries but the dataset "
                f"has {samples}; give one length per sample"
            )
        if self.lengths is not None:
            _check_lengths(self.name, self.lengths)
        problem = _shape_problem(self)
        if problem is not None:
            raise RecipeError(f"Recipe {self.name!r}: {problem}")
        if self.count_unit == "tokens" and not hasattr(self.loss_fn, "counts_tokens"):
            object.__setattr__(self, "loss_fn", _counting_tokens(self.name, self.loss_fn))

    def collate_fn(self) -> Callable[[list[Any]], Any]:
        """The recipe's collate, else the padding collate (``torchturbo.data.collate``), which
        pads variable-length fields of dict samples and otherwise collates like torch's."""
        if self.collate is not None:
            return self.collate
        from torchturbo.data.collate import pad_collate

        return functools.partial(pad_collate, pad_values=self.pad_values)

    def build(self) -> tuple[nn.Module, torch.optim.Optimizer]:
        """A fresh model and optimizer, with initial weights fixed by ``seed``.

        A factory that raises, or returns something else than a module or an optimizer, is a
        :class:`RecipeError` naming the factory.
        """
        torch.manual_seed(self.seed)
        model = call_user("the model factory", self.model)
        if isinstance(model, type) and issubclass(model, nn.Module):
            raise RecipeError(
                f"Recipe {self.name!r}: the model factory {describe_callable(self.model)} "
                f"returned the class {model.__name__}, not a model: return {model.__name__}(...)"
            )
        if not isinstance(model, nn.Module):
            raise RecipeError(
                f"Recipe {self.name!r}: the model factory {describe_callable(self.model)} "
                f"returned {type(model).__name__}, expected a torch.nn.Module"
            )
        optimizer = call_user("the optimizer factory", self.optimizer, model.parameters())
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise RecipeError(
                f"Recipe {self.name!r}: the optimizer factory {describe_callable(self.optimizer)} "
                f"returned {type(optimizer).__name__}, expected a torch.optim.Optimizer"
            )
        return model, optimizer


def _check_lengths(name: str, lengths: Sequence[int]) -> None:
    """Per-sample lengths are token counts, not all 0: a dataset of empty samples holds no token
    to train on (its batches would be tensors of 0 elements, which no model can reshape)."""
    if not len(lengths):
        return
    shortest, longest = min(lengths), max(lengths)
    if shortest < 0:
        index = list(lengths).index(shortest)
        raise RecipeError(
            f"Recipe {name!r}: lengths[{index}] = {shortest} is invalid: a length counts the "
            "sample's tokens, >= 0"
        )
    if longest == 0:
        raise RecipeError(
            f"Recipe {name!r}: all {len(lengths)} samples have length 0 (lengths): there is no "
            "token to train on; check the tokenizer's output or the text column"
        )


#: How each function of a recipe is called: (positional arguments, in words, the fix).
_CALLED_AS = {
    "model": (0, "with no arguments", "model=MyModel or model=lambda: MyModel(...)"),
    "optimizer": (
        1,
        "with the model's parameters",
        "optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3)",
    ),
    "loss_fn": (2, "as loss_fn(model, batch)", "def loss_fn(model, batch): ... return loss"),
}


def _shape_problem(recipe: Recipe) -> str | None:
    """What is wrong with the kind of thing each field holds, in the words that fix it, or
    None: the mistakes of porting a training loop (an instance where a factory goes, a loss
    module where ``loss_fn(model, batch)`` goes, a DataLoader where its dataset goes)."""
    model, optimizer, loss_fn = recipe.model, recipe.optimizer, recipe.loss_fn
    if isinstance(model, nn.Module):
        name = type(model).__name__
        return (
            f"model is {_a(name)} instance, and a recipe takes a factory (the tuner builds a fresh "
            f"model for every trial): pass model={name} or model=lambda: {name}(...)"
        )
    if isinstance(optimizer, torch.optim.Optimizer):
        name = type(optimizer).__name__
        lr = optimizer.defaults.get("lr")
        return (
            f"optimizer is {_a(name)} instance, and a recipe takes a factory of the parameters "
            "(each trial's model has its own): pass "
            f"optimizer=lambda params: torch.optim.{name}(params, lr={lr})"
        )
    if isinstance(loss_fn, nn.Module):
        name = type(loss_fn).__name__
        return (
            f"loss_fn is {_a(name)} module, which takes (output, target); a recipe's loss_fn takes "
            "(model, batch) and returns the loss: def loss_fn(model, batch): inputs, targets = "
            f"batch; return nn.{name}()(model(inputs), targets)"
        )
    if isinstance(recipe.dataset, torch.utils.data.DataLoader):
        return (
            "dataset is a DataLoader; pass what it loads and torchturbo builds the loader "
            "(workers, pinning, length buckets): dataset=loader.dataset, "
            "batch_size=loader.batch_size, collate=loader.collate_fn"
        )
    for attr, (arguments, called, fix) in _CALLED_AS.items():
        function = getattr(recipe, attr)
        name = describe_callable(function)
        if not callable(function):
            return f"{attr} must be callable, got {type(function).__name__}: pass {fix}"
        missing = _unbound(function, arguments)
        if missing is None:
            continue
        if attr == "model":
            given = ", ".join(f"{parameter}=..." for parameter in missing) or "..."
            fix = f"model=lambda: {getattr(function, '__name__', 'MyModel')}({given})"
        return f"{attr} {name} cannot be called {called}: pass {fix}"
    return None


def _counting_tokens(name: str, loss_fn: LossFn) -> LossFn:
    """``loss_fn``, refusing a bare loss: with no count, a step counts its batch's leading size,
    its samples, which a recipe that counts tokens would report as tokens (a 4 x 128-token
    batch read as 4 tokens)."""

    @functools.wraps(loss_fn)
    def counted(model: nn.Module, batch: Any) -> Any:
        output = loss_fn(model, batch)
        if isinstance(output, torch.Tensor):
            raise RecipeError(
                f"Recipe {name!r}: count_unit='tokens', but loss_fn returned the loss alone, so "
                "each step would count its samples as tokens: return (loss, the number of tokens "
                "the mean is over), e.g. return loss, (batch['labels'] != -100).sum(), or leave "
                "count_unit='samples'"
            )
        return output

    counted.counts_tokens = True  # type: ignore[attr-defined]
    return counted


def _a(name: str) -> str:
    """``an Adam``, ``a SmallCNN``."""
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _unbound(function: Callable[..., Any], count: int) -> list[str] | None:
    """The required parameters of ``function`` that ``count`` positional arguments leave
    without a value, or None when such a call binds (or the signature cannot be read:
    builtins and C extensions are given the benefit of the doubt)."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(*range(count))
    except TypeError:
        required = [
            name
            for name, parameter in signature.parameters.items()
            if parameter.default is parameter.empty
            and parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)
        ]
        return required[count:]
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def load_recipe(spec: str) -> Recipe:
    """Load ``path/to/file.py:function`` or ``package.module:function`` and call it.

    The function takes no arguments and returns a :class:`Recipe`. A file's folder goes on
    ``sys.path`` first, as for a script: the recipe may import from the modules beside it.
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
    recipe = call_user("the recipe function", func)
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
    # As `python my_recipe.py` would: the recipe's folder is importable, so that it can import
    # the model and dataset from the training script beside it.
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        failure = user_code_failure(err) or describe_exception(err)
        raise RecipeError(f"recipe file {path_str!r} failed to import: {failure}") from err
    return module


def _import_module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise RecipeError(f"recipe module {name!r} cannot be imported: {err}") from err


# --- the boundary around user code ---------------------------------------------------------

#: One line of an error message at most this long: the rest of a torch message is detail.
_MAX_MESSAGE = 300
_FETCH = str(Path("torch", "utils", "data", "_utils", "fetch.py"))
_COLLATE = str(Path("torch", "utils", "data", "_utils", "collate.py"))
#: What a user function is, by the torchturbo function that called it.
_ROLES = {"call_loss_fn": "loss_fn"}
_WORKER_FRAME = re.compile(r'File "(?P<file>.+?)", line (?P<line>\d+), in (?P<name>\S+)')


def call_user(role: str, function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)``; what it raises becomes a :class:`UserCodeError` naming ``role``.

    torchturbo's own errors, raised by torchturbo code the user's function called, pass through:
    their message already says what to fix.
    """
    try:
        return function(*args)
    except Exception as err:
        if is_torchturbo_error(err):
            raise
        raise UserCodeError(
            f"{role} {describe_callable(function)} raised {describe_exception(err)}"
        ) from err


def is_torchturbo_error(err: BaseException) -> bool:
    """Whether ``err`` is one of torchturbo's error types, whose message is written for users."""
    return type(err).__module__.split(".")[0] == "torchturbo"


def describe_callable(function: Any) -> str:
    """``make_model (recipe.py:12)``, ``<lambda> (recipe.py:30)`` or ``TinyConv``."""
    while isinstance(function, functools.partial):
        function = function.func
    code = getattr(function, "__code__", None)
    name = getattr(function, "__qualname__", None) or type(function).__name__
    return f"{name} ({Path(code.co_filename).name}:{code.co_firstlineno})" if code else name


def describe_exception(err: BaseException) -> str:
    """``KeyError: 'y'``: the type and the first line of the message, cut short."""
    lines = str(err).strip().splitlines()
    text = f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
    return text if len(text) <= _MAX_MESSAGE else text[: _MAX_MESSAGE - 3] + "..."


def user_code_failure(err: BaseException) -> str | None:
    """One line naming the user function that raised ``err``, or None if none did.

    A failure inside the DataLoader's fetch (``dataset[i]`` or the collate function, in the
    training process or a worker) names which of the two failed; otherwise the outermost frame
    of the user's own files is the function torchturbo called, and the innermost one is where
    it failed. None means no user code is on the traceback: the error is torchturbo's or torch's.
    """
    worker = _worker_traceback(err)
    if worker is not None:
        frames, raised = worker
    else:
        frames = [_frame(f, line) for f, line in traceback.walk_tb(err.__traceback__)]
        raised = describe_exception(err)
    fetch = [i for i, (file, _, _) in enumerate(frames) if file.endswith(_FETCH)]
    if fetch:
        return (
            f"the data loader could not build a batch: {_fetched(frames[fetch[-1] + 1 :], raised)}"
        )
    first = next((i for i, frame in enumerate(frames) if _is_user_file(frame[0])), None)
    if first is None:
        return None
    caller = frames[first - 1][2] if first > 0 else ""
    entry = f"{_ROLES[caller]} {frames[first][2]}" if caller in _ROLES else frames[first][2]
    file, line, name = [frame for frame in frames if _is_user_file(frame[0])][-1]
    where = f"{Path(file).name}:{line}" + (f" in {name}" if name != frames[first][2] else "")
    return f"{entry} raised {raised} ({where})"


def _frame(frame: Any, line: int) -> tuple[str, int, str]:
    code = frame.f_code
    return code.co_filename, line, getattr(code, "co_qualname", code.co_name)


def _worker_traceback(err: BaseException) -> tuple[list[tuple[str, int, str]], str] | None:
    """(frames, "Type: message") of an exception re-raised from a DataLoader worker, whose
    traceback in this process ends in torch; the worker's traceback is in the message."""
    text = str(err)
    if not (text.startswith("Caught ") and " in DataLoader worker process " in text):
        return None
    frames = [(m["file"], int(m["line"]), m["name"]) for m in _WORKER_FRAME.finditer(text)]
    raised = text.strip().splitlines()[-1].strip()
    return frames, raised[:_MAX_MESSAGE]


def _fetched(inner: list[tuple[str, int, str]], raised: str) -> str:
    """Which of the dataset and the collate function raised, from the frames past fetch."""
    inner = [frame for frame in inner if not frame[0].endswith(_FETCH)]
    if not inner:
        return f"indexing the dataset raised {raised}"
    file, line, name = inner[0]
    if name.split(".")[-1] in ("__getitem__", "__getitems__"):
        return f"the dataset's {name} ({Path(file).name}:{line}) raised {raised}"
    if file.endswith(_COLLATE):
        return (
            f"torch's default_collate raised {raised}; the samples must have one structure of "
            "tensors, numbers and dicts/lists of them, or the Recipe needs a collate function"
        )
    if Path(file).resolve().is_relative_to(Path(__file__).resolve().parent):
        return (
            f"torchturbo's default collate {name} raised {raised}; for other samples give the "
            "Recipe a collate function"
        )
    return f"the collate function {name} ({Path(file).name}:{line}) raised {raised}"


@functools.cache
def _library_dirs() -> tuple[Path, ...]:
    """Where installed code lives: the standard library, site-packages, torchturbo itself."""
    paths = sysconfig.get_paths()
    dirs = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths}
    dirs.update(site.getsitepackages())
    dirs.update((str(Path(__file__).parent), str(Path(torch.__file__).parent)))
    return tuple(Path(d).resolve() for d in sorted(dirs))


def _is_user_file(filename: str) -> bool:
    """A real file outside the standard library, installed packages and torchturbo."""
    if filename.startswith("<"):  # <frozen importlib._bootstrap>, <string>, ...
        return False
    path = Path(filename).resolve()
    return not any(path.is_relative_to(directory) for directory in _library_dirs())
