"""Hugging Face ``Trainer`` integration: tune a Trainer setup, then train it with the result.

- :func:`recipe_from_trainer`: the Trainer's model (or ``model_init``), optimizer settings, train
  dataset, data collator and batch size as a :class:`~torchturbo.recipe.Recipe` that ``tune``,
  ``bench`` and ``doctor`` accept, with per-sample lengths for dynamic batching and the Trainer's
  own loss, weighted by label tokens.
- :func:`training_arguments`: the ``TrainingArguments`` keywords that realise a turbo.toml, with a
  note for every setting that has no Trainer argument (see ``translate.py``).
- :class:`TurboCallback`: every technique the Trainer's arguments do not carry, applied by the
  engine's own function (``techniques/registry.compose_model``, in its order) and its
  process-wide switches held while training runs.
- :class:`TurboTrainer`: a ``Trainer`` that also replaces the sampler by token-budget length
  buckets or packed rows and registers the DDP comm hook, both of which live below the
  Trainer's arguments, and stops on the stop signals after the step under way, saved as its own
  checkpoint (:class:`PreemptionCallback`, which a plain Trainer can take too).

Needs ``pip install 'torchturbo[transformers]'`` (transformers and accelerate).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import itertools
import math
import os
import re
import warnings
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

try:
    from transformers import Trainer, TrainerCallback, default_data_collator
    from transformers.trainer_utils import TrainOutput
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "torchturbo.integrations.transformers needs transformers and accelerate: "
        "pip install 'torchturbo[transformers]'"
    ) from err

from torchturbo.base.device import model_device, to_device
from torchturbo.config import DistributedConfig, TurboConfig
from torchturbo.data.batch_plan import BatchSource
from torchturbo.data.collate import IGNORE_INDEX
from torchturbo.data.length import length_or_none
from torchturbo.engine import in_run
from torchturbo.engine.in_run import InRunTuner, WindowClock
from torchturbo.integrations.lengths import sample_lengths
from torchturbo.integrations.optimizers import clone_optimizer, parameter_owner
from torchturbo.integrations.stopping import StopWatch, TrainerStopped, announce
from torchturbo.integrations.translate import Translation, hf_arguments
from torchturbo.recipe import Recipe, RecipeError
from torchturbo.techniques import registry
from torchturbo.techniques.framework.result import TechniqueResult, reasons

__all__ = [
    "PreemptionCallback",
    "TurboCallback",
    "TurboTrainer",
    "recipe_from_trainer",
    "training_arguments",
]


def training_arguments(config: TurboConfig) -> Translation:
    """``TrainingArguments`` keywords realising ``config`` (``.kwargs``), and ``.notes``.

    >>> settings = training_arguments(TurboConfig.load("turbo.toml"))
    >>> args = TrainingArguments(output_dir="out", per_device_train_batch_size=16,
    ...                          **settings.kwargs)
    """
    return hf_arguments(config)


# --- the Trainer's setup as a recipe --------------------------------------------------------


def recipe_from_trainer(trainer: Trainer, *, name: str | None = None) -> Recipe:
    """A Recipe of what ``trainer`` would train: call it before ``trainer.train()``.

    The model factory calls ``model_init`` when the Trainer has one, else copies the model as it
    is now (so every trial starts from these weights). The optimizer is the one the Trainer
    would build from its arguments (AdamW variants, weight decay off for biases and norms), or a
    rebuild of one passed through ``optimizers=``. ``loss_fn`` is the Trainer's own
    ``compute_loss`` (the model's loss, label smoothing, ``compute_loss_func``), returned with
    the number of labels that count (not -100; shifted for causal LMs as the Trainer shifts them),
    so that accumulation weighs tokens. Lengths come from the dataset's length column or
    ``input_ids``; the collator drops the columns the model does not take, as the Trainer does.
    """
    dataset = trainer.train_dataset
    if dataset is None:
        raise RecipeError("recipe_from_trainer: the Trainer has no train_dataset to tune on")
    model = trainer.model
    if model is None:  # Trainer.__init__ sets it, from model_init when there is one
        raise RecipeError("recipe_from_trainer: the Trainer has no model")
    args = trainer.args
    collate = model_input_collate(trainer.data_collator, model, args)
    factories = _Factories(trainer, model)
    probe = collate(_first_samples(dataset, 2))
    labels = probe.get("labels")
    per_token = isinstance(labels, torch.Tensor) and labels.dim() >= 2
    planned, source = planned_trainer_steps(args, length_or_none(dataset))
    return Recipe(
        name=name or type(model).__name__,
        model=factories.model,
        optimizer=factories.optimizer,
        loss_fn=functools.partial(_trainer_loss, trainer),
        dataset=dataset,
        batch_size=args.per_device_train_batch_size,
        collate=collate,
        lengths=sample_lengths(dataset, length_column=args.length_column_name),
        count_unit="tokens" if per_token else "samples",
        seed=args.seed,
        planned_steps=planned,
        planned_steps_source=source,
    )


def planned_trainer_steps(args: Any, samples: int | None) -> tuple[int | None, str]:
    """The batches per process ``Trainer.train()`` will run with ``args`` (the tuner's steps),
    and where that came from: ``max_steps`` when set, else ``num_train_epochs`` x the optimizer
    steps of an epoch (its batches per process over the accumulation, as the Trainer counts
    them), x the accumulation. None for a stream without ``max_steps``."""
    accumulation = max(1, args.gradient_accumulation_steps)
    per_window = f" x gradient_accumulation_steps={accumulation}" if accumulation > 1 else ""
    if args.max_steps > 0:
        steps = args.max_steps * accumulation
        return steps, f"the Trainer's max_steps={args.max_steps}{per_window}"
    if samples is None:
        return None, ""
    world = max(1, args.world_size)
    per_process = math.ceil(samples / world)
    batch = args.per_device_train_batch_size
    batches = per_process // batch if args.dataloader_drop_last else math.ceil(per_process / batch)
    updates = max(1, batches // accumulation)
    optimizer_steps = math.ceil(args.num_train_epochs * updates)
    processes = f" on {world} processes" if world > 1 else ""
    return optimizer_steps * accumulation, (
        f"the Trainer's num_train_epochs={args.num_train_epochs:g} x {updates} optimizer "
        f"steps per epoch{processes}{per_window}"
    )


def _first_samples(dataset: Any, count: int) -> list[Any]:
    """The first ``count`` samples of a map-style dataset or of a stream (an IterableDataset,
    which a Hugging Face ``datasets.IterableDataset`` is when torch is installed)."""
    if isinstance(dataset, IterableDataset):
        return list(itertools.islice(dataset, count))
    size = length_or_none(dataset)
    if size is None:
        raise RecipeError(
            f"recipe_from_trainer: the Trainer's train_dataset ({type(dataset).__name__}) has no "
            "len() and is no IterableDataset: give a map-style dataset or a stream"
        )
    return [dataset[i] for i in range(min(count, size))]


class _Factories:
    """The recipe's model and optimizer factories; the optimizer is built over the model built
    last, whose parameter names decide weight decay."""

    def __init__(self, trainer: Trainer, model: nn.Module) -> None:
        self.trainer = trainer
        # Snapshot now: trainer.train() would move these weights before the tuner reads them.
        self.initial = None if trainer.model_init is not None else copy.deepcopy(model)
        self.template = trainer.optimizer  # one passed by optimizers=(...), else None
        self.template_model = model
        self.last: nn.Module | None = None

    def model(self) -> nn.Module:
        """A fresh model as the Trainer trains it: from ``model_init`` or the snapshot, with the
        Trainer's ``use_cache`` (transformers 5 sets it on the model it trains; a Llama config's
        own ``use_cache=True`` makes a cache and skips the packed-sequence mask)."""
        if self.initial is None:
            self.last = self.trainer.call_model_init()
        else:
            self.last = copy.deepcopy(self.initial)
        return as_trained(self.last, self.trainer.args)

    def optimizer(self, params: Any) -> torch.optim.Optimizer:
        model = parameter_owner(params, self.last)
        if self.template is not None:
            template = getattr(self.template, "optimizer", self.template)  # accelerate's wrapper
            return clone_optimizer(template, self.template_model, model)
        return trainer_optimizer(self.trainer, model)


def as_trained(model: nn.Module, args: Any) -> nn.Module:
    """``model`` with the Trainer's ``use_cache``, as ``Trainer.train`` sets it on the model it
    trains (transformers 5; a Llama config's own ``use_cache=True`` makes a cache and skips the
    packed-sequence mask). What the packing check must see, in the tuner's recipe and in
    ``TurboTrainer`` alike, also for a model that ``model_init`` built just now."""
    config = getattr(model, "config", None)
    use_cache = getattr(args, "use_cache", None)
    if config is not None and use_cache is not None:
        config.use_cache = use_cache
    return model


def trainer_optimizer(trainer: Trainer, model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer ``Trainer.create_optimizer`` builds by default, over ``model``: weight decay
    on all but biases and norm weights, the class and settings from ``optim`` and friends."""
    preset = getattr(trainer, "optimizer_cls_and_kwargs", None)
    if preset is not None:
        optimizer_cls, optimizer_kwargs = preset
    else:
        # transformers annotates model as a PreTrainedModel; create_optimizer passes any module.
        optimizer_cls, optimizer_kwargs = Trainer.get_optimizer_cls_and_kwargs(
            trainer.args,
            model,  # type: ignore[arg-type]
        )
    decay = set(trainer.get_decay_parameter_names(model))
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {
            "params": [p for n, p in trainable if n in decay],
            "weight_decay": trainer.args.weight_decay,
        },
        {"params": [p for n, p in trainable if n not in decay], "weight_decay": 0.0},
    ]
    return optimizer_cls([g for g in groups if g["params"]], **optimizer_kwargs)


