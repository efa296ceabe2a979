"""Lightning integration: tune a LightningModule, then train it with Lightning's own Trainer.

- :func:`recipe_from_lightning`: a LightningModule and its data (a LightningDataModule or the
  module's own ``train_dataloader``) as a :class:`~torchturbo.recipe.Recipe` for ``tune``,
  ``bench`` and ``doctor``: the loss is the module's ``training_step``, the optimizer the one
  ``configure_optimizers`` builds.
- :func:`trainer_kwargs`: the ``lightning.Trainer`` keywords that realise a turbo.toml (precision,
  accumulation, clipping, cuDNN autotuning, the DDP strategy with its comm hook and buckets), with
  notes for what Lightning has no keyword for (see ``translate.py``).
- :class:`TurboLightningCallback`: the model transforms, applied in ``setup`` (before Lightning
  wraps the model for DDP and calls ``configure_optimizers``) by the function the engine and so
  the tuner use (``techniques/registry.compose_model``), in its order; the techniques'
  process-wide switches held from setup to teardown; and the config's batch plan (length
  buckets, packed rows: ``registry.batch_plan``, as the engine and the tuner's trials build it)
  in place of the train DataLoader's sampler and collate; and preemption: on SIGTERM,
  SIGUSR1, SIGUSR2 or Ctrl-C the step under way is saved as Lightning's ``hpc_ckpt_N.ckpt``,
  which ``fit(ckpt_path="hpc")`` resumes, and the run exits 75. With ``[tune] in_run`` it tunes
  while Lightning trains (``engine/in_run.py``): the facts choose the start in ``setup``, and
  the precision is measured on the job's own steps by swapping Lightning's precision plugin
  per accumulation window.

Needs ``pip install 'torchturbo[lightning]'`` (the ``lightning`` package; the standalone
``pytorch_lightning`` package has its own, incompatible Callback class).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

try:
    import lightning.pytorch as pl
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "torchturbo.integrations.lightning needs Lightning: pip install 'torchturbo[lightning]'"
    ) from err

from torchturbo.base.device import model_device, to_device
from torchturbo.config import DistributedConfig, TurboConfig
from torchturbo.data.batch_plan import BatchSource
from torchturbo.data.collate import IGNORE_INDEX
from torchturbo.data.length import length_or_none
from torchturbo.distributed.ddp import COMM_HOOKS, check_comm_hook
from torchturbo.engine import in_run
from torchturbo.engine.in_run import InRunTuner, WindowClock
from torchturbo.engine.loader import first_samples_batch
from torchturbo.integrations.lengths import sample_lengths
from torchturbo.integrations.optimizers import clone_optimizer, parameter_owner
from torchturbo.integrations.stopping import StopWatch, TrainerStopped, announce
from torchturbo.integrations.translate import DDPSpec, Translation, lightning_arguments
from torchturbo.recipe import Recipe, RecipeError
from torchturbo.reliability.random_state import capture_random_state, restore_random_state
from torchturbo.techniques import registry
from torchturbo.techniques.framework.result import TechniqueResult, applied, reasons

__all__ = ["TurboLightningCallback", "recipe_from_lightning", "trainer_kwargs"]

#: Lightning's signal handlers (``_SignalConnector``), which the callback replaces while fitting.
_LIGHTNING_SIGNALS = "lightning.pytorch.trainer.connectors.signal_connector"


def trainer_kwargs(config: TurboConfig) -> Translation:
    """``lightning.Trainer`` keywords realising ``config`` (``.kwargs``), and ``.notes``.

    >>> settings = trainer_kwargs(TurboConfig.load("turbo.toml"))
    >>> trainer = L.Trainer(max_epochs=3, callbacks=[TurboLightningCallback(config)],
    ...                     **settings.kwargs)
    """
    translation = lightning_arguments(config)
    kwargs = dict(translation.kwargs)
    if isinstance(kwargs.get("strategy"), DDPSpec):
        kwargs["strategy"] = ddp_strategy(kwargs["strategy"])
    return Translation(kwargs, translation.notes)


def ddp_strategy(spec: DDPSpec) -> pl.strategies.DDPStrategy:
    """Lightning's DDPStrategy with the spec's buckets and torch's comm hook of that name."""
    options: dict[str, Any] = {
        "bucket_cap_mb": spec.bucket_cap_mb,
        "gradient_as_bucket_view": spec.gradient_as_bucket_view,
        "static_graph": spec.static_graph,
    }
    if spec.comm_hook != "none":
        make_state, hook = COMM_HOOKS[spec.comm_hook]
        settings = DistributedConfig(
            comm_hook=spec.comm_hook,
            powersgd_rank=spec.powersgd_rank,
            powersgd_warmup=spec.powersgd_warmup,
        )
        options |= {"ddp_comm_hook": hook, "ddp_comm_state": make_state(settings)}
    return pl.strategies.DDPStrategy(**options)


