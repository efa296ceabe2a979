"""Where step metrics go: TensorBoard event files, CSV, W&B and MLflow, written by rank 0 only.

A logger is anything with one method, ``log(step, metrics)``: a dict of scalar values at an
integer step; or, as Lightning's loggers and the ``mlflow`` module have it,
``log_metrics(metrics, step)`` (:func:`as_metrics_logger` wraps those, and a W&B run, whose
``log(data, step=)`` takes the two the other way round). :class:`TensorBoardWriter` writes
them through torch's own ``torch.utils.tensorboard.SummaryWriter`` (event files TensorBoard
reads; needs the ``tensorboard`` package), :class:`CSVWriter` as ``wall_time,step,metric,value``
rows. Long rows rather than one column per metric: the set of metrics may change from step to
step (MFU is only known on some, the tuner logs each candidate under its own names), and a long
file never has to rewrite its header; ``pandas.read_csv(path).pivot(index="step",
columns="metric")`` gives the wide table.

Under torchrun every process trains but only rank 0 writes: :func:`open_loggers` hands the other
ranks an empty :class:`Loggers`, so N processes never write N copies of one run. The rank comes
from the process group when one is running, else from torchrun's ``RANK`` variable, so the rule
holds before the group is joined (and for commands that never join one).

:func:`log_tune_results` logs a tuner's ``results.json`` the same way: each candidate's loss curve
and its per-round step times, under the candidate's name.

W&B and MLflow are :mod:`torchturbo.runs.tracking`'s; :func:`open_loggers` opens any of the four by
name (``train --logger tensorboard,csv,wandb,mlflow``).

Why hand-written: Lightning's and Hugging Face's loggers belong to their trainers (and bring
them); TensorBoard's writer, W&B's run and MLflow's client are used as they are, and the rest
is a CSV file, a rank check and the adapters between the two conventions.
"""

from __future__ import annotations

import csv
import re
import time
import types
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeAlias, runtime_checkable

import torch.distributed as dist

from torchturbo.distributed.launch import read_launch_env

#: File name of the CSV log inside a log directory.
CSV_NAME = "metrics.csv"
CSV_COLUMNS = ("wall_time", "step", "metric", "value")
#: What ``train --logger`` and :func:`open_loggers` can open, by name.
LOGGER_NAMES = ("tensorboard", "csv", "wandb", "mlflow")
#: Without names: TensorBoard and CSV (``train --log-dir`` alone).
DEFAULT_LOGGERS = ("tensorboard", "csv")


@runtime_checkable
class MetricsLogger(Protocol):
    """What ``train`` and :class:`~torchturbo.runs.step_meter.StepMeter` log to: one method.

    ``step`` is the optimizer step (or the index along a curve); ``metrics`` maps names such as
    ``"train/loss"`` to finite or non-finite floats. Implement it to send metrics anywhere (W&B,
    MLflow, a queue); ``close()`` is optional and called when the run ends.
    """

    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...


@runtime_checkable
class LogMetricsLogger(Protocol):
    """The other convention: ``log_metrics(metrics, step)``, as Lightning's ``Logger`` (CSVLogger,
    TensorBoardLogger, WandbLogger, MLFlowLogger ...) and the ``mlflow`` module have it."""

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> object: ...


#: A logger of either convention: what ``train(logger=)`` and :class:`StepMeter` take.
AnyLogger: TypeAlias = MetricsLogger | LogMetricsLogger


def as_metrics_logger(logger: AnyLogger) -> MetricsLogger:
    """``logger`` as a ``log(step, metrics)`` logger.

    ``log_metrics(metrics, step)`` loggers are wrapped (``log_metrics`` wins where an object
    has both), and so is a W&B run or the ``wandb`` module, whose ``log(data, step=)`` would
    otherwise be called the wrong way round. Raises TypeError for an object with neither.
    """
    if isinstance(logger, LogMetricsLogger):
        return _LogMetrics(logger)
    if _is_wandb(logger):
        return _WandbLog(logger)
    if isinstance(logger, MetricsLogger):
        return logger
    raise TypeError(
        f"a logger needs a method log(step, metrics) or log_metrics(metrics, step); "
        f"{type(logger).__name__} has neither"
    )


