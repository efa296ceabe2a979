"""Side-by-side measurement of training configurations on one recipe.

A :class:`Trial` is one configuration applied to a fresh model (the recipe's seed fixes the initial
weights) training on a fixed, pre-collated list of batches, so every variant sees the same data in
the same order and input loading is kept out of the compute measurement. Each trial also draws
its random numbers (dropout) from its own stream, so that interleaving trials does not hand them
different dropout masks: loss curves differ only by what the configuration changes.
:func:`compare_configs` times trials interleaved through ``measure.timing`` and adds throughput,
MFU, memory and loss.
The CLI's ``bench``, ``benchmarks/techniques.py`` and the tuner all measure through here.

Under torchrun every rank builds the same trials and steps them in the same order (the
interleaving is deterministic), so their collectives pair up. Each trial's engine wraps its model
(DDP or FSDP2 per ``[distributed]``, see ``Turbo.setup``), each rank trains on its own seeded
batches, throughput counts the samples of all ranks, DDP's gradient traffic is counted per step,
and the other figures (step time, loss, memory) are rank 0's, which is the rank that reports.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, IterableDataset

from torchturbo.config import DataConfig, TurboConfig
from torchturbo.data.bucketing import BucketBatchSampler
from torchturbo.data.collate import pad_collate
from torchturbo.data.length import length_or_none
from torchturbo.distributed.comm import CommStats
from torchturbo.distributed.launch import current_env
from torchturbo.engine import Turbo
from torchturbo.measure.flops import count_step_flops
from torchturbo.measure.memory import activation_bytes, track_peak_memory
from torchturbo.measure.peak import mfu, stated_peak
from torchturbo.measure.timing import Timing, measure_interleaved, time_once
from torchturbo.recipe import Recipe
from torchturbo.techniques.nhwc import has_2d_convolutions


def fixed_batches(recipe: Recipe, count: int, *, seed: int | None = None) -> list[Any]:
    """The first ``count`` batches of a seeded shuffle of the recipe's dataset, collated.

    The default seed is the recipe's plus the process's rank, so that under torchrun each rank
    trains on different batches, as data-parallel ranks do. A stream (an ``IterableDataset``)
    owns its order: its first ``count`` batches, as it yields them (on every rank, unless the
    stream splits itself by rank).
    """
    seed = recipe.seed + current_env().rank if seed is None else seed
    generator = torch.Generator().manual_seed(seed)
    loader = DataLoader(
        recipe.dataset,
        batch_size=recipe.batch_size,
        shuffle=not isinstance(recipe.dataset, IterableDataset),
        collate_fn=recipe.collate_fn(),
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


class Trial:
    """One configuration training a fresh copy of the recipe's model on fixed batches."""

    def __init__(self, recipe: Recipe, config: TurboConfig, batches: list[Any]) -> None:
        self.recipe = recipe
        self.config = config
        self.batches = batches
        self.turbo = Turbo(config)
        distributed = current_env().is_distributed
        #: DDP's gradient traffic, counted when running under torchrun with strategy = "ddp".
        self.comm = CommStats() if distributed and config.distributed.strategy == "ddp" else None
        model, optimizer = recipe.build()
        # Under torchrun the engine wraps the model per [distributed] (DDP or FSDP2).
        self.model, self.optimizer, _ = self.turbo.setup(model, optimizer, comm_stats=self.comm)
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
        """Bytes held for backward after one forward of the first batch; None for a compiled
        model whose saved tensors no hook saw (older torch saves them inside the compiled
        autograd function, out of reach: a number there would be wrong, not approximate).
        Measured once: the shapes, hence the bytes, do not change as the trial trains.
        """
        if self._activation_bytes is None:
            batch = self.batches[0]
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
    """Bytes this process holds: for an FSDP2 shard (a DTensor), its local part only."""
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    return tensor.numel() * tensor.element_size()


@dataclass(frozen=True)
class VariantResult:
    """One row of a comparison; ``ratio`` is throughput over the baseline's, same run."""

    variant: str
    throughput: float
    unit: str
    ratio: float
    step_ms_median: float
    step_ms_spread: float
    mfu: float | None
    peak_memory_bytes: int | None
    peak_memory_kind: str
    activation_bytes: int | None
    loss_first: float
    loss_last: float
    first_step_s: float
    notes: dict[str, str]
    #: Processes that trained together (torchrun's WORLD_SIZE); throughput counts all of them.
    processes: int = 1
    #: DDP gradient bytes this rank all-reduced per step, and the milliseconds they were in
    #: flight; None when not counted (one process, or FSDP).
    comm_bytes_per_step: int | None = None
    comm_ms_per_step: float | None = None
    #: Share of the token positions computed that were padding (None: no mask in the batches).
    padding: float | None = None
    #: The peak ``mfu`` is stated against (FLOP/s; None where none is known) and its
    #: description: the unit doing the math, measured or datasheet, emulated or not.
    mfu_peak_flops: float | None = None
    mfu_peak: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def model_flops_per_step(recipe: Recipe, batch: Any) -> int:
    """Useful FLOPs of one fp32 eager training step (forward + backward, no recompute)."""
    model, _ = recipe.build()

    def step() -> None:
        out = recipe.loss_fn(model, batch)
        (out[0] if isinstance(out, tuple) else out).backward()

    return count_step_flops(step)