class TurboLightningCallback(pl.Callback):
    """Apply a turbo.toml's techniques to the LightningModule when ``fit`` sets up.

    The model transforms are the engine's, by the same function and in the same order
    (``registry.compose_model``): each technique says why its place (channels_last and
    checkpointing before compile, compile before Lightning wraps the module for DDP). Compile is
    in place on the module (``nn.Module.compile``), so ``self(x)`` in ``training_step`` runs
    compiled, as it does in the tuner. The techniques' process-wide switches (TF32, the compile
    cache) are held from setup to teardown; what Lightning's own arguments carry
    (``Trainer(precision=..., benchmark=True)``) is left to them. Under DDP on a CPU it registers
    the comm hook, which Lightning itself registers on CUDA only. Layers created in
    ``configure_model`` come after ``setup`` and are not transformed. ``results`` holds each
    technique's :class:`TechniqueResult`, as ``Turbo.results`` does; ``applied`` says, per
    technique, None when applied or why not.

    With a batch plan (``[data] batches`` buckets or packed) the train DataLoader that
    ``train_dataloader()`` returns (the datamodule's, else the module's) is rebuilt on the
    config's batch plan: the same dataset, collate and worker settings, its batches those the
    tuner measured for this config and ``seed`` (``recipe_from_lightning``'s recipes use seed
    0). Each rank takes its share of whole batches: under DDP pass
    ``use_distributed_sampler=False`` (``trainer_kwargs`` does).

    With ``[tune] in_run`` the facts measured in ``setup`` choose the config the run starts
    from (``in_run.start``: bf16 where it is fast here, length buckets where lengths pad
    heavily), and each accumulation window runs on the side the in-run tuner names, by
    swapping the strategy's precision plugin: the job's own steps decide whether the precision
    stays. ``in_run`` holds the tuner; its verdicts and the decided config are written to
    ``<default_root_dir>/tuned`` at the end, and Lightning's checkpoints keep its state."""

    def __init__(self, config: TurboConfig, *, seed: int = 0, stop_on_signals: bool = True) -> None:
        self.config = config
        self.seed = seed
        self.results: dict[str, TechniqueResult] = {}
        self._switches = contextlib.ExitStack()
        self._restore: tuple[Any, Any] | None = None
        # Lightning's own handlers stop after the batch (mid-window) and save nothing on
        # SIGTERM, and save from inside the handler (mid-step) on SLURM's SIGUSR1: taken over.
        self._watch = (
            StopWatch(config.reliability.stop_grace_s, take_over=(_LIGHTNING_SIGNALS,))
            if stop_on_signals
            else None
        )
        self._stepped = 0
        self._resumed_random: dict[str, Any] | None = None
        #: Tuning inside the run (``[tune] in_run``), started in ``setup``; None when off.
        self.in_run: InRunTuner | None = None
        self._plugins: dict[str, Any] = {}
        self._side_config: TurboConfig | None = None
        self._windows: WindowClock | None = None
        self._told = 0

    @property
    def applied(self) -> dict[str, str | None]:
        """Technique -> None when it took effect, else why not (``Turbo.applied``'s shape),
        less a transform tuning inside the run composed to measure and left switched off."""
        kept = {k: v for k, v in self.results.items() if registry.requested(k, self.config)}
        return reasons(kept)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        device = trainer.strategy.root_device
        if self.config.tune.in_run and self.in_run is None:
            self._start_in_run(trainer, pl_module, device)
        # In-run tuning composes every transform it may switch on (``in_run.composed_config``).
        composing = self.config if self.in_run is None else self.in_run.composed_config()
        self.results |= registry.compose_model(pl_module, composing, device, "lightning")
        if self.in_run is not None:
            registry.set_toggles(pl_module, self.config)
        self._switches.enter_context(
            registry.held_switches(self.config, device, "lightning", self.results)
        )
        if registry.plans_batches(self.config):
            self._plan_train_loader(trainer, pl_module)

    # -- tuning inside the run ------------------------------------------------------------------

    def _start_in_run(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, device: torch.device
    ) -> None:
        """Start where the facts point, on the train loader's dataset and batch size."""
        datamodule = getattr(trainer, "datamodule", None)
        loader = (datamodule if datamodule is not None else pl_module).train_dataloader()
        dataset = getattr(loader, "dataset", None)
        lengths = None if dataset is None else sample_lengths(dataset)
        steps, _ = planned_lightning_steps(trainer, length_or_none(loader))
        census = None
        batch = first_samples_batch(loader, in_run.CENSUS_SAMPLES, collate_fn=None, pad_values=None)
        if batch is not None:
            batch = to_device(batch, model_device(pl_module))
            census = functools.partial(_detached_loss, pl_module, batch)
        self.in_run = in_run.start(
            self.config,
            pl_module,
            device,
            data=dataset,
            lengths=lengths,
            batch_size=getattr(loader, "batch_size", None) or 1,
            seed=self.seed,
            planned_steps=steps,
            forward=census,
        )
        self._windows = WindowClock(self.in_run, device)
        self.config = self.in_run.config
        self._use_side(trainer, self.config)
        self._tell(trainer)

    def _use_side(self, trainer: pl.Trainer, config: TurboConfig) -> None:
        """Train the next steps with the precision plugin Lightning builds for ``config``'s
        ``Trainer(precision=...)`` (one plugin per precision, so a scaler keeps its state) and
        its switchable transforms on or off (``registry.set_toggles``); nothing to do for the
        config already in use."""
        if config is self._side_config:
            return
        self._side_config = config
        registry.set_toggles(trainer.lightning_module, config)
        precision = trainer_kwargs(config).kwargs.get("precision", "32-true")
        if trainer.strategy.precision_plugin.precision == precision:
            return
        if precision not in self._plugins:
            self._plugins[precision] = _precision_plugin(precision, trainer.strategy.root_device)
        trainer.strategy.precision_plugin = self._plugins[precision]

    def _close_window(self, trainer: pl.Trainer) -> None:
        assert self.in_run is not None and self._windows is not None
        self._windows.close()
        self.config = self.in_run.config
        self._tell(trainer)

    def _parity_losses(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        with_config: TurboConfig,
        without: TurboConfig,
    ) -> tuple[float, float]:
        """``training_step``'s loss on ``batch`` under each side's precision plugin
        (``in_run.same_batch_losses``), the module detached from the Trainer meanwhile: what
        it logs then is not logged."""

        def loss_under(config: TurboConfig) -> float:
            self._use_side(trainer, config)
            with trainer.strategy.precision_plugin.train_step_context():
                return float(training_step_loss(pl_module, batch))

        device = trainer.strategy.root_device
        with _detached(pl_module):
            return in_run.same_batch_losses(pl_module, device, loss_under, with_config, without)

    def _tell(self, trainer: pl.Trainer) -> None:
        """Say on rank 0 what the in-run tuner said since last asked."""
        assert self.in_run is not None
        for event in self.in_run.events[self._told :]:
            announce(event, trainer.global_rank)
        self._told = len(self.in_run.events)

    def _keep_decided(self, trainer: pl.Trainer) -> None:
        if self.in_run is not None and trainer.global_rank == 0:
            self.in_run.write(Path(trainer.default_root_dir) / "tuned")

    def _plan_train_loader(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Make ``train_dataloader()`` return its loader rebuilt on the config's batch plan."""
        datamodule = getattr(trainer, "datamodule", None)
        owner: Any = datamodule if datamodule is not None else pl_module
        original = owner.train_dataloader

        @functools.wraps(original)
        def planned() -> DataLoader:
            return self.planned_loader(original(), trainer, pl_module)

        # Restored at teardown: an attribute of the instance's own, or none (the class's method).
        self._restore = (owner, vars(owner).get("train_dataloader"))
        owner.train_dataloader = planned

    def planned_loader(
        self, loader: DataLoader, trainer: pl.Trainer, pl_module: pl.LightningModule
    ) -> DataLoader:
        """``loader`` on the config's batch plan: this rank's whole batches of its dataset."""
        if not isinstance(loader, DataLoader):
            raise TypeError(
                f"train_dataloader() returned {type(loader).__name__}: [data] batches = "
                f"{self.config.data.batches!r} rebuilds one torch DataLoader on the batch plan"
            )
        source = BatchSource(
            loader.dataset,
            sample_lengths(loader.dataset),
            loader.batch_size,
            seed=self.seed,
            num_replicas=trainer.world_size,
            rank=trainer.global_rank,
            collate=loader.collate_fn,
            model=lambda: pl_module,
            lengths_from="give the DataLoader's dataset 'input_ids' or a 'length' column",
        )
        plan = registry.batch_plan(self.config, source)
        return plan.loader(
            loader.dataset,
            num_workers=loader.num_workers,
            pin_memory=loader.pin_memory,
            persistent_workers=loader.persistent_workers,
            prefetch_factor=loader.prefetch_factor,
            worker_init_fn=loader.worker_init_fn,
        )

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning's DDPStrategy registers comm hooks on CUDA only (its comment dates from torch
        # 1.8, when hooks needed NCCL); gloo runs them today, so register the config's here.
        # TODO: remove once Lightning registers hooks on every device.
        name = self.config.distributed.comm_hook
        model = trainer.strategy.model
        if name == "none" or not isinstance(model, DistributedDataParallel):
            return
        if trainer.strategy.root_device.type != "cuda":
            check_comm_hook(name, torch.distributed.get_backend())
            make_state, hook = COMM_HOOKS[name]
            model.register_comm_hook(make_state(self.config.distributed), hook)
        self.results["comm_hook"] = applied("comm_hook")

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._switches.close()
        if self._restore is not None:
            owner, own = self._restore
            if own is None:
                del owner.train_dataloader
            else:
                owner.train_dataloader = own
            self._restore = None
        if self._watch is not None:
            self._watch.close()

    # -- preemption: the step under way saved as Lightning's own checkpoint ---------------------

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._watch is not None:
            self._watch.start()  # after Lightning's signal connector registered its handlers
        self._stepped = trainer.global_step

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._resumed_random is not None:  # the first step after a resume
            restore_random_state(self._resumed_random)
            self._resumed_random = None
        if self._windows is None:
            return
        if batch_idx % max(1, trainer.accumulate_grad_batches) == 0:
            parity = functools.partial(self._parity_losses, trainer, pl_module, batch)
            self._use_side(trainer, self._windows.open(parity))
        self._windows.add(batch)

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if trainer.global_step == self._stepped:
            return  # inside an accumulation window: no optimizer step yet
        self._stepped = trainer.global_step
        if self.in_run is not None:
            self._close_window(trainer)
        if self._watch is None or not self._watch.should_stop(trainer.strategy.root_device):
            return
        # Lightning's preemption checkpoint (its SLURM requeue writes the same), on every rank.
        path = trainer.strategy.broadcast(
            trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)
        )
        trainer.save_checkpoint(path)
        self._keep_decided(trainer)
        self._watch.close()
        stopped = TrainerStopped(
            self._watch.signal_name,
            trainer.global_step,
            str(path),
            'run the same script with trainer.fit(..., ckpt_path="hpc")',
        )
        announce(stopped.line, trainer.global_rank)
        raise stopped  # a SystemExit, as Lightning's own SIGTERMException

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._keep_decided(trainer)
        if self._watch is not None:
            self._watch.close()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        # Lightning's teardown hooks do not run after an exception (a stop included).
        self.teardown(trainer, pl_module, "fit")

    def state_dict(self) -> dict[str, Any]:
        """Saved in each of Lightning's checkpoints: the process's random state at the save
        (Lightning keeps none), put back as the first step after a resume begins, so that its
        dropout masks are the uninterrupted run's."""
        tuned = None if self.in_run is None else self.in_run.state_dict()
        return {"random": capture_random_state(), "in_run": tuned}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resumed_random = state_dict.get("random")
        if self.in_run is not None and state_dict.get("in_run") is not None:
            self.in_run.load_state_dict(state_dict["in_run"])
            self.config = self.in_run.config


