"""One training configuration measured on one recipe: a :class:`Trial`.

A :class:`Trial` is one configuration applied to a fresh model (the recipe's seed fixes the initial
weights) training on a fixed, pre-collated list of batches, so every variant sees the same data in
the same order and input loading is kept out of the compute measurement. Each trial also draws
its random numbers (dropout) from its own stream, so that interleaving trials does not hand them
different dropout masks: loss curves differ only by what the configuration changes.
:func:`torchturbo.trials.variants.compare_configs` times trials side by side; the CLI's
``bench``, ``benchmarks/techniques.py``, the tuner and the doctor all measure through here.

Under torchrun every rank builds the same trials and steps them in the same order (the
interleaving is deterministic), so their collectives pair up. Each trial's engine wraps its model
(DDP or FSDP2 per ``[distributed]``, see ``Turbo.setup``), each rank trains on its own seeded
batches, throughput counts the samples of all ranks, DDP's gradient traffic is counted per step,
and the other figures (step time, loss, memory) are rank 0's, which is the rank that reports.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable, Hashable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from torchturbo.config import TurboConfig
from torchturbo.data.batch_plan import BatchPlan, BatchSource, PlannedSampler, user_batches
from torchturbo.data.collate import pad_collate
from torchturbo.data.length import length_or_none
from torchturbo.distributed.comm import CommStats
from torchturbo.distributed.launch import current_env
from torchturbo.engine import Turbo
from torchturbo.measure.memory import activation_bytes, tensor_bytes, track_peak_memory
from torchturbo.measure.timing import time_once
from torchturbo.recipe import Recipe
from torchturbo.reliability.oom import split_batch
from torchturbo.techniques import registry


def fixed_batches(
    recipe: Recipe, count: int, *, seed: int | None = None, pad_to_multiple: int = 1
) -> list[Any]:
    """The first ``count`` batches of a seeded shuffle of the recipe's dataset, collated as the
    engine collates them (the recipe's collate, else ``pad_collate`` to ``pad_to_multiple``).

    The default seed is the recipe's plus the process's rank, so that under torchrun each rank
    trains on different batches, as data-parallel ranks do. A stream (an ``IterableDataset``)
    owns its order: its first ``count`` batches, as it yields them (on every rank, unless the
    stream splits itself by rank).
    """
    seed = _rank_seed(recipe) if seed is None else seed
    generator = torch.Generator().manual_seed(seed)
    collate = _collate(recipe, pad_to_multiple)
    loader = DataLoader(
        recipe.dataset,
        batch_size=recipe.batch_size,
        shuffle=not isinstance(recipe.dataset, IterableDataset),
        collate_fn=collate,
        generator=generator,
        drop_last=True,
    )
    batches = list(itertools.islice(loader, count))
    if not batches:
        size = length_or_none(recipe.dataset)
        samples = "a stream" if size is None else f"{size} samples"
        raise ValueError(
            f"recipe {recipe.name!r}: the dataset ({samples}) holds no full batch of "
            f"{recipe.batch_size}"
        )
    return batches


def representative_batches(recipe: Recipe, count: int, *, pad_to_multiple: int = 1) -> list[Any]:
    """``count`` batches of the user's rows whose steps cost, on average, what the job's do.

    Steps of padded rows cost superlinearly in their padded length (attention), and a few
    batches of a long-tailed shuffle are a poor sample of that: a 512-token batch of a large
    text model took 9 s where the job's steps averaged 2.3 s, and a tune that drew none
    (or several) timed its step at half (or twice) the job's. So the batches of one seeded
    shuffle's epoch are sorted by their longest sample and those at the midpoints of ``count``
    equal shares are taken: the epoch's spread of padded lengths, in ``count`` batches. Without
    per-sample lengths, or for a stream, these are :func:`fixed_batches`."""
    lengths, dataset = recipe.lengths, recipe.dataset
    if lengths is None or isinstance(dataset, IterableDataset):
        return fixed_batches(recipe, count, pad_to_multiple=pad_to_multiple)
    generator = torch.Generator().manual_seed(_rank_seed(recipe))
    order = torch.randperm(len(lengths), generator=generator).tolist()
    size = recipe.batch_size
    rows = [order[i : i + size] for i in range(0, len(order) - size + 1, size)]
    if not rows:  # no full batch: fixed_batches says so
        return fixed_batches(recipe, count, pad_to_multiple=pad_to_multiple)
    rows.sort(key=lambda row: max(lengths[i] for i in row))
    shares = min(count, len(rows))
    picked = [rows[int((k + 0.5) * len(rows) / shares)] for k in range(shares)]
    collate = _collate(recipe, pad_to_multiple)
    return [collate([dataset[i] for i in row]) for row in picked]


def _rank_seed(recipe: Recipe) -> int:
    """The recipe's seed plus the process's rank: data-parallel ranks train different batches."""
    return recipe.seed + current_env().rank


def _collate(recipe: Recipe, pad_to_multiple: int) -> Callable[[list[Any]], Any]:
    """The recipe's collate, else ``pad_collate``, as the engine collates."""
    return recipe.collate or functools.partial(
        pad_collate, pad_to_multiple=pad_to_multiple, pad_values=recipe.pad_values
    )


class Trial:
    """One configuration training a fresh copy of the recipe's model on fixed batches."""

    def __init__(
        self,
        recipe: Recipe,
        config: TurboConfig,
        batches: list[Any],
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.recipe = recipe
        self.config = config
        self.batches = batches
        self.turbo = Turbo(config)
        distributed = current_env().is_distributed
        #: DDP's gradient traffic, counted when running under torchrun with strategy = "ddp".
        self.comm = CommStats() if distributed and config.distributed.strategy == "ddp" else None
        model, optimizer = recipe.build()
        begin = clock()
        # Under torchrun the engine wraps the model per [distributed] (DDP or FSDP2).
        self.model, self.optimizer, _ = self.turbo.setup(model, optimizer, comm_stats=self.comm)
        #: Seconds the engine's setup took (the techniques' one-time work done before the first
        #: step, compile's probe of the CPU among them): part of the first step's one-time cost.
        self.setup_s = clock() - begin
        #: Per optimizer window: (micro-steps, bytes, seconds) of gradient communication.
        self.comm_windows: list[tuple[int, int, float]] = []
        self._window_steps = 0
        self.losses: list[torch.Tensor] = []
        #: Median seconds per step from the latest interleaved measurement (set by callers).
        self.step_seconds: float | None = None
        self.counts: list[torch.Tensor] = []
        #: Steps taken so far: the next batch is ``batches[position % len(batches)]``.
        self.position = 0
        #: This trial's RNG stream, starting where the seeded model initialization left it.
        self._rng = _rng_state(self.turbo.device)
        self._activation_bytes: int | None = None

    def step(self) -> None:
        device = self.turbo.device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            _set_rng_state(self._rng, device)
            batch = self.batches[self.position % len(self.batches)]
            metrics = self.turbo.step(self.recipe.loss_fn, batch)
            self.position += 1
            self._rng = _rng_state(device)
        self.losses.append(metrics.loss)
        self.counts.append(metrics.count)
        self._window_steps += 1
        if self.comm is not None and metrics.optimizer_stepped:
            # The window's all-reduce ran in its last micro-step; backward has waited for it.
            self.comm_windows.append((self._window_steps, self.comm.bytes, self.comm.seconds))
            self.comm.reset()
        if metrics.optimizer_stepped:
            self._window_steps = 0

    def align_with(self, other: Trial) -> None:
        """Skip ahead (without training) to the batch ``other`` takes next, when both cycle
        through the same batches: interleaved steps then time the same batch for both, which
        matters when batches differ in cost (variable-length text)."""
        if self.batches is other.batches:
            self.position += (other.position - self.position) % len(self.batches)

    def comm_per_step(self) -> tuple[int, float | None] | None:
        """(bytes, seconds) of gradient communication per step (per micro-batch, like step
        time: with accumulation one all-reduce serves several steps), over the later half of the
        optimizer windows (after DDP's first-window bucket rebuild and PowerSGD's plain warm-up).
        Seconds are None where they are not measured (NCCL, see ``CommStats.timed``); the whole
        is None when nothing is counted."""
        recent = self.comm_windows[len(self.comm_windows) // 2 :]
        if self.comm is None or not recent:
            return None
        steps = sum(window[0] for window in recent)
        sent = sum(window[1] for window in recent) // steps
        seconds = sum(window[2] for window in recent) / steps if self.comm.timed else None
        return sent, seconds

    def recent_count(self, steps: int) -> float:
        """Samples (or tokens) of the last ``steps`` steps, summed over the ranks under torchrun
        (a collective there, like :meth:`mean_count`)."""
        recent = [count.to("cpu", torch.float64) for count in self.counts[-steps:]]
        total = torch.stack(recent).sum() if recent else torch.zeros((), dtype=torch.float64)
        if current_env().is_distributed:
            total = total.to(self.turbo.device)
            dist.all_reduce(total)
        return float(total)

    def loss_curve(self) -> list[float]:
        return [float(loss) for loss in self.losses]

    def mean_count(self) -> float:
        """Samples (or tokens) per step, the numerator of throughput: this process's mean, summed
        over the ranks under torchrun (where it is a collective: every rank must call it at the
        same point)."""
        counts = [count.to("cpu", torch.float64) for count in self.counts]
        mean = torch.stack(counts).mean() if counts else torch.zeros((), dtype=torch.float64)
        if current_env().is_distributed:
            mean = mean.to(self.turbo.device)
            dist.all_reduce(mean)
        return float(mean)

    def memory_footprint(self) -> tuple[int | None, str]:
        """(bytes, kind): the memory one training step of this trial needs.

        On CUDA: the allocator peak the step adds over what was allocated before it, plus the
        parameters and optimizer state that persist between steps. Counting only what this trial
        adds keeps the other trials living in the same process (the tuner and the benchmarks
        interleave several) out of its figure.

        On CPU there is no allocator peak, and the process RSS barely moves between steps (freed
        memory stays mapped), so the figure is an estimate built from exact parts: bytes saved
        for backward + parameters + gradients (same size) + optimizer state. Compiled models are
        counted the same way (torch >= 2.13's compiled autograd functions save through the
        saved-tensor hooks); where a torch hides them (nothing counted), the figure is None with
        that reason rather than a guess.
        """
        persistent = sum(_nbytes(p) for p in self.model.parameters())
        persistent += sum(
            _nbytes(v)
            for state in self.optimizer.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor)
        )
        if self.turbo.device.type == "cpu":
            saved = self.activation_bytes()
            if saved is None:
                return None, "n/a: this torch's compiled graphs hide their saved tensors"
            gradients = sum(_nbytes(p) for p in self.model.parameters() if p.requires_grad)
            return saved + gradients + persistent, "cpu_estimate"
        with track_peak_memory(self.turbo.device) as peak:
            self.step()
        return max(0, peak.peak_bytes - peak.baseline_bytes) + persistent, peak.kind

    def activation_bytes(self) -> int | None:
        """Bytes held for backward after one forward of the first batch (of its first piece
        with ``[accumulation] micro_batches``); None for a compiled model whose saved tensors no
        hook saw (older torch saves them inside the compiled autograd function, out of reach: a
        number there would be wrong, not approximate).
        Measured once: the shapes, hence the bytes, do not change as the trial trains.
        """
        if self._activation_bytes is None:
            # A step holds one piece's activations at a time: with micro-batches, the first
            # (the largest: pieces differ by at most one sample).
            assert self.turbo.microbatcher is not None
            split = self.turbo.microbatcher.split
            batch = split_batch(self.batches[0], split)[0] if split > 1 else self.batches[0]
            # As a micro-step that does not close its window: under DDP, no_sync(), since a
            # forward outside it expects a backward with its all-reduce to follow.
            assert self.turbo.strategy is not None
            with self.turbo.strategy.backward_context(closing=False), self.turbo.switches():
                self._activation_bytes = activation_bytes(
                    lambda: self.turbo.forward(self.recipe.loss_fn, batch)[0], model=self.model
                )
            self.optimizer.zero_grad(set_to_none=True)
        if self._activation_bytes == 0 and self.config.compile.mode != "off":
            return None
        return self._activation_bytes

    def close(self) -> None:
        self.turbo.close()


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def _nbytes(tensor: torch.Tensor) -> int:
    """Bytes this process holds (an FSDP2 shard's local part, a quantised state's codes)."""
    return tensor_bytes(tensor)


def planned_batches(
    recipe: Recipe, config: TurboConfig, count: int, plan: BatchPlan | None = None
) -> list[Any]:
    """``count`` batches ``config`` trains the recipe on: the first of its batch plan's
    (``registry.batch_plan``, as the engine, ``TurboTrainer`` and the Lightning callback build
    it for this config and seed; ``plan`` when already built), or, when no technique plans
    them, the user's rows that cost what the job's steps do (:func:`representative_batches`)."""
    plan = plan or registry.batch_plan(config, recipe_source(recipe))
    if not plan.dynamic:
        return representative_batches(recipe, count, pad_to_multiple=config.data.pad_to_multiple)
    return plan.first_batches(recipe.dataset, count)


def epoch_tokens_per_step(recipe: Recipe, plan: BatchPlan) -> float | None:
    """The tokens a step holds on average over an epoch of ``plan`` (summed over the ranks, as
    ``Trial.mean_count``): the recipe's lengths over the plan's batches per epoch (the user's
    rows: one per ``batch_size`` samples, the last one short). None where the recipe counts
    samples, has no lengths, or the plan cannot list an epoch. A trial's few batches are a small
    sample of long-tailed lengths (a 45M decoder's fp32 trial held 68,062 tokens per 100 steps,
    its job 78,711): what a job trains is the epoch's."""
    lengths = recipe.lengths
    if recipe.count_unit != "tokens" or lengths is None or not recipe.batch_size:
        return None
    if not plan.dynamic:
        batches = user_batches(len(lengths), recipe.batch_size)
    elif isinstance(plan.sampler, PlannedSampler):
        batches = len(plan.sampler.global_batches())
    else:
        return None
    return sum(int(n) for n in lengths) / batches * current_env().world_size if batches else None


class TrialBatches:
    """Each batch plan's first ``count`` batches of a recipe, drawn on first use and kept:
    trials whose configs plan the same batches (``registry.batch_key``) share one list, so that
    interleaved steps time the same batch on both sides."""

    def __init__(self, recipe: Recipe, count: int) -> None:
        self.recipe = recipe
        self.count = count
        self._drawn: dict[Hashable, list[Any]] = {}
        self._plans: dict[Hashable, BatchPlan] = {}

    def __call__(self, config: TurboConfig) -> list[Any]:
        key = registry.batch_key(config)
        if key not in self._drawn:
            plan = self._plans[key] = registry.batch_plan(config, recipe_source(self.recipe))
            self._drawn[key] = planned_batches(self.recipe, config, self.count, plan)
        return self._drawn[key]

    def tokens_per_step(self, config: TurboConfig) -> float | None:
        """``config``'s job's tokens per step over an epoch (:func:`epoch_tokens_per_step`), from
        the plan its trial's batches were drawn from."""
        self(config)
        return epoch_tokens_per_step(self.recipe, self._plans[registry.batch_key(config)])

    def shorten(self, count: int) -> None:
        """Keep ``count`` batches per plan from now on: the lists already drawn are cut in
        place, so the trials holding them cycle through the same fewer batches."""
        self.count = min(self.count, count)
        for batches in self._drawn.values():
            del batches[self.count :]


def recipe_source(recipe: Recipe) -> BatchSource:
    """The recipe's data as a batch plan's source: this rank's share of whole batches, the
    recipe's collate and seed, and a fresh model of the recipe for plans that read it."""
    env = current_env()
    return BatchSource(
        recipe.dataset,
        recipe.lengths,
        recipe.batch_size,
        seed=recipe.seed,
        num_replicas=env.world_size,
        rank=env.rank,
        collate=recipe.collate,
        pad_values=recipe.pad_values,
        model=lambda: recipe.build()[0],
    )


def start_trial(
    recipe: Recipe,
    config: TurboConfig,
    batches: list[Any],
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[Trial, float]:
    """A new trial and the time of its setup and first step, which carry the one-time costs
    (compile, autotuning) and are therefore reported apart from steady-state step time."""
    trial = Trial(recipe, config, batches, clock)
    try:
        return trial, trial.setup_s + time_once(trial.step, trial.turbo.device, clock)
    except BaseException:
        trial.close()
        raise