def model_input_collate(
    collate: Callable[[list[Any]], Any], model: nn.Module, args: Any
) -> Callable[[list[Any]], dict[str, Any]]:
    """``collate`` applied to samples stripped of the keys the model's ``forward`` does not take
    (a "length" column, raw text), as the Trainer strips them with ``remove_unused_columns``;
    the batch comes back as a plain dict."""
    keep = None
    if args.remove_unused_columns:
        keep = frozenset(
            [
                *inspect.signature(model.forward).parameters,
                "label",
                "label_ids",
                *(args.label_names or ["labels"]),
            ]
        )
    return functools.partial(_collate_columns, collate, keep)


def _collate_columns(
    collate: Callable[[list[Any]], Any], keep: frozenset[str] | None, samples: list[Any]
) -> dict[str, Any]:
    if keep is not None:
        samples = [
            {k: v for k, v in s.items() if k in keep} if isinstance(s, Mapping) else s
            for s in samples
        ]
    return dict(collate(samples))


def _trainer_loss(trainer: Trainer, model: nn.Module, batch: dict[str, Any]) -> Any:
    """The Trainer's ``compute_loss`` on ``batch``, and the count of labels it averages over."""
    # compute_loss pops "labels" for label smoothing: give it a copy, the batch is reused.
    loss = trainer.compute_loss(model, dict(batch))
    labels = batch.get("shift_labels")
    if labels is None and isinstance(batch.get("labels"), torch.Tensor):
        labels = batch["labels"]
        # Causal LMs predict token i+1 at position i: the first label of a row is never a target.
        if getattr(trainer, "_loss_shifts_labels", False):
            labels = labels[..., 1:]
    if labels is None:
        return loss
    return loss, (labels != IGNORE_INDEX).sum()