def mean_flops_per_step(recipe: Recipe, batches: list[Any]) -> int:
    """FLOPs of an average step over ``batches``: counted on the first, scaled by token positions
    (padding included: it is computed) where batches differ in length. Attention's quadratic
    term is not scaled, so long-sequence batches are undercounted a little."""
    flops = model_flops_per_step(recipe, batches[0])
    positions = [_positions(batch) for batch in batches]
    sizes = [size for size in positions if size is not None]
    if len(sizes) < len(positions):
        return flops
    return round(flops * (sum(sizes) / len(sizes)) / sizes[0])


def _positions(batch: Any) -> int | None:
    mask = _mask(batch)
    return mask.numel() if mask is not None and mask.numel() else None


def _mask(batch: Any) -> torch.Tensor | None:
    """A batch's token mask (``mask``, or Hugging Face's ``attention_mask``), if it has one."""
    mask = batch.get("mask", batch.get("attention_mask")) if isinstance(batch, Mapping) else None
    return mask if isinstance(mask, torch.Tensor) else None


def compare_configs(
    recipe: Recipe,
    configs: Mapping[str, TurboConfig],
    *,
    baseline: str,
    warmup: int = 2,
    repeats: int = 5,
    steps_per_repeat: int = 3,
    num_batches: int = 8,
    on_progress: Callable[[str], None] | None = None,
) -> list[VariantResult]:
    """Measure every config side by side (interleaved) and return one row per variant."""
    if baseline not in configs:
        raise ValueError(f"baseline {baseline!r} is not among the variants {list(configs)}")
    say = on_progress or (lambda message: None)
    plain = fixed_batches(recipe, num_batches)
    bucketed: list[Any] | None = None
    trials: dict[str, Trial] = {}
    first_step: dict[str, float] = {}
    try:
        for name, config in configs.items():
            say(f"building {name}")
            batches = plain
            if config.data.bucketing and recipe.lengths is not None:
                bucketed = bucketed or bucketed_batches(recipe, num_batches, config.data)
                batches = bucketed
            trials[name], first_step[name] = start_trial(recipe, config, batches)
        say("timing (interleaved)")
        timings = measure_interleaved(
            {name: trial.step for name, trial in trials.items()},
            device=trials[baseline].turbo.device,
            warmup=warmup,
            repeats=repeats,
            steps_per_repeat=steps_per_repeat,
        )
        say("counting FLOPs and memory")
        flops = {
            id(batches): mean_flops_per_step(recipe, batches)
            for batches in {id(t.batches): t.batches for t in trials.values()}.values()
        }
        return _rows(recipe, trials, timings, first_step, flops, baseline)
    finally:
        for trial in trials.values():
            trial.close()


def bucketed_batches(recipe: Recipe, count: int, data: DataConfig | None = None) -> list[Any]:
    """The first ``count`` length-bucketed batches of the recipe's dataset, collated as the
    engine collates them: ``[data] max_tokens`` per batch, else the token budget of the recipe's
    random batches (batch size x mean length), so both compute about as many real tokens."""
    if recipe.lengths is None:
        raise ValueError(f"recipe {recipe.name!r} gives no per-sample lengths to bucket by")
    data = data or DataConfig()
    lengths = list(recipe.lengths)
    budget = data.max_tokens or max(
        round(recipe.batch_size * sum(lengths) / len(lengths)), max(lengths)
    )
    sampler = BucketBatchSampler(
        lengths, max_tokens=budget, pad_to_multiple=data.pad_to_multiple, seed=recipe.seed
    )
    collate = recipe.collate or functools.partial(
        pad_collate, pad_to_multiple=data.pad_to_multiple, pad_values=recipe.pad_values
    )
    batches = []
    for indices in sampler:
        batches.append(collate([recipe.dataset[i] for i in indices]))
        if len(batches) == count:
            break
    return batches


