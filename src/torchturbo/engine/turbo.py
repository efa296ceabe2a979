"""Turbo: compose the configured techniques around a user's model, optimizer and data.

The engine holds no technique logic of its own and names no technique: each technique declares
its hooks once (``techniques/framework/spec.py``) and the engine reaches them only through the
registry (``techniques/registry.py``: model transforms in their order, the optimizer rebuild, the
batch plan, input layout, failures, process-wide switches, and the step hooks: autocast, loss
scaling and the optimizer step, ``framework/steps.py``); ``compose.compose`` adds the device and
the strategy's wrapping. What differs across processes is the strategy
(``distributed/strategy.py``, chosen from the launch environment). This module runs one training
micro-step (``step``) with exact accumulation and clipping, and owns the run's state
(``state_dict``). With ``[tune] in_run`` it tunes while it trains (``in_run``): the facts choose
the start in ``setup``, and ``step`` runs each accumulation window on the side the in-run tuner
names, timing the windows it measures.
Reliability lives beside it: ``oom`` (micro-batching on out-of-memory), ``guard`` (non-finite
losses, unreadable batches), ``resume`` and ``checkpoint`` (``save``/``load``), ``epochs`` (the
resumable loader).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from torchturbo.base.device import model_device, to_device
from torchturbo.config import TurboConfig
from torchturbo.data.chunked_plan import Chunk, ChunkedPlanSampler
from torchturbo.distributed.comm import CommStats
from torchturbo.distributed.launch import init_distributed, read_launch_env
from torchturbo.distributed.select import select_strategy
from torchturbo.distributed.strategy import Strategy
from torchturbo.engine import in_run
from torchturbo.engine.build_aside import build_aside
from torchturbo.engine.compose import compose
from torchturbo.engine.in_run import ChunkClock, InRunTuner, WindowClock
from torchturbo.engine.loader import chunked_loader, first_samples_batch, training_loader
from torchturbo.engine.state import load_training_state, save_training_state
from torchturbo.measure.breakdown import NullRecorder, Recorder
from torchturbo.reliability.epochs import EpochLoader, data_identity
from torchturbo.reliability.guard import (
    BACKWARD_INSIDE,
    LossFnError,
    NonFiniteGuard,
    backward_inside,
    call_loss_fn,
)
from torchturbo.reliability.oom import MicroBatcher, leading_size
from torchturbo.reliability.preemption import StopRequest, agree_to_stop
from torchturbo.reliability.random_state import capture_random_state, restore_random_state
from torchturbo.techniques import registry
from torchturbo.techniques.framework.result import TechniqueResult, reasons
from torchturbo.techniques.framework.steps import Steps
from torchturbo.techniques.tools.accumulation import (
    AccumulationWindow,
    scale_and_clip_gradients,
    scale_gradients,
)

LossOutput = torch.Tensor | tuple[torch.Tensor, int | float | torch.Tensor]
LossFn = Callable[[nn.Module, Any], LossOutput]


@dataclass(frozen=True)
class StepMetrics:
    """What one call to ``Turbo.step`` did.

    ``loss`` is the micro-batch's mean loss as a detached tensor: reading it with ``float()`` is
    a device sync, so the engine leaves that to the caller. ``micro_batches`` is how many pieces
    the batch ran as (``[accumulation] micro_batches``, more after an out-of-memory split, see
    ``torchturbo.reliability.oom``).
    """

    loss: torch.Tensor
    count: torch.Tensor
    optimizer_stepped: bool
    skipped: bool
    grad_norm: torch.Tensor | None
    micro_batches: int = 1


def resolve_device(name: str) -> torch.device:
    """``auto`` is CUDA when available, else CPU; a device that is not here is a clear error
    (another accelerator, "mps" or "xpu", only when named)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"device = {name!r} is not a device torch knows") from None
    if device.type != "cpu" and not torch.get_device_module(device).is_available():
        raise ValueError(
            f"device = {name!r} was asked for, but no {device.type} device is available"
        )
    return device


