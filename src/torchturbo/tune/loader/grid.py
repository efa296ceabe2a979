"""Loader settings tuned by measurement: the grid search of the tuner's data stage.

Why measure instead of a rule: the article's "num_workers = 2-4x CPU cores" contradicts its own
warning in the next sentence, and the best setting depends on the per-sample cost, the batch
size, the free cores and the memory, none of which a rule knows. Automatic num_workers tuning has
been an open PyTorch request since 2019 (pytorch/pytorch#23048), so :func:`tune_loader` measures
a small grid of settings on the user's own dataset and picks the fastest that fits in memory.

Why memory is part of the choice: workers are forked processes, and CPython's reference counts
write to every object a worker touches, so a dataset held as Python objects (lists of paths,
bytes, dicts) is copied page by page into every worker as it is read (pytorch/pytorch#13246).
:func:`tune_loader` measures each worker's unique resident memory while it runs and rejects
settings whose projected total exceeds a limit.

The tuner runs it from ``tune.search.loader_stage`` when the input may limit the step; it is also
usable alone, on any dataset.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import psutil
import torch
from torch.utils.data import DataLoader, Dataset

from torchturbo.base.device import to_device
from torchturbo.base.nested import iter_tensors
from torchturbo.config import ConfigError, DataConfig
from torchturbo.data.length import length_or_none
from torchturbo.data.loader import build_loader
from torchturbo.measure.system import usable_cores
from torchturbo.measure.timing import Timing, sync

#: prefetch_factor values of the default grid: torch's default, and twice that for bursty samples.
PREFETCH_CHOICES = (2, 4)
#: Settings within this fraction of the fastest count as equally fast (the noise of a busy host).
DEFAULT_TOLERANCE = 0.05
#: Default memory limit of tune_loader: this fraction of the memory available when it starts.
DEFAULT_MEMORY_FRACTION = 0.5
#: Seconds to wait for a measured loader's workers to exit before the next candidate starts.
_WORKER_EXIT_TIMEOUT_S = 10.0


def usable_cpus() -> int:
    """CPU cores this process's loader may use: its affinity mask (which containers and taskset
    set), shared with the other processes torchrun started on this machine (LOCAL_WORLD_SIZE),
    so that N ranks do not each start workers for every core."""
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, usable_cores() // max(1, local_processes))


def _tensor_bytes(batch: Any) -> int:
    return sum(t.numel() * t.element_size() for t in iter_tensors(batch))


Verdict = Literal["chosen", "measured", "rejected"]


@dataclass(frozen=True)
class LoaderTrial:
    """One candidate setting and what measuring it found."""

    config: DataConfig
    #: Median steady-state batches per second over the repeats; None when it never ran.
    batches_per_s: float | None
    #: Relative interquartile range of the repeats' seconds per batch (measure.timing.Timing):
    #: 0 with one repeat, None when it never ran.
    spread: float | None
    #: Median seconds from ``iter(loader)`` to the first batch: worker start-up plus one batch.
    startup_s: float | None
    #: Largest unique resident memory (USS) of one worker in bytes: the pages it does not share
    #: with the main process, i.e. what each extra worker costs. 0 without workers.
    worker_rss_bytes: int | None
    #: Projected extra host memory in bytes: workers grown to the whole dataset they will touch,
    #: plus the batches in flight. 0 without workers.
    projected_bytes: int | None
    verdict: Verdict
    reason: str


@dataclass(frozen=True)
class LoaderTuning:
    """What :func:`tune_loader` chose, why, and every candidate's measurement."""

    chosen: DataConfig
    results: list[LoaderTrial]
    #: A sentence saying why ``chosen`` won.
    reason: str
    #: Whether the chosen loader is slower than ``step_seconds``; None when no step time was given.
    input_bound: bool | None
    memory_limit_bytes: int

    @property
    def chosen_trial(self) -> LoaderTrial:
        return next(t for t in self.results if t.verdict == "chosen")