# --- training with the tuned settings -------------------------------------------------------


class TurboCallback(TrainerCallback):
    """Apply what ``TrainingArguments`` cannot express, once the Trainer holds the model.

    The model transforms the arguments do not carry (float8, channels_last, checkpointing by
    module type: each technique's ``carried_by`` says what the Trainer does itself) are applied
    by ``registry.compose_model``, the engine's function and order, at the end of the Trainer's
    ``__init__`` (before accelerate compiles or wraps the model), and at ``train()`` to a model
    that ``model_init`` built there (each model once). The techniques' process-wide switches
    (cuDNN autotuning, the compile cache) are held from the start of training to its end.
    ``results`` holds each technique's :class:`TechniqueResult`, as ``Turbo.results`` does;
    ``applied`` says, per technique, None when applied or why not.
    """

    def __init__(self, config: TurboConfig) -> None:
        self.config = config
        self.results: dict[str, TechniqueResult] = {}
        self._switches = contextlib.ExitStack()
        # Models already transformed: float8 would wrap its own Float8Linear (an nn.Linear) again.
        self._transformed: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    @property
    def applied(self) -> dict[str, str | None]:
        """Technique -> None when it took effect, else why not (``Turbo.applied``'s shape)."""
        return reasons(self.results)

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._transform(kwargs.get("model"))

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._transform(kwargs.get("model"))
        self._switches.close()
        self._switches.enter_context(
            registry.held_switches(self.config, args.device, "transformers", self.results)
        )

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._switches.close()

    def _transform(self, model: nn.Module | None) -> None:
        if model is None or model in self._transformed:
            return
        self._transformed.add(model)
        self.results |= registry.compose_model(
            model, self.config, model_device(model), "transformers"
        )