def _precision_plugin(precision: str, device: torch.device) -> Any:
    """The plugin Lightning builds for ``Trainer(precision=precision)`` on ``device``."""
    from lightning.pytorch.plugins.precision import MixedPrecision, Precision

    if precision in ("bf16-mixed", "16-mixed"):
        return MixedPrecision(precision, device=device.type)  # type: ignore[arg-type]
    return Precision()


@contextlib.contextmanager
def _detached(pl_module: pl.LightningModule) -> Iterator[None]:
    """``pl_module`` without its Trainer for the block: ``self.log`` logs nothing."""
    trainer = pl_module._trainer
    pl_module._trainer = None
    try:
        yield
    finally:
        pl_module._trainer = trainer


def _detached_loss(pl_module: pl.LightningModule, batch: Any) -> torch.Tensor:
    with _detached(pl_module):
        return training_step_loss(pl_module, batch)


def recipe_from_lightning(
    module: pl.LightningModule,
    datamodule: pl.LightningDataModule | None = None,
    *,
    trainer: pl.Trainer | None = None,
    planned_steps: int | None = None,
) -> Recipe:
    """A Recipe of what ``Trainer.fit(module, datamodule)`` would train: call it before fit.

    The model factory copies ``module`` as it is now (every trial starts from these weights);
    the optimizer is a rebuild of the one ``configure_optimizers`` returns (one optimizer;
    learning-rate schedulers are not part of a step and are left out); ``loss_fn`` calls
    ``training_step(batch, 0)`` and takes its loss (``self.log`` calls are dropped: no Trainer
    is attached). Data, batch size and collate come from the datamodule's (else the module's)
    ``train_dataloader``, after ``prepare_data`` and ``setup("fit")`` as Lightning calls them;
    lengths from the dataset's "length" or ``input_ids`` when its items have them. Batches of
    per-token labels (a 2-D ``labels`` tensor) are counted in tokens, the labels that are not
    -100, so that the tuner compares length buckets, which hold more short samples or fewer
    long ones, by the work done rather than by samples (see :func:`token_count`).

    The job's length (the tuner weighs compile time against it) is ``planned_steps`` (batches
    per process) when given, else what ``trainer`` will run: its ``max_steps`` or
    ``max_epochs`` (see :func:`planned_lightning_steps`).
    """
    if not module.automatic_optimization:
        raise RecipeError(
            f"{type(module).__name__} uses manual optimization: torchturbo needs training_step "
            "to return the loss and the optimizer step to be its own"
        )
    source: Any = datamodule if datamodule is not None else module
    if datamodule is not None:
        datamodule.prepare_data()
        datamodule.setup("fit")
    loader = source.train_dataloader()
    if loader.batch_size is None:
        raise RecipeError(
            "the train DataLoader has no batch_size (a custom batch_sampler?): torchturbo "
            "draws its own batches and needs the number of samples per batch"
        )
    per_token = token_count(next(iter(loader), None)) is not None
    template = _single_optimizer(module.configure_optimizers())
    initial = copy.deepcopy(module)
    built: list[nn.Module] = []

    def make_model() -> nn.Module:
        built[:] = [copy.deepcopy(initial)]
        return built[0]

    def make_optimizer(params: Any) -> torch.optim.Optimizer:
        model = parameter_owner(params, built[0] if built else None)
        return clone_optimizer(template, module, model)

    return Recipe(
        name=type(module).__name__,
        model=make_model,
        optimizer=make_optimizer,
        loss_fn=training_step_token_loss if per_token else training_step_loss,
        dataset=loader.dataset,
        batch_size=loader.batch_size,
        collate=loader.collate_fn,
        lengths=sample_lengths(loader.dataset),
        count_unit="tokens" if per_token else "samples",
        **_planned(trainer, planned_steps, length_or_none(loader)),
    )