def default_candidates(device: torch.device | str) -> list[DataConfig]:
    """The default grid: no workers, then 1, 2, 4, ... workers up to the usable cores (never
    more), each with prefetch_factor 2 and 4 and persistent workers; pinned memory on CUDA only.

    Small on purpose: 5 settings on 2 cores, 11 on 16, 15 on 64.
    """
    cores = usable_cpus()
    pin = torch.device(device).type == "cuda"
    counts = sorted({*(2**i for i in range(cores.bit_length()) if 2**i <= cores), cores})
    grid = [DataConfig(num_workers=0, pin_memory=pin)]
    for workers in counts:
        grid.extend(
            DataConfig(
                num_workers=workers,
                pin_memory=pin,
                persistent_workers=True,
                prefetch_factor=prefetch,
            )
            for prefetch in PREFETCH_CHOICES
        )
    return grid


def describe(config: DataConfig) -> str:
    """A short label for a loader setting, e.g. ``workers=2 prefetch=4 persistent``."""
    parts = [f"workers={config.num_workers}"]
    if config.num_workers:
        parts.append(f"prefetch={config.prefetch_factor or 2}")
        if config.persistent_workers:
            parts.append("persistent")
    if config.pin_memory:
        parts.append("pinned")
    return " ".join(parts)


@dataclass
class _Run:
    """One timed run of one candidate."""

    batches_per_s: float
    startup_s: float
    worker_bytes: int
    projected_worker_bytes: int
    batch_bytes: int


def tune_loader(
    dataset: Dataset,
    batch_size: int,
    *,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    device: torch.device | str,
    candidates: Sequence[DataConfig | Mapping[str, Any]] | None = None,
    batches: int = 20,
    warmup_batches: int = 3,
    repeats: int = 3,
    step_seconds: float | None = None,
    memory_limit_bytes: int | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
) -> LoaderTuning:
    """Measure the loader alone for each candidate setting and choose by measurement.

    Each candidate is built fresh, started (the time to its first batch is ``startup_s``),
    warmed up for ``warmup_batches`` (at least the batches its workers prefetch), then timed over
    ``batches`` batches, fetched and moved to ``device`` (synchronized before the clock is read).
    With workers both counts are rounded up to whole multiples of ``num_workers``: workers
    deliver in bursts, and a clock started mid-burst would count batches made before it started.
    The grid runs ``repeats`` times, each round in a rotated order so that drifting machine load
    hits every candidate alike, and medians are compared. Candidates default to
    :func:`default_candidates`; a mapping is validated as a ``[data]`` config section
    (:class:`ConfigError` on invalid settings).

    Memory: while a candidate runs, the unique memory of each of its worker processes is read
    (psutil); its growth per sample is extrapolated to every sample a worker will touch (all of
    them for persistent workers, which see the whole dataset over the epochs) and batches in
    flight are added. A candidate whose projection exceeds ``memory_limit_bytes`` (default: half
    the memory available at the start) is rejected with the figures; one that more workers would
    predictably push over the limit is rejected before it starts.

    Choice: the fastest; among settings within ``tolerance`` of it, the one with the fewest
    workers (then the smallest prefetch), since those are equally fast within the noise and
    cost less memory and fewer cores. The reason says which case applied.

    ``input_bound`` (with ``step_seconds``, the compute time of one training step): True when the
    chosen loader needs longer per batch than the step. This compares the loader measured alone
    with compute measured alone. With workers the two overlap, so the slower one sets the pace;
    without workers they run in series, so loading adds to every step whatever the verdict. When
    training runs on the CPU, workers and compute share the same cores: on a 2-core machine two
    workers and the model's threads compete, the loader delivers less than it did alone, and a
    loader that looks slightly faster than the step may still hold it back. The reason says so.

    A stream (an ``IterableDataset``) is measured as given: it must split itself among workers
    (``torch.utils.data.get_worker_info``), or every worker yields all of it and the rate counts
    each sample once per worker. The tuner tries no worker setting on a stream for that reason.
    """
    device = torch.device(device)
    _check_tune_args(batch_size, batches, warmup_batches, repeats, step_seconds, tolerance)
    configs = _validated_candidates(device if candidates is None else candidates)
    if memory_limit_bytes is None:
        memory_limit_bytes = int(psutil.virtual_memory().available * DEFAULT_MEMORY_FRACTION)
    elif isinstance(memory_limit_bytes, bool) or memory_limit_bytes <= 0:
        raise ValueError(
            f"tune_loader: memory_limit_bytes={memory_limit_bytes!r} is invalid: expected a "
            "positive number of bytes (or None for half the available memory)"
        )

    def measure(config: DataConfig) -> _Run:
        return _measure(dataset, batch_size, collate_fn, device, config, batches, warmup_batches)

    runs, rejections = _run_rounds(configs, measure, repeats, memory_limit_bytes)
    return _choose(configs, runs, rejections, tolerance, step_seconds, device, memory_limit_bytes)