def _is_wandb(logger: object) -> bool:
    name = logger.__name__ if isinstance(logger, types.ModuleType) else type(logger).__module__
    return name.split(".")[0] == "wandb"


class _LogMetrics:
    """A ``log_metrics(metrics, step)`` logger behind ``log(step, metrics)``. After each call
    it asks the logger to ``save()`` where it can: Lightning's CSVLogger keeps rows in memory
    until then, and a run that dies must keep every step it logged."""

    def __init__(self, logger: LogMetricsLogger) -> None:
        self.logger = logger

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.logger.log_metrics(dict(metrics), step=step)
        save = getattr(self.logger, "save", None)
        if callable(save):
            save()


class _WandbLog:
    """A W&B run (or the ``wandb`` module's current run) behind ``log(step, metrics)``."""

    def __init__(self, run: Any) -> None:
        self.run = run

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=step)


class TensorBoardWriter:
    """Scalars to TensorBoard event files in ``log_dir`` (``tensorboard --logdir`` reads them)."""

    def __init__(self, log_dir: str | Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:  # torch's writer imports the tensorboard package
            raise ImportError(
                "TensorBoard event files need the tensorboard package: "
                "pip install 'torchturbo[tensorboard]' (or pip install tensorboard)"
            ) from err
        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(log_dir=str(self.log_dir))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        wall_time = time.time()
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, global_step=step, walltime=wall_time)

    def close(self) -> None:
        self._writer.close()


class CSVWriter:
    """``wall_time,step,metric,value`` rows appended to ``path``; flushed after every call, so a
    run that dies keeps every step it logged."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        new = not self.path.exists() or self.path.stat().st_size == 0
        self._file = open(self.path, "a", newline="")  # noqa: SIM115 - closed by close()
        self._csv = csv.writer(self._file)
        if new:
            self._csv.writerow(CSV_COLUMNS)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        wall_time = f"{time.time():.3f}"
        self._csv.writerows((wall_time, step, name, repr(float(v))) for name, v in metrics.items())
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class Loggers:
    """Several loggers as one: ``log`` reaches each, ``close`` closes those that can be closed.

    Empty on ranks other than 0 (see :func:`open_loggers`), where logging costs nothing.
    ``notes`` says what could not be opened (TensorBoard without the package).
    """

    def __init__(self, loggers: Iterable[MetricsLogger] = (), notes: Iterable[str] = ()) -> None:
        self.loggers = list(loggers)
        self.notes = list(notes)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for logger in self.loggers:
            logger.log(step, metrics)

    def close(self) -> None:
        for logger in self.loggers:
            close = getattr(logger, "close", None)
            if close is not None:
                close()

    def __enter__(self) -> Loggers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def logging_rank() -> int:
    """This process's global rank: the process group's, else torchrun's ``RANK``, else 0."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    launch = read_launch_env()
    return 0 if launch is None else launch.rank