class _WindowEnd(TrainerCallback):
    """Tells a :class:`TurboTrainer` tuning inside its run that an optimizer step ended."""

    def __init__(self, trainer: TurboTrainer) -> None:
        self.trainer = weakref.ref(trainer)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self.trainer()
        if trainer is not None:
            trainer.close_window()


class PreemptionCallback(TrainerCallback):
    """Stop on SIGTERM, SIGUSR1, SIGUSR2 or Ctrl-C after the optimizer step under way (every
    rank the same one under torchrun), saved as the Trainer's own ``checkpoint-N``, which
    ``trainer.train(resume_from_checkpoint=True)`` continues from; then ``train()`` raises
    :class:`~torchturbo.integrations.stopping.TrainerStopped` (exit status 75).

    The plain Trainer dies of SIGTERM (-15) and loses every step since its last ``save_steps``.
    :class:`TurboTrainer` adds this callback; add it to a plain ``Trainer`` with
    ``callbacks=[PreemptionCallback()]``. ``grace_s`` stops at once that long after the first
    signal (``[reliability] stop_grace_s``). With ``enable_jit_checkpoint=True`` SIGTERM stays
    the Trainer's own (its handler is left alone), which saves at the next step hook it meets,
    also between backward and the optimizer step.
    """

    def __init__(self, grace_s: float = 0.0) -> None:
        self.watch = StopWatch(grace_s)
        self.stopped: TrainerStopped | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.stopped = None
        self.watch.start()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # After the optimizer step (the Trainer calls on_substep_end inside a window) and before
        # the Trainer's own save of this step: it saves when told to, whatever save_strategy.
        if self.stopped is None and self.watch.should_stop(args.device):
            control.should_save = True
            control.should_training_stop = True
            checkpoint = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            self.stopped = TrainerStopped(
                self.watch.signal_name,
                state.global_step,
                checkpoint,
                "run the same script with trainer.train(resume_from_checkpoint=True)",
            )

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.watch.close()
        if self.stopped is not None:
            announce(self.stopped.line, args.process_index)
            raise self.stopped