def padding_of(batches: list[Any]) -> float | None:
    """Padded share of the token positions in ``batches``, read from their ``mask`` or
    ``attention_mask``; None when they carry neither."""
    masks = [m for m in (_mask(batch) for batch in batches) if m is not None]
    if not masks:
        return None
    total = sum(m.numel() for m in masks)
    return 1 - sum(int(m.bool().sum()) for m in masks) / total if total else None


def _notes(recipe: Recipe, trial: Trial) -> dict[str, str]:
    """What the engine could not apply, and the [data] settings bench does not exercise."""
    notes = {k: v for k, v in trial.turbo.applied.items() if v is not None}
    data = trial.config.data
    loader = {f.name: getattr(data, f.name) for f in dataclasses.fields(data)}
    changed = [
        k for k, v in loader.items() if k in _LOADER_FIELDS and v != getattr(DataConfig(), k)
    ]
    if changed:
        settings = ", ".join(f"{k}={loader[k]}" for k in changed)
        notes["loader settings"] = (
            f"{settings}: bench trains on pre-collated batches; torchturbo doctor --config "
            "measures the loader"
        )
    if data.bucketing and recipe.lengths is None:
        notes["bucketing"] = "the recipe gives no per-sample lengths to bucket by"
    if trial.position and not trial.turbo.optimizer_steps:
        notes["accumulation"] = (
            f"no optimizer step in {trial.position} micro-batches ([accumulation] steps = "
            f"{trial.config.accumulation.steps}): the loss column shows no training; "
            "give bench more --steps to see one"
        )
    return notes


#: The [data] fields that configure the DataLoader rather than the batches.
_LOADER_FIELDS = ("num_workers", "pin_memory", "persistent_workers", "prefetch_factor")


def start_trial(
    recipe: Recipe,
    config: TurboConfig,
    batches: list[Any],
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[Trial, float]:
    """A new trial and the time of its first step, which carries the one-time costs (compile,
    autotuning) and is therefore reported apart from steady-state step time."""
    trial = Trial(recipe, config, batches)
    try:
        return trial, time_once(trial.step, trial.turbo.device, clock)
    except BaseException:
        trial.close()
        raise


def _rows(
    recipe: Recipe,
    trials: Mapping[str, Trial],
    timings: Mapping[str, Timing],
    first_step: Mapping[str, float],
    flops: Mapping[int, int],
    baseline: str,
) -> list[VariantResult]:
    throughput = {n: t.mean_count() / timings[n].median for n, t in trials.items()}
    rows = []
    for name, trial in trials.items():
        device = trial.turbo.device
        fmt, why = row_format(trial)
        peak = stated_peak(device, fmt)
        curve = trial.loss_curve()  # before the memory probe, so every row ends on one step
        memory_bytes, memory_kind = trial.memory_footprint()
        comm = trial.comm_per_step()
        rows.append(
            VariantResult(
                variant=name,
                throughput=throughput[name],
                unit=f"{recipe.count_unit}/s",
                ratio=throughput[name] / throughput[baseline],
                step_ms_median=timings[name].median * 1e3,
                step_ms_spread=timings[name].spread,
                mfu=None
                if peak.flops is None
                else mfu(flops[id(trial.batches)], timings[name].median, peak.flops),
                peak_memory_bytes=memory_bytes,
                peak_memory_kind=memory_kind,
                activation_bytes=trial.activation_bytes(),
                loss_first=curve[0],
                loss_last=curve[-1],
                first_step_s=first_step[name],
                notes=_notes(recipe, trial),
                padding=padding_of(trial.batches),
                processes=current_env().world_size,
                comm_bytes_per_step=None if comm is None else comm[0],
                comm_ms_per_step=None if comm is None or comm[1] is None else comm[1] * 1e3,
                mfu_peak_flops=peak.flops,
                mfu_peak=peak.describe() + (f" ({why})" if why else ""),
            )
        )
    return rows


def row_format(trial: Trial) -> tuple[str, str]:
    """The number format of the unit doing most of a trial's maths, and why where that is not
    its precision: fp8 where float8 applied; tf32 for an fp32 model with convolutions on CUDA,
    where cuDNN runs them as TF32 by default (against the fp32 CUDA-core peak such a row could
    show far above 100%)."""
    if trial.turbo.applied.get("float8", "not requested") is None:
        return "fp8", "its Linear layers run in fp8"
    dtype = trial.config.precision.dtype
    tf32_convolutions = trial.turbo.device.type == "cuda" and torch.backends.cudnn.allow_tf32
    if dtype == "fp32" and tf32_convolutions and has_2d_convolutions(trial.model):
        return "tf32", "cuDNN runs fp32 convolutions as TF32: torch.backends.cudnn.allow_tf32"
    return dtype, ""