def open_loggers(
    log_dir: str | Path | None,
    names: Sequence[str] | None = None,
    *,
    config: Mapping[str, Any] | None = None,
) -> Loggers:
    """The loggers ``names`` (of :data:`LOGGER_NAMES`; default TensorBoard and CSV) on rank 0,
    nothing on other ranks.

    TensorBoard and CSV write into ``log_dir``; W&B puts its run directory there too and MLflow
    its ``mlruns`` store, unless their own settings say where (:mod:`torchturbo.runs.tracking`).
    ``config``, the run's config as a dict, becomes W&B's run config and MLflow's parameters.
    A logger whose package is missing is an error when named, and a note in ``notes`` when it
    is a default (without tensorboard the CSV is still written).
    """
    chosen = tuple(DEFAULT_LOGGERS if names is None else names)
    unknown = sorted(set(chosen) - set(LOGGER_NAMES))
    if unknown:
        raise ValueError(f"unknown logger(s) {unknown}; choose from {', '.join(LOGGER_NAMES)}")
    needs_dir = [name for name in chosen if name in ("tensorboard", "csv")]
    if log_dir is None and needs_dir:  # on every rank: one that went on alone would hang
        raise ValueError(f"{' and '.join(needs_dir)} write into a log directory: give --log-dir")
    if logging_rank() != 0:
        return Loggers()
    directory = None if log_dir is None else Path(log_dir)
    if directory is not None:
        if directory.exists() and not directory.is_dir():
            raise NotADirectoryError(f"--log-dir {str(directory)!r} exists and is not a directory")
        directory.mkdir(parents=True, exist_ok=True)
    opened = Loggers()
    try:
        for name in dict.fromkeys(chosen):
            try:
                opened.loggers.append(_open(name, directory, config))
            except ImportError as err:
                if names is not None:
                    raise ValueError(f"--logger {name}: {err}") from err
                opened.notes.append(f"no TensorBoard event files: {err}")
    except BaseException:
        opened.close()
        raise
    for logger in opened.loggers:
        opened.notes.extend(getattr(logger, "notes", ()))
    return opened


def _open(name: str, directory: Path | None, config: Mapping[str, Any] | None) -> MetricsLogger:
    if name == "tensorboard":
        assert directory is not None  # open_loggers refuses tensorboard without a directory
        return TensorBoardWriter(directory)
    if name == "csv":
        assert directory is not None
        return CSVWriter(directory / CSV_NAME)
    from torchturbo.runs import tracking

    opener = tracking.WandbLogger if name == "wandb" else tracking.MLflowLogger
    return opener(directory, config=config)


def metric_name(*parts: str) -> str:
    """``parts`` joined by ``/`` with characters TensorBoard tags and CSV readers dislike
    (spaces, colons, commas) replaced by ``_``: ``("tune", "compile:default")`` ->
    ``"tune/compile_default"``."""
    return "/".join(re.sub(r"[^A-Za-z0-9_.+-]+", "_", part).strip("_") for part in parts)


def log_tune_results(results: Mapping[str, Any], logger: MetricsLogger) -> int:
    """Log a tuner's results (what ``results.json`` holds, ``TuneResult.to_dict()``): each
    candidate's loss curve and step times, and its throughput and ratio; returns the number of
    values logged.

    Per candidate row ``name``: ``tune/<name>/loss`` at step i for its ``loss_curve`` (per-step
    losses), ``tune/<name>/step_ms`` at round i for its ``step_samples_ms`` (per-round step times),
    and ``tune/<name>/throughput`` and ``tune/<name>/ratio`` at step 0. Rows without those keys
    (results written before the tuner recorded them) log what they have. The tuner's own
    ``loss_curves`` (baseline and best) go under ``tune/loss_curve/<which>``.
    """
    count = 0
    for row in results.get("candidates") or ():
        name = metric_name("tune", str(row.get("name", "candidate")))
        for series, key in (("loss", "loss_curve"), ("step_ms", "step_samples_ms")):
            for step, value in enumerate(row.get(key) or ()):
                count += _log_number(logger, step, f"{name}/{series}", value)
        for key in ("throughput", "ratio"):
            count += _log_number(logger, 0, f"{name}/{key}", row.get(key))
    for which, curve in (results.get("loss_curves") or {}).items():
        for step, value in enumerate(curve or ()):
            count += _log_number(logger, step, metric_name("tune", "loss_curve", which), value)
    return count


def _log_number(logger: MetricsLogger, step: int, name: str, value: Any) -> int:
    # None (not measured) and non-numbers are skipped; NaN is logged: a diverged curve is news.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0
    logger.log(step, {name: float(value)})
    return 1