class TurboTrainer(Trainer):
    """A ``Trainer`` that applies a whole turbo.toml: pass ``turbo_config=`` and
    ``args=TrainingArguments(..., **training_arguments(config).kwargs)``.

    On top of the plain Trainer it adds :class:`TurboCallback`, trains on the config's batch plan
    when ``[data] batches`` is buckets or packed (``data/batch_plan.py``: length buckets, or
    packed rows once the model passes the isolation check, the Trainer's padding collator then
    unused; either way holding the real tokens of ``per_device_train_batch_size`` rows per step
    on average, so ``max_steps`` trains on the same data), and registers ``[distributed]``'s DDP
    comm hook and bucket view through accelerate.

    With ``[tune] in_run`` the facts measured before the Trainer is built choose where the run
    starts (``in_run.start``: bf16 where its matrix products are fast here, length buckets where
    the train dataset's lengths pad heavily): ``args`` are rebuilt with what the started config
    translates to, and ``in_run`` holds what was decided, written with every reason to
    ``<output_dir>/tuned`` (results.json, turbo.toml) when training begins and ends. A
    transform that can be switched off between steps (the chunked loss) is measured on the
    job's own steps, each optimizer step's window on the side the in-run tuner names; the
    precision is not, since the Trainer's autocast is accelerate's wrapper of the model's
    forward, fixed for the run.
    """

    def __init__(
        self, *args: Any, turbo_config: TurboConfig, stop_on_signals: bool = True, **kwargs: Any
    ) -> None:
        self.in_run: InRunTuner | None = None
        self._windows: WindowClock | None = None
        self._side_config: TurboConfig | None = None
        composing = turbo_config
        if turbo_config.tune.in_run:
            turbo_config, args, kwargs = self._start_in_run(turbo_config, args, kwargs)
            assert self.in_run is not None
            composing = self.in_run.composed_config()
        # Set before Trainer.__init__, which creates the accelerator (see below).
        self.turbo_config = turbo_config
        self.turbo_callback = TurboCallback(composing)
        callbacks = [*(kwargs.get("callbacks") or []), self.turbo_callback]
        if self.in_run is not None:
            callbacks.append(_WindowEnd(self))
        if stop_on_signals:
            callbacks.append(PreemptionCallback(turbo_config.reliability.stop_grace_s))
        kwargs["callbacks"] = callbacks
        super().__init__(*args, **kwargs)

    def _start_in_run(
        self, config: TurboConfig, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[TurboConfig, tuple[Any, ...], dict[str, Any]]:
        """The started config, and the Trainer's arguments with its ``args`` rebuilt to say
        what the started config adds (``bf16=True``, length grouping)."""
        bound = inspect.signature(Trainer.__init__).bind_partial(self, *args, **kwargs)
        given = bound.arguments
        training_args, dataset = given.get("args"), given.get("train_dataset")
        if training_args is None:
            raise ValueError(
                "[tune] in_run needs args=TrainingArguments(...): the precision it starts "
                "from is set in them"
            )
        lengths = None
        if dataset is not None:
            lengths = sample_lengths(dataset, length_column=training_args.length_column_name)
        seed = training_args.data_seed
        model = given.get("model")
        self.in_run = in_run.start(
            config,
            model,
            training_args.device,
            data=dataset,
            lengths=lengths,
            batch_size=training_args.per_device_train_batch_size,
            seed=training_args.seed if seed is None else seed,
            planned_steps=planned_trainer_steps(training_args, length_or_none(dataset))[0],
            # The Trainer's autocast is accelerate's: only transforms switch per step here.
            switchable=registry.switchable_by_toggle,
            forward=_census(model, dataset, given.get("data_collator"), training_args),
        )
        before = hf_arguments(config).kwargs
        after = hf_arguments(self.in_run.config).kwargs
        changes = {k: v for k, v in after.items() if before.get(k) != v}
        if changes:
            given["args"] = dataclasses.replace(training_args, **changes)
        for event in self.in_run.events:
            announce(event, training_args.process_index)
        self._told = len(self.in_run.events)
        self._windows = WindowClock(self.in_run, training_args.device)
        return self.in_run.config, bound.args[1:], bound.kwargs

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
    ) -> TrainOutput:
        """``Trainer.train``; ``resume_from_checkpoint=True`` skips, with a warning, checkpoints
        that a kill during the Trainer's save left without ``trainer_state.json`` (written last),
        which the Trainer would pick as the newest and fail to read."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = last_complete_checkpoint(self.args.output_dir or "")
            if resume_from_checkpoint is None:
                raise ValueError(
                    f"resume_from_checkpoint=True: no complete checkpoint-* in "
                    f"{self.args.output_dir!r} (one with a trainer_state.json)"
                )
        self._keep_decided()
        try:
            return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval)
        finally:
            self._keep_decided()

    def _keep_decided(self) -> None:
        if self.in_run is not None and self.is_world_process_zero():
            self.in_run.write(Path(self.args.output_dir or ".") / "tuned")

    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        """The Trainer's step; with ``[tune] in_run`` the first micro-batch of each optimizer
        step opens its window on the side the in-run tuner names."""
        if self._windows is not None:
            if not self._windows.is_open:
                parity = functools.partial(self._parity_losses, model, inputs)
                self._switch(model, self._windows.open(parity))
            self._windows.add(inputs)
        return super().training_step(model, inputs, num_items_in_batch)

    def _switch(self, model: nn.Module, config: TurboConfig) -> None:
        """Switch ``model``'s transforms as ``config`` asks (nothing for the config already in
        use: every window once decided)."""
        if config is not self._side_config:
            self._side_config = config
            registry.set_toggles(model, config)

    def close_window(self) -> None:
        """The optimizer step ended: its window is timed, if it was measured, and judged."""
        if self.in_run is None or self._windows is None:
            return
        self._windows.close()
        self.turbo_config = self.in_run.config
        for event in self.in_run.events[self._told :]:
            announce(event, self.args.process_index)
        self._told = len(self.in_run.events)

    def _parity_losses(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        with_config: TurboConfig,
        without: TurboConfig,
    ) -> tuple[float, float]:
        """The Trainer's loss on ``inputs`` with each side's transforms
        (``in_run.same_batch_losses``)."""

        def loss_under(config: TurboConfig) -> float:
            registry.set_toggles(model, config)
            with self.compute_loss_context_manager():
                loss = self.compute_loss(model, dict(inputs))
            return float(loss[0] if isinstance(loss, tuple) else loss)

        return in_run.same_batch_losses(model, self.args.device, loss_under, with_config, without)

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        configure_ddp_handler(self.accelerator, self.turbo_config.distributed)
        dynamic = self.turbo_config.compile.dynamic
        if self.args.torch_compile and dynamic is not None:
            # TrainingArguments has no dynamic-shapes argument; accelerate's plugin compiles
            # with this one. Varying lengths compiled dynamic do not recompile per length.
            self.accelerator.state.dynamo_plugin.dynamic = dynamic

    def get_train_dataloader(self) -> DataLoader:
        if not registry.plans_batches(self.turbo_config) or self.train_dataset is None:
            return super().get_train_dataloader()
        return self.accelerator.prepare(self._sampled_loader(self.train_dataset))

    def _sampled_loader(self, dataset: Dataset) -> DataLoader:
        """The config's batch plan (length buckets or packed rows), built as the engine and the
        tuner's trials build it: the same batches for the same config and seed."""
        args = self.args
        assert self.model is not None  # Trainer.__init__ sets it, from model_init when given
        # train() may have just built it from model_init, before it sets use_cache on it.
        model = as_trained(self.model, args)
        lengths = sample_lengths(dataset, length_column=args.length_column_name)
        seed = args.data_seed if args.data_seed is not None else args.seed
        # One replica: accelerate shards whole batches across processes itself.
        source = BatchSource(
            dataset,
            lengths,
            args.train_batch_size,
            seed=seed,
            collate=model_input_collate(self.data_collator, model, args),
            model=lambda: model,
            lengths_from=(
                f"give the train dataset 'input_ids' or a {args.length_column_name!r} column"
            ),
        )
        plan = registry.batch_plan(self.turbo_config, source)
        return plan.loader(
            dataset,
            num_workers=args.dataloader_num_workers,
            pin_memory=args.dataloader_pin_memory,
            persistent_workers=args.dataloader_persistent_workers,
            prefetch_factor=args.dataloader_prefetch_factor,
        )