def _check_tune_args(
    batch_size: int,
    batches: int,
    warmup_batches: int,
    repeats: int,
    step_seconds: float | None,
    tolerance: float,
) -> None:
    for name, value, low in (
        ("batch_size", batch_size, 1),
        ("batches", batches, 1),
        ("warmup_batches", warmup_batches, 0),
        ("repeats", repeats, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"tune_loader: {name}={value!r} is invalid: expected an int >= {low}")
    if step_seconds is not None and not step_seconds > 0:
        raise ValueError(
            f"tune_loader: step_seconds={step_seconds!r} is invalid: expected seconds > 0 or None"
        )
    if not 0 <= tolerance < 1:
        raise ValueError(f"tune_loader: tolerance={tolerance!r} is invalid: expected 0 <= x < 1")


def _validated_candidates(
    candidates: torch.device | Sequence[DataConfig | Mapping[str, Any]],
) -> list[DataConfig]:
    if isinstance(candidates, torch.device):
        return default_candidates(candidates)
    configs: list[DataConfig] = []
    for i, candidate in enumerate(candidates):
        if isinstance(candidate, Mapping):
            settings = dict(candidate)
            try:
                candidate = DataConfig(**settings)
            except TypeError as err:  # unknown keys
                raise ConfigError(f"tune_loader: candidate #{i} {settings}: {err}") from err
            except ConfigError as err:
                raise ConfigError(f"tune_loader: candidate #{i}: {err}") from err
        if not isinstance(candidate, DataConfig):
            raise ConfigError(
                f"tune_loader: candidate #{i} is a {type(candidate).__name__}; expected a "
                "DataConfig or a dict of its fields"
            )
        if candidate in configs:
            raise ConfigError(f"tune_loader: candidate #{i} ({describe(candidate)}) is repeated")
        configs.append(candidate)
    if not configs:
        raise ConfigError("tune_loader: candidates is empty; pass None for the default grid")
    return configs


def _run_rounds(
    configs: list[DataConfig],
    measure: Callable[[DataConfig], _Run],
    repeats: int,
    memory_limit: int,
) -> tuple[dict[DataConfig, list[_Run]], dict[DataConfig, str]]:
    """Measure every candidate ``repeats`` times in rotated order; reject by memory on the way.

    The first round goes from the fewest workers up, so that a per-worker figure measured with
    few workers can keep a setting with many from starting at all when it would not fit.
    """
    order = sorted(configs, key=lambda c: (c.num_workers, c.prefetch_factor or 0))
    runs: dict[DataConfig, list[_Run]] = {c: [] for c in configs}
    rejections: dict[DataConfig, str] = {}
    for round_index in range(repeats):
        shift = round_index % len(order)
        for config in order[shift:] + order[:shift]:
            if config in rejections:
                continue
            predicted = _predict(config, runs) if round_index == 0 else None
            if predicted is not None and predicted > memory_limit:
                rejections[config] = (
                    f"not started: the per-worker memory measured so far predicts "
                    f"{_mib(predicted)} for {config.num_workers} workers, over the "
                    f"{_mib(memory_limit)} limit"
                )
                continue
            run = measure(config)
            runs[config].append(run)
            projected = _projected_bytes(config, run)
            if projected > memory_limit:
                rejections[config] = (
                    f"projected {_mib(projected)} ({config.num_workers} workers x "
                    f"{_mib(run.projected_worker_bytes)}, plus batches in flight) exceeds the "
                    f"{_mib(memory_limit)} limit"
                )
    return runs, rejections


def _predict(config: DataConfig, runs: dict[DataConfig, list[_Run]]) -> int | None:
    """Memory of ``config`` predicted from the largest per-worker figure measured so far."""
    if config.num_workers == 0:
        return None
    measured = [r for rs in runs.values() for r in rs if r.projected_worker_bytes]
    if not measured:
        return None
    worker = max(r.projected_worker_bytes for r in measured)
    batch_bytes = max(r.batch_bytes for r in measured)
    return config.num_workers * worker + _in_flight_bytes(config, batch_bytes)


def _projected_bytes(config: DataConfig, run: _Run) -> int:
    if config.num_workers == 0:
        return 0  # the main process reads the dataset it already holds: nothing is copied
    workers = config.num_workers * run.projected_worker_bytes
    return workers + _in_flight_bytes(config, run.batch_bytes)


def _in_flight_bytes(config: DataConfig, batch_bytes: int) -> int:
    # Each worker keeps up to prefetch_factor batches in shared memory; pinning copies each once.
    copies = 2 if config.pin_memory else 1
    return config.num_workers * (config.prefetch_factor or 2) * batch_bytes * copies


def _measure(
    dataset: Dataset,
    batch_size: int,
    collate_fn: Callable[[list[Any]], Any] | None,
    device: torch.device,
    config: DataConfig,
    batches: int,
    warmup_batches: int,
) -> _Run:
    """One run of one candidate: start-up, warm-up, timed batches, worker memory; then shut down."""
    loader = build_loader(
        dataset,
        batch_size=batch_size,
        config=config,
        device=device,
        collate_fn=collate_fn,
        drop_last=True,  # equal batches: a short last batch would flatter the rate
        seed=0,  # every candidate reads the samples in the same order
    )
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    main_bytes = _unique_bytes([me]).get(me.pid, 0)
    stream = _endless(loader)
    start = time.perf_counter()
    first = to_device(next(stream), device, non_blocking=config.non_blocking)
    sync(device)
    startup_s = time.perf_counter() - start
    workers = [p for p in me.children(recursive=True) if p.pid not in before]
    memory_start = _unique_bytes(workers)
    # While memory was read the workers filled all their prefetch slots: the warm-up drains them.
    # Worker w makes batches w, w + n, w + 2n, ... (n workers, delivered in order), so batches
    # come in bursts [k*n, (k+1)*n); the clock starts and stops on burst boundaries, or the rest
    # of a burst made before it started would count as free.
    burst = max(1, config.num_workers)
    backlog = config.num_workers * (config.prefetch_factor or 2)
    before_clock = _round_up(1 + max(warmup_batches, backlog), burst)
    timed = _round_up(batches, burst)
    for _ in range(before_clock - 1):
        to_device(next(stream), device, non_blocking=config.non_blocking)
    start = time.perf_counter()
    for _ in range(timed):
        to_device(next(stream), device, non_blocking=config.non_blocking)
    sync(device)
    elapsed = time.perf_counter() - start
    memory_end = _unique_bytes(workers)
    # Drop every reference to the iterator so that its workers exit now, not during the next
    # candidate's timing (a persistent loader keeps its iterator alive in loader._iterator).
    stream.close()
    del loader, stream
    psutil.wait_procs(workers, timeout=_WORKER_EXIT_TIMEOUT_S)
    growth = max((memory_end[pid] - memory_start.get(pid, 0) for pid in memory_end), default=0)
    now = max(memory_end.values(), default=0)
    return _Run(
        batches_per_s=timed / elapsed,
        startup_s=startup_s,
        worker_bytes=now,
        projected_worker_bytes=_extrapolate(
            config,
            now,
            growth_per_sample=growth * burst / ((before_clock - 1 + timed) * batch_size),
            samples_seen=(before_clock + timed) * batch_size,
            dataset_len=length_or_none(dataset),
            ceiling=main_bytes,
        ),
        batch_bytes=_tensor_bytes(first),
    )


def _round_up(count: int, multiple: int) -> int:
    return -(-count // multiple) * multiple


def _extrapolate(
    config: DataConfig,
    now: int,
    *,
    growth_per_sample: float,
    samples_seen: int,
    dataset_len: int | None,
    ceiling: int,
) -> int:
    """Memory of one worker once it has touched every sample it will ever read.

    ``growth_per_sample`` (one worker's growth per sample it read) is extended linearly to the
    samples not read yet: the whole dataset for persistent workers (the sampler deals indices
    afresh every epoch), 1/num_workers of it for workers forked again each epoch. Linear
    overstates random access (a copied page also holds neighbours not read yet), so the growth
    is capped at ``ceiling``, the main process's unique memory at the fork: a worker cannot copy
    more than there is.
    """
    if config.num_workers == 0 or dataset_len is None:
        return now
    touched = dataset_len if config.persistent_workers else dataset_len / config.num_workers
    remaining = max(0.0, touched - samples_seen / config.num_workers)
    return now + int(min(max(0.0, growth_per_sample) * remaining, ceiling))


def _endless(loader: DataLoader) -> Generator[Any, None, None]:
    """Batches across epoch boundaries, as training sees them (persistent workers live on)."""
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise ValueError(
                "tune_loader: the loader yields no full batch: the dataset has fewer samples "
                "than batch_size"
            )


def _unique_bytes(processes: list[psutil.Process]) -> dict[int, int]:
    """Unique set size (USS) by pid. Not RSS: RSS counts the pages a worker shares
    copy-on-write with the main process, and summing it would count the main process per worker."""
    sizes = {}
    for process in processes:
        try:
            sizes[process.pid] = process.memory_full_info().uss
        except psutil.AccessDenied:
            sizes[process.pid] = process.memory_info().rss
        except psutil.NoSuchProcess:  # a worker that already exited holds no memory
            continue
    return sizes


def _choose(
    configs: list[DataConfig],
    runs: dict[DataConfig, list[_Run]],
    rejections: dict[DataConfig, str],
    tolerance: float,
    step_seconds: float | None,
    device: torch.device,
    memory_limit: int,
) -> LoaderTuning:
    timings = {c: Timing([1 / r.batches_per_s for r in rs]) for c, rs in runs.items() if rs}
    rates = {c: 1 / t.median for c, t in timings.items()}
    accepted = [c for c in configs if c in rates and c not in rejections]
    if not accepted:
        details = "; ".join(f"{describe(c)}: {rejections[c]}" for c in configs)
        raise ValueError(f"tune_loader: every candidate was rejected: {details}")
    fastest = max(accepted, key=rates.__getitem__)
    near = [c for c in accepted if rates[c] >= rates[fastest] * (1 - tolerance)]
    chosen = min(near, key=lambda c: (c.num_workers, c.prefetch_factor or 0, -rates[c]))
    reason = _choice_sentence(chosen, fastest, rates, tolerance, configs)
    if rejections:
        reason += f" {len(rejections)} setting(s) rejected for memory (limit {_mib(memory_limit)})."
    input_bound = None
    if step_seconds is not None:
        input_bound = 1 / rates[chosen] > step_seconds
        reason += " " + _bound_sentence(chosen, rates[chosen], step_seconds, device)
    trials = [
        _trial(c, runs[c], timings.get(c), rates, chosen, fastest, tolerance, rejections)
        for c in configs
    ]
    return LoaderTuning(
        chosen=chosen,
        results=trials,
        reason=reason,
        input_bound=input_bound,
        memory_limit_bytes=memory_limit,
    )


def _choice_sentence(
    chosen: DataConfig,
    fastest: DataConfig,
    rates: dict[DataConfig, float],
    tolerance: float,
    configs: list[DataConfig],
) -> str:
    baseline = next((c for c in configs if c.num_workers == 0 and c in rates), None)
    versus = ""
    if baseline is not None and baseline != chosen:
        ratio = rates[chosen] / rates[baseline]
        versus = f", {ratio:.2f}x the {rates[baseline]:.1f}/s of no workers"
    if chosen == fastest:
        return f"Chose {describe(chosen)}: the fastest, {rates[chosen]:.1f} batches/s{versus}."
    return (
        f"Chose {describe(chosen)} at {rates[chosen]:.1f} batches/s{versus}: within "
        f"{tolerance:.0%} of the fastest ({describe(fastest)}, {rates[fastest]:.1f}/s), which is "
        "within the noise, so the one with fewer workers or less prefetch wins (less memory, "
        "fewer cores taken from compute)."
    )


def _bound_sentence(
    chosen: DataConfig, rate: float, step_seconds: float, device: torch.device
) -> str:
    load_s = 1 / rate
    if load_s > step_seconds:
        sentence = (
            f"Input-bound: a batch takes {load_s * 1e3:.1f} ms to load against a "
            f"{step_seconds * 1e3:.1f} ms step, so the step waits for data"
        )
    else:
        sentence = (
            f"Compute-bound: a batch takes {load_s * 1e3:.1f} ms to load against a "
            f"{step_seconds * 1e3:.1f} ms step"
        )
    if chosen.num_workers == 0:
        sentence += "; without workers loading runs in series with compute and adds to every step"
    elif device.type == "cpu":
        sentence += (
            f"; on a CPU device the {chosen.num_workers} worker(s) share {usable_cpus()} cores "
            "with compute, so loading runs slower during training than it did alone"
        )
    return sentence + "."


def _trial(
    config: DataConfig,
    runs: list[_Run],
    timing: Timing | None,
    rates: dict[DataConfig, float],
    chosen: DataConfig,
    fastest: DataConfig,
    tolerance: float,
    rejections: dict[DataConfig, str],
) -> LoaderTrial:
    rate = rates.get(config)
    verdict: Verdict = "measured"
    if config in rejections:
        verdict, reason = "rejected", rejections[config]
    elif config == chosen:
        verdict, reason = "chosen", "chosen"
    elif rates[config] >= rates[fastest] * (1 - tolerance):
        reason = f"within {tolerance:.0%} of the fastest, but more workers or prefetch"
    else:
        reason = f"{rates[config] / rates[chosen]:.2f}x the chosen setting's rate"
    return LoaderTrial(
        config=config,
        batches_per_s=rate,
        spread=timing.spread if timing else None,
        startup_s=statistics.median(r.startup_s for r in runs) if runs else None,
        worker_rss_bytes=max(r.worker_bytes for r in runs) if runs else None,
        projected_bytes=max(_projected_bytes(config, r) for r in runs) if runs else None,
        verdict=verdict,
        reason=reason,
    )


def _mib(n_bytes: float) -> str:
    return f"{n_bytes / 2**20:.0f} MiB" if n_bytes >= 2**20 else f"{math.ceil(n_bytes / 2**10)} KiB"