def _planned(
    trainer: pl.Trainer | None, planned_steps: int | None, batches: int | None
) -> dict[str, Any]:
    if planned_steps is not None:
        return {"planned_steps": planned_steps, "planned_steps_source": "planned_steps="}
    if trainer is None:
        return {}
    steps, source = planned_lightning_steps(trainer, batches)
    return {} if steps is None else {"planned_steps": steps, "planned_steps_source": source}


def planned_lightning_steps(trainer: pl.Trainer, batches: int | None) -> tuple[int | None, str]:
    """The batches per process ``trainer.fit`` will run over a loader of ``batches`` batches:
    ``max_steps`` x ``accumulate_grad_batches`` when set, else ``max_epochs`` x the loader's
    batches per process (Lightning shards it across processes); None when neither is known."""
    accumulation = max(1, trainer.accumulate_grad_batches)
    per_window = f" x accumulate_grad_batches={accumulation}" if accumulation > 1 else ""
    if trainer.max_steps is not None and trainer.max_steps > 0:
        return (
            trainer.max_steps * accumulation,
            f"the Lightning Trainer's max_steps={trainer.max_steps}{per_window}",
        )
    epochs = trainer.max_epochs
    if epochs is None or epochs < 1 or batches is None:
        return None, ""
    world = max(1, trainer.world_size)
    per_process = math.ceil(batches / world)
    processes = f" on {world} processes" if world > 1 else ""
    return epochs * per_process, (
        f"the Lightning Trainer's max_epochs={epochs} x {per_process} batches{processes}"
    )