def _census(
    model: nn.Module | None, dataset: Any, collator: Any, args: Any
) -> Callable[[], Any] | None:
    """One forward of ``model`` on the first samples of ``dataset`` as the Trainer collates
    them, for the start's logits census; None without a model or a map-style dataset."""
    if model is None or dataset is None or isinstance(dataset, IterableDataset):
        return None
    size = length_or_none(dataset) or 0
    if not size:
        return None
    collate = model_input_collate(collator or default_data_collator, model, args)
    samples = [dataset[i] for i in range(min(in_run.CENSUS_SAMPLES, size))]
    batch = to_device(collate(samples), model_device(model))
    return functools.partial(model, **batch)


def last_complete_checkpoint(output_dir: str) -> str | None:
    """The newest ``checkpoint-N`` of ``output_dir`` whose ``trainer_state.json`` (the file the
    Trainer's save writes last) is there; each newer one without it is skipped with a warning."""
    if not os.path.isdir(output_dir):
        return None
    steps = sorted(
        (int(match[1]), name)
        for name in os.listdir(output_dir)
        if (match := re.fullmatch(r"checkpoint-(\d+)", name))
        and os.path.isdir(os.path.join(output_dir, name))
    )
    for _, name in reversed(steps):
        path = os.path.join(output_dir, name)
        if os.path.isfile(os.path.join(path, "trainer_state.json")):
            return path
        warnings.warn(
            f"{path} has no trainer_state.json (a save cut short): resuming from an earlier "
            "checkpoint",
            RuntimeWarning,
            stacklevel=3,
        )
    return None


def configure_ddp_handler(accelerator: Any, config: DistributedConfig) -> None:
    """Put ``config``'s comm hook and gradient bucket view into accelerate's DDP settings,
    which it applies when it wraps the model (the Trainer's arguments cannot set them)."""
    from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

    if accelerator.ddp_handler is None:
        accelerator.ddp_handler = DistributedDataParallelKwargs()
    handler = accelerator.ddp_handler
    handler.gradient_as_bucket_view = config.gradient_as_bucket_view
    hook, _, wrapper = config.comm_hook.partition("_")
    hooks = {
        "none": DDPCommunicationHookType.NO,
        "fp16": DDPCommunicationHookType.FP16,
        "bf16": DDPCommunicationHookType.BF16,
        "powersgd": DDPCommunicationHookType.POWER_SGD,
    }
    handler.comm_hook = hooks[hook]
    handler.comm_wrapper = hooks[wrapper] if wrapper else DDPCommunicationHookType.NO
    if hook == "powersgd":
        handler.comm_state_option = {
            "matrix_approximation_rank": config.powersgd_rank,
            "start_powerSGD_iter": config.powersgd_warmup,
        }
