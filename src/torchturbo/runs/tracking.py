"""Step metrics to W&B and MLflow runs: ``train --logger wandb,mlflow``.

Each is a ``log(step, metrics)`` logger (:mod:`torchturbo.runs.metrics_log`) over the service's own
client, which is imported only when one is opened (``pip install 'torchturbo[wandb]'`` or
``'torchturbo[mlflow]'``). Both work without a network: W&B with ``WANDB_MODE=offline`` writes
the run under ``<dir>/wandb/offline-run-*`` for ``wandb sync`` to upload later; MLflow with no
``MLFLOW_TRACKING_URI`` writes to the local file store ``<dir>/mlruns`` (``mlflow ui
--backend-store-uri <dir>/mlruns`` shows it). The run's config goes along: W&B's run config,
MLflow's parameters (``precision.dtype = bf16``).

Why not Lightning's WandbLogger and MLFlowLogger: they are Lightning's (importing them imports
Lightning); a run of the service's client and a method that logs a dict are all this needs.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: The W&B project and MLflow experiment runs go to unless WANDB_PROJECT or
#: MLFLOW_EXPERIMENT_NAME says otherwise.
PROJECT = "torchturbo"


class TrackingError(RuntimeError):
    """A tracking service refused to start a run; the message says which and how to go on."""


def _flat(config: Mapping[str, Any] | None, prefix: str = "") -> dict[str, Any]:
    """``{"precision": {"dtype": "bf16"}}`` as ``{"precision.dtype": "bf16"}``."""
    flat: dict[str, Any] = {}
    for key, value in (config or {}).items():
        if isinstance(value, Mapping):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


class WandbLogger:
    """Metrics to a new W&B run: ``wandb.init`` in ``directory`` (else W&B's default, ./wandb or
    WANDB_DIR), with ``config`` as the run config. ``close`` finishes the run."""

    def __init__(self, directory: Path | None, *, config: Mapping[str, Any] | None = None) -> None:
        try:
            import wandb
        except ImportError as err:
            raise ImportError(
                "W&B logging needs the wandb package: pip install 'torchturbo[wandb]'"
            ) from err
        try:
            self.run = wandb.init(
                project=os.environ.get("WANDB_PROJECT", PROJECT),
                dir=None if directory is None else str(directory),
                config=dict(config or {}),
            )
        except Exception as err:  # not logged in, no network: W&B's own errors, in one line
            raise TrackingError(
                f"W&B could not start a run: {' '.join(str(err).split())}; WANDB_MODE=offline "
                "logs to local files without an account (wandb sync uploads them later)"
            ) from err
        self.notes = [f"W&B run {self.run.id} in {Path(self.run.dir).parent}"]

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


class MLflowLogger:
    """Metrics to a new MLflow run through ``MlflowClient`` (no global active run), with
    ``config`` as its parameters. The store is MLFLOW_TRACKING_URI's, else the local file store
    ``<directory>/mlruns`` (``./mlruns`` without a directory). ``close`` ends the run."""

    def __init__(self, directory: Path | None, *, config: Mapping[str, Any] | None = None) -> None:
        try:
            from mlflow import MlflowClient
            from mlflow.entities import Param
        except ImportError as err:
            raise ImportError(
                "MLflow logging needs the mlflow package: pip install 'torchturbo[mlflow]'"
            ) from err
        uri = (
            os.environ.get("MLFLOW_TRACKING_URI")
            or ((directory or Path.cwd()) / "mlruns").resolve().as_uri()
        )
        if uri.startswith("file:"):
            # MLflow 3.x refuses its file store (in maintenance upstream) unless told it is meant;
            # a local store without a server is what this logger offers when no URI is set.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        try:
            self.client = MlflowClient(tracking_uri=uri)
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT)
            experiment = self.client.get_experiment_by_name(name)
            experiment_id = (
                experiment.experiment_id if experiment else self.client.create_experiment(name)
            )
            self.run_id = self.client.create_run(experiment_id).info.run_id
            params = [Param(key, str(value)) for key, value in _flat(config).items()]
            self.client.log_batch(self.run_id, params=params)
        except Exception as err:  # an unreachable server, a store that cannot be written
            raise TrackingError(
                f"MLflow could not start a run in {uri}: {' '.join(str(err).split())}"
            ) from err
        self.notes = [f"MLflow run {self.run_id} in {uri}"]

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        batch = [Metric(name, float(value), now_ms, step) for name, value in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
