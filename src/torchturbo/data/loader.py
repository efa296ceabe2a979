"""DataLoader construction and batch transfer to the device: what a loader needs.

:func:`build_loader` passes only the DataLoader arguments that apply to the device and the
worker count; the settings themselves are chosen by measurement in the tuner
(:mod:`torchturbo.tune.loader.grid`). Batches reach the device through
:func:`torchturbo.base.device.to_device`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from torchturbo.base.stop_signals import leave_stop_signals_to_the_trainer
from torchturbo.config import ConfigError, DataConfig


def build_loader(
    dataset: Dataset,
    *,
    batch_size: int | None = None,
    config: DataConfig,
    device: torch.device | str,
    shuffle: bool = True,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    batch_sampler: Any = None,
    drop_last: bool = False,
    seed: int | None = None,
) -> DataLoader:
    """A DataLoader set up from ``config``, with only the arguments that apply.

    - ``pin_memory`` is passed only when ``device`` is CUDA: page-locked memory exists to make
      host-to-CUDA copies fast and asynchronous; on CPU it costs a copy and buys nothing, so it
      is ignored there (no error: one config file serves both devices).
    - ``persistent_workers`` and ``prefetch_factor`` are passed only with ``num_workers > 0``
      (torch rejects them otherwise; ``DataConfig`` already refuses such a config).
    - workers ignore the stop signals (``torchturbo.reliability.preemption``), which the training
      process handles; it ends its workers itself.
    - ``seed`` fixes the shuffle order and the workers' base seed through a dedicated generator,
      without touching the global RNG.
    - ``batch_sampler`` yields whole batches and owns their order and size, so it excludes
      ``batch_size`` and ``drop_last`` (an error when given) and ``shuffle`` (ignored). An
      ``IterableDataset`` also owns its order: ``shuffle`` is ignored for it too.

    Only the loader fields of ``config`` are read here; the batch plan (``batches``,
    ``max_tokens``, ``pad_to_multiple``) reaches it as ``batch_sampler`` and ``collate_fn``.
    """
    if not isinstance(config, DataConfig):
        raise ConfigError(f"build_loader: config must be a DataConfig, got {type(config).__name__}")
    kwargs: dict[str, Any] = {
        "num_workers": config.num_workers,
        "collate_fn": collate_fn,
        "pin_memory": config.pin_memory and torch.device(device).type == "cuda",
    }
    if config.num_workers > 0:
        kwargs["persistent_workers"] = config.persistent_workers
        # A scheduler's SIGTERM to the whole job would kill the workers, and the DataLoader
        # would fail the step under way: the training process decides when to stop.
        kwargs["worker_init_fn"] = leave_stop_signals_to_the_trainer
        if config.prefetch_factor is not None:
            kwargs["prefetch_factor"] = config.prefetch_factor
    if seed is not None:
        kwargs["generator"] = torch.Generator().manual_seed(seed)
    if batch_sampler is not None:
        if batch_size is not None or drop_last:
            raise ValueError(
                f"build_loader: batch_sampler decides batch sizes, so batch_size={batch_size!r} "
                f"and drop_last={drop_last!r} are invalid with it; pass batch_size=None and "
                "drop_last=False"
            )
        return DataLoader(dataset, batch_sampler=batch_sampler, **kwargs)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(
            f"build_loader: batch_size={batch_size!r} is invalid: expected a positive int "
            "(or pass batch_sampler)"
        )
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle and not isinstance(dataset, IterableDataset),
        drop_last=drop_last,
        **kwargs,
    )