class Turbo:
    """Apply a :class:`TurboConfig` to a training loop.

    >>> turbo = Turbo(TurboConfig.preset("fast"))
    >>> model, optimizer, loader = turbo.setup(model, optimizer, dataset, batch_size=64)
    >>> for batch in loader:
    ...     metrics = turbo.step(loss_fn, batch)

    Under ``torchrun`` the same lines train data-parallel (``[distributed]``): ``setup`` joins
    the process group, shards the dataset across ranks and wraps the model (DDP or FSDP2).
    """

    def __init__(self, config: TurboConfig | None = None) -> None:
        self.config = config or TurboConfig()
        self.device = resolve_device(self.config.device)
        #: What the requested techniques do inside each step (autocast, loss scaling, TF32),
        #: and the state they keep: ``techniques/framework/steps.py``.
        self.steps = registry.step_hooks(self.config, self.device)
        #: Times the phases of each step; swap it with :meth:`recording`.
        self.recorder: Recorder = NullRecorder()
        self.optimizer_steps = 0
        self.skipped_steps = 0
        #: Set by ``setup``: the model as training runs it (wrapped under torchrun), the
        #: optimizer, the loader (None for a manual loop) and the strategy.
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.loader: EpochLoader | None = None
        self.strategy: Strategy | None = None
        self.microbatcher: MicroBatcher | None = None
        self.guard = NonFiniteGuard(self.config.reliability.nonfinite_patience)
        #: Loader batches in the open accumulation window (each may run as several pieces).
        self.batches_in_window = 0
        self._window = AccumulationWindow(self.config.accumulation.steps)
        self._results: dict[str, TechniqueResult] = {}
        self._notes: dict[str, str] = {}
        self._channels_last_inputs = False
        self._step_switches = registry.step_switches(self.config, "engine")
        #: Tuning inside the run (``[tune] in_run``), set by ``setup``; None when off.
        self.in_run: InRunTuner | None = None
        #: Step hooks by config, for the sides the in-run tuner switches between (each keeps
        #: its own state: a loss scale).
        self._sides_data = self.config.data
        self._sides: dict[str, Steps] = {self.config.to_toml(): self.steps}
        #: The in-run tuner's windows (``in_run.WindowClock``), set with it, and its chunks
        #: where it measures the batch plan on chunks of the epoch (``in_run.ChunkClock``).
        self._windows: WindowClock | None = None
        self._chunks: ChunkClock | None = None
        #: The config the steps run with now (``_use``).
        self._side_config: TurboConfig | None = None

    # -- setup ------------------------------------------------------------------------------

    def setup(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        data: Dataset | DataLoader | None = None,
        *,
        batch_size: int | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        batch_sampler: Any = None,
        shuffle: bool = True,
        seed: int | None = None,
        lengths: Sequence[int] | None = None,
        pad_values: Mapping[str, int] | None = None,
        comm_stats: CommStats | None = None,
        strategy: Strategy | None = None,
        planned_steps: int | None = None,
        loss_fn: LossFn | None = None,
    ) -> tuple[nn.Module, torch.optim.Optimizer, EpochLoader | None]:
        """Compose the model, keep the optimizer, and build or wrap the loader.

        The returned loader marks its last batch so that a trailing partial accumulation window
        is applied rather than lost, and calls ``set_epoch`` on its sampler every epoch.
        Parameter objects are preserved (FSDP re-points the optimizer at its shards), so an
        optimizer built before ``setup`` stays valid. With ``[data] batches`` ``"buckets"`` or
        ``"packed"`` the batches are the config's batch plan (``data/batch_plan.py``):
        ``lengths`` (one per sample) and ``batch_size`` give length buckets or packed rows that
        hold the real tokens of ``batch_size`` rows on average, and packing first checks that
        ``model`` keeps documents apart (a ValueError with the reason when it does not).
        Without ``collate_fn``, :func:`~torchturbo.data.collate.pad_collate` pads
        variable-length fields of dict samples (``pad_values`` per field, e.g. the tokenizer's
        pad id) and collates the rest as torch's default collate does. Under torchrun a dataset
        given with ``batch_size`` is split across ranks (a ``DistributedSampler``), a stream
        (``IterableDataset``) is dealt out to them, an equal share each
        (``data.streams.RankShare``); a DataLoader or a ``batch_sampler`` is used as given
        and must shard itself. ``comm_stats`` counts DDP's gradient bytes and time
        (``distributed/comm.py``). ``strategy`` overrides the one the config and the launch
        choose: ``Strategy(config, device, DistEnv())`` trains this model in this process alone
        inside a torchrun job (a rank-0 reference, an evaluation). With ``[tune] in_run``, the
        facts measured here choose the config the run starts from (``engine/in_run.py``),
        ``planned_steps``, the optimizer steps the job will train, bounds its measuring, and
        ``loss_fn``, run once on two samples, measures the LM head's share of the activations.
        """
        if self.model is not None:
            raise RuntimeError("Turbo.setup was already called: build one Turbo per model")
        if self.config.tune.in_run:
            known_lengths = None if isinstance(data, DataLoader) else lengths
            census = None
            if loss_fn is not None:
                batch = first_samples_batch(
                    data, in_run.CENSUS_SAMPLES, collate_fn=collate_fn, pad_values=pad_values
                )
                if batch is not None:
                    batch = to_device(batch, model_device(model))
                    census = functools.partial(call_loss_fn, loss_fn, model, batch)
            # One process, a dataset read by index with its lengths, batched by the engine:
            # its epochs can be batched by chunks, so the batch plan is measured too.
            by_chunks = (
                read_launch_env() is None
                and known_lengths is not None
                and data is not None
                and not isinstance(data, IterableDataset)
                and batch_sampler is None
                and batch_size is not None
                and shuffle
            )
            self._start_in_run(
                model, data, known_lengths, batch_size, seed, planned_steps, census, by_chunks
            )
        env = init_distributed(self.config.device)
        self.strategy = strategy or select_strategy(self.config, self.device, env)
        # In-run tuning composes every transform it may switch on (``in_run.composed_config``).
        composing = self.config if self.in_run is None else self.in_run.composed_config()
        self.model, results = compose(
            model,
            optimizer,
            config=composing,
            device=self.device,
            strategy=self.strategy,
            reference=self._window_reference,
            comm_stats=comm_stats,
        )
        # A rebuilt optimizer is a new object: callers use the one setup returns.
        optimizer, rebuilt = registry.rebuild_optimizer(optimizer, self.config)
        self._results = {**self.steps.results, **results, **rebuilt}
        if self.in_run is not None:
            registry.set_toggles(self.model, self.config)
        self.optimizer = optimizer
        self._channels_last_inputs = registry.channels_last_inputs(self._results)
        self.microbatcher = self._microbatcher(self.model)
        if data is None:
            return self.model, optimizer, None
        plan = None if self.in_run is None else self.in_run.plan
        if plan is not None:
            assert self.in_run is not None and lengths is not None and batch_size is not None
            assert not isinstance(data, DataLoader)  # by chunks only where the engine batches
            data = chunked_loader(
                data,
                config=self.config,
                with_plan=self.config.replace(**plan.on),
                device=self.device,
                draw=self.in_run.draw,
                batch_size=batch_size,
                collate_fn=collate_fn,
                seed=seed,
                lengths=lengths,
                pad_values=pad_values,
            )
            self._chunks = ChunkClock(self.in_run, self.device)
            self.in_run.batches_per_window = self._window.micro_steps
        elif not isinstance(data, DataLoader):
            data = training_loader(
                data,
                config=self.config,
                device=self.device,
                strategy=self.strategy,
                batch_size=batch_size,
                collate_fn=collate_fn,
                batch_sampler=batch_sampler,
                shuffle=shuffle,
                seed=seed,
                lengths=lengths,
                pad_values=pad_values,
                model=model,
            )
        self.loader = EpochLoader(data, data_identity(data, lengths))
        return self.model, optimizer, self.loader

    def _start_in_run(
        self,
        model: nn.Module,
        data: Any,
        lengths: Sequence[int] | None,
        batch_size: int | None,
        seed: int | None,
        planned_steps: int | None,
        census: Callable[[], Any] | None,
        by_chunks: bool,
    ) -> None:
        """Start where the facts point (``in_run.start``) and set up the measuring."""
        self.in_run = in_run.start(
            self.config,
            model,
            self.device,
            data=data.dataset if isinstance(data, DataLoader) else data,
            lengths=lengths,
            batch_size=batch_size or getattr(data, "batch_size", None) or 1,
            seed=seed or 0,
            planned_steps=planned_steps,
            forward=census,
            # One process: a copy compiled aside traces as the model does (under torchrun,
            # DDP's graph breaks at its buckets would not).
            build_aside=read_launch_env() is None,
            measure_plan=by_chunks,
        )
        self._windows = WindowClock(self.in_run, self.device)
        self.config = self.in_run.config
        self.steps = self._side_steps(self.config)
        self._step_switches = registry.step_switches(self.config, "engine")

    def _side_steps(self, config: TurboConfig) -> Steps:
        """The step hooks of ``config``, built once per side: its batch plan (``[data]``) is
        no step's, so a plan's verdict keeps the hooks' state (a loss scale)."""
        key = dataclasses.replace(config, data=self._sides_data).to_toml()
        if key not in self._sides:
            self._sides[key] = registry.step_hooks(config, self.device)
        return self._sides[key]

    def _use(self, config: TurboConfig) -> None:
        """Run the next steps with ``config``'s step hooks, switches and switched transforms
        (nothing to do for the config already in use: every window once decided)."""
        assert self.model is not None
        if config is self._side_config:
            return
        self._side_config = config
        registry.set_toggles(self.model, config)
        steps = self._side_steps(config)
        if steps is self.steps:
            return
        composed = {k: v for k, v in self._results.items() if k not in self.steps.hooks}
        self.steps = steps
        self._step_switches = registry.step_switches(config, "engine")
        self._results = {**composed, **steps.results}

    def _parity_losses(
        self, loss_fn: LossFn, batch: Any, with_config: TurboConfig, without: TurboConfig
    ) -> tuple[float, float]:
        """Both sides' losses on ``batch`` (``in_run.same_batch_losses``)."""
        assert self.model is not None

        def loss_under(config: TurboConfig) -> float:
            self._use(config)  # its step hooks and its switched transforms
            return float(self.forward(loss_fn, batch)[0])

        return in_run.same_batch_losses(self.model, self.device, loss_under, with_config, without)

    def _build_aside(self, loss_fn: LossFn, batch: Any) -> None:
        """Start building the choice the in-run tuner asks for aside (``build_aside``): a copy
        of the model, given the choice's transforms, runs a gradient-free forward and a training
        step of ``batch`` under the step hooks of the config with the choice, in a background
        thread."""
        assert self.in_run is not None and self.model is not None
        comparison = self.in_run.to_build()
        if comparison is None:
            return
        config = self.in_run.config.replace(**comparison.on)
        steps = self._side_steps(config)
        batch = to_device(batch, self.device, channels_last=self._channels_last_inputs)
        device = self.device

        def warm(model: nn.Module) -> None:
            with steps.step_context(), steps.forward_context():
                with torch.no_grad():
                    call_loss_fn(loss_fn, model, batch)
                loss, _ = _split_loss(call_loss_fn(loss_fn, model, batch), batch, device)
            loss.float().backward()

        names = [t.name for t in registry.changed_techniques(self.in_run.config, config)]

        def prepare(model: nn.Module) -> str:
            results = registry.transform_named(model, config, device, names)
            return "; ".join(r.reason for r in results.values() if r.reason)

        comparison.build = build_aside(self.model, prepare, warm)

    def _microbatcher(self, model: nn.Module) -> MicroBatcher:
        reliability = self.config.reliability
        assert self.strategy is not None
        refused = self.strategy.auto_microbatch_off
        if reliability.auto_microbatch and refused is not None:
            self._notes["auto_microbatch"] = refused
        return MicroBatcher(
            model,
            budget_bytes=reliability.memory_budget_bytes,
            auto=reliability.auto_microbatch and refused is None,
            device=self.device,
            split=self.config.accumulation.micro_batches,
        )

    # -- what was applied ---------------------------------------------------------------------

    @property
    def applied(self) -> dict[str, str | None]:
        """Requested technique -> None when it took effect, else why not (for reports)."""
        return {**reasons(self.results), **self._notes}

    @property
    def results(self) -> dict[str, TechniqueResult]:
        """What each technique requested by the config did, as ``setup`` composed them (less a
        transform the in-run tuner composed to measure and then left switched off)."""
        return {k: v for k, v in self._results.items() if registry.requested(k, self.config)}

    # -- training -----------------------------------------------------------------------------

    @property
    def window_open(self) -> bool:
        """Whether gradients of an unfinished accumulation window are pending."""
        return self._window.seen > 0

    @property
    def window_reference(self) -> torch.Tensor | None:
        """The open window's count reference (first micro-batch's count x micro-steps): each
        micro-step's loss is weighted by ``count / reference``. None while no window is open."""
        return self._window.reference

    def _window_reference(self) -> torch.Tensor:
        """The open window's reference, for strategies that read it during backward."""
        if self._window.reference is None:
            raise RuntimeError("no accumulation window is open: call turbo.step, not backward")
        return self._window.reference

    @contextlib.contextmanager
    def recording(self, recorder: Recorder) -> Iterator[Recorder]:
        """Time the phases of the steps run inside the block with ``recorder``
        (``measure.breakdown.PhaseRecorder``); the previous recorder is back afterwards."""
        previous, self.recorder = self.recorder, recorder
        try:
            yield recorder
        finally:
            self.recorder = previous

    def step(self, loss_fn: LossFn, batch: Any) -> StepMetrics:
        """Run one micro-batch: forward, backward, and the optimizer step when a window closes.

        A batch that runs out of memory is retried in smaller pieces
        (``torchturbo.reliability.oom``).
        """
        if self.microbatcher is None:
            raise RuntimeError("call Turbo.setup(model, optimizer, ...) before Turbo.step")
        last_batch = self.loader is not None and self.loader.at_last_batch
        closing = self.batches_in_window + 1 >= self._window.micro_steps or last_batch
        if self._chunks is not None:
            self._chunks.arrive(*self._chunk_of_batch())
        if self._windows is not None:
            if self.batches_in_window == 0:  # the in-run tuner names the window's config
                self._build_aside(loss_fn, batch)
                held = self._chunks is not None and self._chunks.measuring
                self._use(
                    self._windows.open(functools.partial(self._parity_losses, loss_fn, batch), held)
                )
            self._windows.add(batch)
        micro_step = functools.partial(self._micro_step, loss_fn)
        with self.steps.step_context(), self.switches():
            try:
                loss, count, pieces = self.microbatcher.run(
                    batch, micro_step, self._restart, closing
                )
            except Exception as err:
                explained = registry.explain_failure(err, self._results)
                if explained is None:
                    raise
                name, self._results[name], failure = explained
                raise failure from err
            self.batches_in_window += 1
            stepped, skipped, grad_norm = False, False, None
            if closing:
                skipped, grad_norm = self._optimizer_step()
                stepped = True
        if self._chunks is not None:
            self._chunks.stepped(self._chunk_sampler().planning_s)
        if closing and self._windows is not None and self.in_run is not None:
            self._windows.close()
            self.config = self.in_run.config
        return StepMetrics(loss, count, stepped, skipped, grad_norm, pieces)

    def _chunk_sampler(self) -> ChunkedPlanSampler:
        assert self.loader is not None
        sampler = self.loader.loader.batch_sampler
        assert isinstance(sampler, ChunkedPlanSampler)
        return sampler

    def _chunk_of_batch(self) -> tuple[Chunk | None, int, float]:
        """The chunk (``data/chunked_plan.py``) of the batch the loader handed out last, its
        place in the epoch, and the sampler's batching seconds so far."""
        assert self.loader is not None
        sampler, position = self._chunk_sampler(), self.loader.batches - 1
        return sampler.chunk_at(position), position, sampler.planning_s

    def switches(self) -> contextlib.AbstractContextManager[Any]:
        """The process-wide switches of the configured techniques (cuDNN autotuning, saved
        activations' storage), as each step holds them: for one step only, since the bench and
        the tuner interleave the steps of several engines in one process. Hold it around a
        forward run outside ``step`` that must see what a step sees (a memory measurement)."""
        if not self._step_switches:
            return contextlib.nullcontext()
        return registry.held_switches(
            self.config, self.device, "engine", self._results, self._step_switches
        )

    def _micro_step(
        self, loss_fn: LossFn, batch: Any, closing: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.strategy is not None
        with self.strategy.backward_context(closing):
            with self.recorder.phase("forward"):
                loss, count = self.forward(loss_fn, batch)
            with self.recorder.phase("backward"):
                self.guard.observe(loss, functools.partial(self.forward, loss_fn, batch), batch)
                weighted = loss.float() * self._window.weight(count)
                try:
                    self.steps.scale_loss(weighted).backward()
                except RuntimeError as err:  # the graph was freed by a backward in loss_fn
                    if backward_inside(err):
                        raise LossFnError(BACKWARD_INSIDE) from err
                    raise
        return loss.detach(), count

    def _restart(self) -> None:
        """Drop the open window's gradients so that it can be replayed (after out-of-memory)."""
        assert self.optimizer is not None
        self.optimizer.zero_grad(set_to_none=True)
        self._window.reset()
        self.guard.forget_window()

    def forward(self, loss_fn: LossFn, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward half of a step: batch to the device, autocast, (mean loss, count)."""
        if self.model is None:
            raise RuntimeError("call Turbo.setup(model, optimizer, ...) before Turbo.forward")
        batch = to_device(
            batch,
            self.device,
            non_blocking=self.config.data.non_blocking,
            channels_last=self._channels_last_inputs,
        )
        with self.steps.step_context(), self.steps.forward_context():
            return _split_loss(call_loss_fn(loss_fn, self.model, batch), batch, self.device)

    def flush(self) -> bool:
        """Apply a partial accumulation window left open at the end of a manual loop.

        Loaders returned by ``setup`` do this on their own. Returns whether a step was taken.
        """
        if self._window.seen == 0:
            return False
        with self.steps.step_context():
            self._optimizer_step()
        return True

    def _optimizer_step(self) -> tuple[bool, torch.Tensor | None]:
        assert self.model is not None and self.optimizer is not None
        assert self.strategy is not None and self.microbatcher is not None
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        with self.recorder.phase("optimizer"):
            self.steps.unscale_gradients(self.optimizer)  # clipping must see true gradients
            total = self.strategy.reduce_count(self._window.total)  # type: ignore[arg-type]
            correction = self._window.correction(total)
            grad_norm, clip = None, self.config.clipping
            if clip.max_norm is not None:
                grad_norm = scale_and_clip_gradients(
                    params, correction, clip.max_norm, clip.norm_type
                )
            elif not self._unit_correction():
                scale_gradients(params, correction)
            # Unless a technique's step skips non-finite gradients itself (a GradScaler), the
            # guard skips such a step rather than write NaN weights.
            check = not self.steps.checks_finite()
            nonfinite = self.guard.window_nonfinite(params, grad_norm, check)
            skipped = self.steps.optimizer_step(self.optimizer, finite=not nonfinite)
            self.optimizer.zero_grad(set_to_none=True)
        self._window.reset()
        self.batches_in_window = 0
        self.microbatcher.window_closed()
        self.optimizer_steps += 1
        self.skipped_steps += int(skipped)
        self.guard.raise_if_exhausted(self.model, self.optimizer_steps)
        return skipped, grad_norm

    def _unit_correction(self) -> bool:
        """Whether the window's correction is exactly 1, known without reading it: one batch
        per window, run whole, in one process (reference and total are the same count)."""
        assert self.strategy is not None and self.microbatcher is not None
        one_piece = self._window.micro_steps == 1 and self.microbatcher.split == 1
        return one_piece and not self.strategy.env.is_distributed

    def agree_to_stop(self, request: StopRequest) -> bool:
        """Whether the loop should stop now: True on every rank once any rank's stop ``request``
        (``torchturbo.reliability.preemption.stop_on_signals``) is set. Call it on every rank
        after each step whose metrics say ``optimizer_stepped`` (under torchrun it is one small
        all-reduce), then ``save`` and leave the loop when it says so."""
        return agree_to_stop(request, self.device)

    # -- state --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue this run exactly, taken between windows: model and
        optimizer state (sharded under FSDP), the loss scale, the counters, the micro-batch
        split, the loader's position and this process's random state. As with torch's own
        ``state_dict``, tensors are the live ones: save or copy it before training on."""
        if self.model is None or self.optimizer is None or self.strategy is None:
            raise RuntimeError("call Turbo.setup(model, optimizer, ...) before Turbo.state_dict")
        if self.window_open:
            raise RuntimeError(
                f"Turbo.state_dict inside an accumulation window ({self.batches_in_window} "
                "micro-batches pending): take it right after a step that says optimizer_stepped"
            )
        assert self.microbatcher is not None
        model_state, optimizer_state = self.strategy.state_dicts(self.model, self.optimizer)
        return {
            "model": model_state,
            "optimizer": optimizer_state,
            # The decided side's: a measured run may have ended its last window on the other.
            "steps": self._side_steps(self.config).state_dict(),
            "in_run": None if self.in_run is None else self.in_run.state_dict(),
            "optimizer_steps": self.optimizer_steps,
            "skipped_steps": self.skipped_steps,
            "micro_batch_split": self.microbatcher.split,
            "loader": self.loader.position() if self.loader is not None else None,
            "random": capture_random_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from what :meth:`state_dict` returned. The loader returned by ``setup``
        resumes at the saved position, and the random state is put back once it has skipped
        the batches already trained (skipping may draw random numbers)."""
        if self.model is None or self.optimizer is None or self.strategy is None:
            raise RuntimeError("call Turbo.setup(model, optimizer, ...) before load_state_dict")
        assert self.microbatcher is not None
        self.strategy.load_state_dicts(
            self.model, self.optimizer, state["model"], state["optimizer"]
        )
        if self.in_run is not None and state.get("in_run") is not None:
            self.in_run.load_state_dict(state["in_run"])
            self.config = self.in_run.config
            self._use(self.config)
        self.steps.load_state_dict(state["steps"])
        self.optimizer_steps = state["optimizer_steps"]
        self.skipped_steps = state["skipped_steps"]
        self.microbatcher.split = state["micro_batch_split"]
        random_state = state.get("random")
        after = None
        if random_state is not None:
            restore_random_state(random_state)
            after = functools.partial(restore_random_state, random_state)
        if state.get("loader") is not None and self.loader is not None:
            self.loader.resume(state["loader"], after=after)

    def save(self, directory: str | Path, *, scheduler: Any = None) -> Path:
        """Checkpoint the run atomically under ``directory`` (see ``torchturbo.resume``).

        Call it right after a step whose metrics say ``optimizer_stepped``, on every rank under
        torchrun; returns the checkpoint's own directory. Keeps the newest ``[reliability]
        keep_last``.
        """
        return save_training_state(self, directory, scheduler)

    def load(
        self, directory: str | Path, *, scheduler: Any = None, next_epoch: bool = False
    ) -> Path:
        """Restore the newest checkpoint under ``directory`` that verifies, after ``setup``.

        The loader returned by ``setup`` continues from the saved position; a position counted
        in other data (another size, lengths or batch plan) is refused mid-epoch, and
        ``next_epoch=True`` starts the epoch after it instead. Returns the path read.
        """
        return load_training_state(self, directory, scheduler, next_epoch=next_epoch)

    def close(self) -> None:
        """Nothing to release any more: the process-wide switches (TF32, cuDNN autotuning) are
        held only while a step runs. Kept so that code written for earlier versions runs."""


def _split_loss(
    output: LossOutput, batch: Any, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean loss, count it is a mean over); the count defaults to the batch's leading size."""
    if isinstance(output, tuple):
        if len(output) != 2:
            raise ValueError(
                f"loss_fn must return a loss or (loss, count), got a tuple of {len(output)}"
            )
        loss, count = output
    else:
        loss, count = output, leading_size(batch)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ValueError(f"loss_fn must return a scalar tensor as the loss, got {loss!r}")
    count = torch.as_tensor(count, dtype=torch.float32, device=device)
    return loss, count
