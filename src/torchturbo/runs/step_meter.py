"""Per-optimizer-step training metrics from ``Turbo.step``, handed to a metrics logger.

:class:`StepMeter` watches the :class:`~torchturbo.engine.StepMetrics` of every micro-step and,
each time an optimizer step closes a window, logs:

- ``train/loss``: the window's loss, weighted by each micro-batch's count (the mean over every
  sample or token of the window, which is what exact accumulation optimizes);
- ``train/<unit>_per_s`` and ``train/step_ms``: samples or tokens of the window over the wall time
  since the previous optimizer step (device synchronized), so loading, forward, backward and the
  optimizer all count, as they do in a real run;
- ``train/mfu``: model FLOPs per second over the machine's measured peak, when the meter knows the
  FLOPs per sample or token (:func:`unit_flops`; exact for fixed shapes, approximate for variable
  lengths, where attention's cost grows faster than the token count);
- ``train/lr`` (``train/lr_group<i>`` when groups differ), ``train/skipped_steps`` (cumulative:
  fp16 overflow or the non-finite guard), ``train/micro_batches`` (pieces the largest batch of the
  window ran as after an out-of-memory split), ``train/grad_norm`` when clipping measured it;
- memory: ``memory/peak_allocated_bytes`` on CUDA (the allocator peak during the step), else
  ``memory/rss_bytes`` (the process's resident set: all of it, not the step's share).

Under torchrun every rank must call :meth:`StepMeter.update` (it all-reduces the window's loss
sum and count, one collective per optimizer step, so the loss and throughput are the whole
job's); only rank 0's logger writes (``metrics_log.open_loggers``).
"""

from __future__ import annotations

import time
from typing import Any

import psutil
import torch
import torch.distributed as dist

from torchturbo.base.device import model_device, to_device
from torchturbo.engine import StepMetrics, Turbo
from torchturbo.measure.flops import count_step_flops
from torchturbo.measure.peak import dtype_for_precision, measured_peak_flops, mfu
from torchturbo.measure.timing import sync
from torchturbo.recipe import Recipe
from torchturbo.reliability.oom import leading_size
from torchturbo.runs.metrics_log import AnyLogger, as_metrics_logger
from torchturbo.trials.trial import fixed_batches


class StepMeter:
    """Turns a training loop's ``Turbo.step`` results into one logged record per optimizer step.

    >>> meter = StepMeter(turbo, TensorBoardWriter("runs/a"), unit="tokens")
    >>> for batch in loader:
    ...     meter.update(turbo.step(loss_fn, batch))

    ``flops_per_unit`` (from :func:`unit_flops`) and ``peak_flops`` (FLOP/s of one device) enable
    ``train/mfu``; without them it is left out rather than guessed.
    """

    def __init__(
        self,
        turbo: Turbo,
        logger: AnyLogger,
        *,
        unit: str = "samples",
        flops_per_unit: float | None = None,
        peak_flops: float | None = None,
    ) -> None:
        self.turbo = turbo
        self.logger = as_metrics_logger(logger)
        self.unit = unit
        self.flops_per_unit = flops_per_unit
        self.peak_flops = peak_flops
        self._loss_sum: torch.Tensor | None = None
        self._count: torch.Tensor | None = None
        self._pieces = 1
        self._clock = time.perf_counter()

    def update(self, metrics: StepMetrics) -> dict[str, float] | None:
        """Add one micro-step; at an optimizer step, log the window and return what was logged."""
        # Tensors, not floats: reading a value is a device sync, done once per optimizer step.
        weighted = metrics.loss.detach().float() * metrics.count
        self._loss_sum = weighted if self._loss_sum is None else self._loss_sum + weighted
        self._count = metrics.count if self._count is None else self._count + metrics.count
        self._pieces = max(self._pieces, metrics.micro_batches)
        if not metrics.optimizer_stepped:
            return None
        sync(self.turbo.device)
        now = time.perf_counter()
        seconds, self._clock = now - self._clock, now
        loss_sum, count, world = self._window_totals()
        values = {
            "train/loss": loss_sum / count if count else float("nan"),
            f"train/{self.unit}_per_s": count / seconds,
            "train/step_ms": seconds * 1e3,
            **self._learning_rates(),
            "train/skipped_steps": float(self.turbo.skipped_steps),
            "train/micro_batches": float(self._pieces),
            **_memory(self.turbo.device),
        }
        if metrics.grad_norm is not None:
            values["train/grad_norm"] = float(metrics.grad_norm)
        if self.flops_per_unit is not None and self.peak_flops is not None:
            utilisation = mfu(int(self.flops_per_unit * count), seconds, self.peak_flops * world)
            if utilisation is not None:
                values["train/mfu"] = utilisation
        self._loss_sum, self._count, self._pieces = None, None, 1
        self.logger.log(self.turbo.optimizer_steps, values)
        return values

    def _window_totals(self) -> tuple[float, float, int]:
        """(loss sum, count, processes) of the window, summed over all ranks under torchrun."""
        assert self._loss_sum is not None and self._count is not None
        totals = torch.stack([self._loss_sum.double(), self._count.double()])
        world = 1
        if dist.is_available() and dist.is_initialized():
            world = dist.get_world_size()
            dist.all_reduce(totals)
        loss_sum, count = totals.tolist()
        return loss_sum, count, world

    def _learning_rates(self) -> dict[str, float]:
        assert self.turbo.optimizer is not None
        rates = [float(group["lr"]) for group in self.turbo.optimizer.param_groups]
        if len(set(rates)) == 1:
            return {"train/lr": rates[0]}
        return {f"train/lr_group{i}": rate for i, rate in enumerate(rates)}


def _memory(device: torch.device) -> dict[str, float]:
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)  # the next record is the next step's peak
        return {"memory/peak_allocated_bytes": float(peak)}
    return {"memory/rss_bytes": float(psutil.Process().memory_info().rss)}


def unit_flops(recipe: Recipe) -> float | None:
    """FLOPs of one fp32 training step (forward + backward) per sample or token, counted by
    ``FlopCounterMode`` on a fresh model and one batch; None when the batch counts nothing."""
    model, _ = recipe.build()
    (batch,) = to_device(fixed_batches(recipe, 1, seed=recipe.seed), model_device(model))
    counts: list[float] = []

    def step() -> None:
        output: Any = recipe.loss_fn(model, batch)
        loss, count = output if isinstance(output, tuple) else (output, leading_size(batch))
        loss.backward()
        counts.append(float(count))

    flops = count_step_flops(step)
    return flops / counts[0] if counts[0] > 0 else None


def recipe_meter(turbo: Turbo, recipe: Recipe, logger: AnyLogger) -> StepMeter:
    """A meter for ``recipe`` trained by ``turbo``, with MFU: counts the recipe's FLOPs per unit
    and measures the device's peak in the config's dtype (about a second each, once).

    Both draw random numbers (a fresh model, random matrices) from a forked RNG: the run's own
    stream, which decides dropout and a resumed run's exactness, must not move because it logs.
    """
    devices = [turbo.device] if turbo.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        flops_per_unit = unit_flops(recipe)
        try:
            dtype = dtype_for_precision(turbo.config.precision.dtype)
        except ValueError:  # a precision without a matmul peak of its own: no MFU, not a guess
            peak = None
        else:
            peak = measured_peak_flops(turbo.device, dtype)
    return StepMeter(
        turbo, logger, unit=recipe.count_unit, flops_per_unit=flops_per_unit, peak_flops=peak
    )