def training_step_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The loss ``training_step`` returns (a tensor, or the "loss" of a dict)."""
    if not isinstance(model, pl.LightningModule):
        raise RecipeError(
            f"training_step_loss got a {type(model).__name__}, not a LightningModule: the loss "
            "is the module's own training_step, which a wrapper such as DDP does not have"
        )
    with warnings.catch_warnings():
        # self.log() without an attached Trainer warns once per call and does nothing else.
        warnings.filterwarnings("ignore", message=r"You are trying to `self.log\(\)`")
        output = model.training_step(batch, 0)
    loss = output.get("loss") if isinstance(output, dict) else output
    if not isinstance(loss, torch.Tensor):
        raise RecipeError(
            f"{type(model).__name__}.training_step returned {type(output).__name__}: torchturbo "
            "needs the loss (a tensor, or a dict with 'loss') from every step"
        )
    return loss


def token_count(batch: Any) -> torch.Tensor | None:
    """The labels of ``batch`` that count (not -100) when it is a mapping with a 2-D ``labels``
    tensor (one label per token); None for any other batch."""
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if not isinstance(labels, torch.Tensor) or labels.dim() < 2:
        return None
    return (labels != IGNORE_INDEX).sum()


def training_step_token_loss(model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``training_step``'s loss and the batch's token count (:func:`token_count`)."""
    count = token_count(batch)
    if count is None:
        raise RecipeError(
            "this recipe counts tokens, but a batch has no 2-D 'labels' tensor: every batch of a "
            "DataLoader must be of one kind"
        )
    return training_step_loss(model, batch), count


def _single_optimizer(configured: Any) -> torch.optim.Optimizer:
    """The one optimizer in any of the shapes ``configure_optimizers`` may return."""
    found: list[Any] = []
    pending = [configured]
    while pending:
        item = pending.pop()
        if isinstance(item, torch.optim.Optimizer):
            found.append(item)
        elif isinstance(item, dict):
            pending.append(item.get("optimizer"))
        elif isinstance(item, (list, tuple)):
            # ([optimizers], [schedulers]): schedulers are not optimizers and are skipped.
            pending.extend(item)
    if len(found) != 1:
        raise RecipeError(
            f"configure_optimizers returned {len(found)} optimizers: torchturbo tunes one "
            "optimizer stepping all parameters"
        )
    return found[0]
