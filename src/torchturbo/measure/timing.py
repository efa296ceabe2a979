"""Step timing that can be trusted: device sync, warm-up, interleaved repeats, robust statistics.

Every benchmark and the tuner time through :func:`measure_interleaved`. Variants run side by side
in one process, in rounds (A B, then B A, ...) so that drift of the machine (other processes,
thermal state, allocator growth) hits every variant alike, and variants are compared by the ratio
of their medians. ``torch.utils.benchmark.Timer`` times one statement at a time and cannot
interleave several, and it has no notion of the per-run noise band the tuner needs, hence this
small module.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch


def sync(device: torch.device | str) -> None:
    """Wait until all queued work on ``device`` has finished (no-op on CPU, which runs eagerly)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


@dataclass(frozen=True)
class Timing:
    """Per-step seconds of one variant, one sample per timed repeat, and their statistics.

    ``spread`` is the relative interquartile range ``(p75 - p25) / median`` (quartiles by linear
    interpolation between order statistics, i.e. ``statistics.quantiles(method="inclusive")``):
    robust to a single outlier repeat, unlike ``(max - min) / median``. With one sample it is 0.
    """

    samples: list[float]
    median: float = field(init=False)
    spread: float = field(init=False)
    min: float = field(init=False)

    def __post_init__(self) -> None:
        if not self.samples:
            raise ValueError("Timing(samples=[]) is invalid: expected at least one sample")
        if any(s < 0 for s in self.samples):
            raise ValueError(f"Timing(samples={self.samples!r}) is invalid: negative seconds")
        median = statistics.median(self.samples)
        # Frozen dataclass: derived fields are set once here, so asdict() carries them to JSON.
        object.__setattr__(self, "median", median)
        object.__setattr__(self, "spread", _relative_iqr(self.samples, median))
        object.__setattr__(self, "min", min(self.samples))


def _relative_iqr(samples: list[float], median: float) -> float:
    if len(samples) < 2 or median == 0:
        return 0.0
    p25, _, p75 = statistics.quantiles(samples, n=4, method="inclusive")
    return (p75 - p25) / median


def ratio(a: Timing, b: Timing) -> float:
    """Speed of ``a`` relative to ``b``: ``b.median / a.median``; > 1 means ``a`` is faster.

    Typical use: ``ratio(candidate, baseline)`` is the candidate's speed-up.
    """
    if a.median == 0:
        raise ValueError("ratio(a, b) is undefined: a.median is 0 seconds")
    return b.median / a.median


def noise_band(timings: Mapping[str, Timing] | Iterable[Timing]) -> float:
    """The relative noise of one measurement run: the largest ``spread`` among its variants.

    A speed-up is real only if it exceeds this band (the tuner's rule). We take the worst relative
    IQR rather than an A/A comparison because it costs no extra runs, and it is measured under the
    same load as the variants it judges; taking the maximum errs on the side of rejecting.
    """
    values = timings.values() if isinstance(timings, Mapping) else timings
    spreads = [t.spread for t in values]
    if not spreads:
        raise ValueError("noise_band(timings) needs at least one Timing, got none")
    return max(spreads)


def paired_noise(a: Timing, b: Timing) -> float:
    """The relative noise of ``a`` against ``b`` timed round by round on the same inputs: the
    relative IQR of the per-round ratios ``a_r / b_r``.

    When inputs differ in cost (variable-length text), round r times the same costly or cheap
    batches for both variants: each variant's own spread then measures the inputs, not the
    noise, while the per-round ratio cancels them. Both timings must come from one
    :func:`measure_interleaved` call whose variants stepped through the same batches in step.
    """
    if len(a.samples) != len(b.samples):
        raise ValueError(
            f"paired_noise needs one sample per round from both: {len(a.samples)} vs "
            f"{len(b.samples)}"
        )
    ratios = [x / y for x, y in zip(a.samples, b.samples, strict=True)]
    return _relative_iqr(ratios, statistics.median(ratios))


def measure_interleaved(
    variants: Mapping[str, Callable[[], Any]],
    *,
    device: torch.device | str,
    warmup: int = 2,
    repeats: int = 5,
    steps_per_repeat: int = 3,
    on_round: Callable[[int, int], None] | None = None,
) -> dict[str, Timing]:
    """Time each variant's step, interleaving the variants, and return a :class:`Timing` each.

    Each variant first runs ``warmup`` untimed steps (lazy init, allocator growth, autotuning,
    compilation belong here, not in step time; measure those apart with :func:`time_once`).
    Then ``repeats`` rounds: each round times a block of ``steps_per_repeat`` steps of every
    variant, starting with a different variant each round (round r starts at variant r mod n) so
    that no variant always runs first. The device is synchronized before and after every block,
    and a sample is the block's seconds divided by its steps. ``on_round(done, repeats)`` is
    told before each round (for a progress line).
    """
    if not variants:
        raise ValueError("measure_interleaved(variants={}) needs at least one variant")
    _check_count("warmup", warmup, 0)
    _check_count("repeats", repeats, 1)
    _check_count("steps_per_repeat", steps_per_repeat, 1)
    device = torch.device(device)
    names = list(variants)
    for _ in range(warmup):
        for name in names:
            variants[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(repeats):
        if on_round is not None:
            on_round(round_index, repeats)
        start = round_index % len(names)
        for name in names[start:] + names[:start]:
            samples[name].append(_time_block(variants[name], steps_per_repeat, device))
    return {name: Timing(samples[name]) for name in names}


def _check_count(name: str, value: object, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(
            f"measure_interleaved({name}={value!r}) is invalid: expected an int >= {low}"
        )


def _time_block(step: Callable[[], Any], steps: int, device: torch.device) -> float:
    sync(device)
    begin = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    return (time.perf_counter() - begin) / steps


def time_once(
    fn: Callable[[], Any],
    device: torch.device | str,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Seconds of one call of ``fn``, synchronized: for one-time costs such as compilation."""
    device = torch.device(device)
    sync(device)
    begin = clock()
    fn()
    sync(device)
    return clock() - begin
