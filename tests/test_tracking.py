"""train --logger wandb and --logger mlflow, for real and offline: W&B in offline mode and
MLflow's local file store both write local files, read back here with the services' own
formats. Each test skips, saying why, where its package is not installed."""

from __future__ import annotations

import csv
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from torchturbo.cli import main

TINY = str(Path(__file__).parent / "recipes" / "tiny.py") + ":recipe"
TRAIN = ["train", TINY, "--device", "cpu", "--steps", "3"]


def _csv_losses(log_dir: Path) -> list[tuple[int, float]]:
    with open(log_dir / "metrics.csv", newline="") as f:
        rows = [row for row in csv.DictReader(f) if row["metric"] == "train/loss"]
    return [(int(row["step"]), float(row["value"])) for row in rows]


def _wandb_records(path: Path) -> list[object]:
    """The protobuf records of a ``.wandb`` run file: a 7-byte header (":W&B", magic, version),
    then LevelDB's log format (32 KiB blocks of chunks: crc32, length, type) whose FULL or
    FIRST..LAST chunks each make one ``wandb_internal_pb2.Record``. W&B ships no Python reader
    of it since its Go core took over writing."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a W&B run file"
    block, offset, pending, records = 32768, 7, b"", []
    while offset + 7 <= len(data):
        left_in_block = block - offset % block
        if left_in_block < 7:  # the writer pads a block's tail shorter than a chunk header
            offset += left_in_block
            continue
        _crc, length, kind = struct.unpack_from("<IHB", data, offset)
        chunk = data[offset + 7 : offset + 7 + length]
        offset += 7 + length
        pending += chunk
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
        elif kind == 0:  # zero padding to the end of the file
            break
    return records


@pytest.mark.slow
def test_train_logger_wandb_offline_leaves_the_metrics_in_the_local_run(tmp_path):
    pytest.importorskip("wandb", reason="W&B logging needs the wandb extra")
    log_dir = tmp_path / "logs"
    argv = [*TRAIN, "--precision.dtype", "bf16", "--logger", "wandb,csv", "--log-dir"]
    # A process of its own, as a user runs it: W&B's core process finishes writing the run file
    # after run.finish() returns, and by the time the command has exited.
    env = os.environ | {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    command = [sys.executable, "-m", "torchturbo", *argv, str(log_dir)]
    subprocess.run(command, env=env, check=True, timeout=300, capture_output=True)
    (run_file,) = log_dir.glob("wandb/offline-run-*/run-*.wandb")
    records = _wandb_records(run_file)
    losses = []
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): item for item in record.history.item}
            if "train/loss" in items:
                step = json.loads(items["_step"].value_json)
                losses.append((step, json.loads(items["train/loss"].value_json)))
    # W&B holds exactly the values the CSV beside it holds (float64 in both).
    assert losses == _csv_losses(log_dir)
    assert [step for step, _ in losses] == [1, 2, 3]
    # The run's config is the resolved TurboConfig, the command line's option included.
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["precision"]["dtype"] == "bf16" and config["device"] == "cpu"


@pytest.mark.slow
def test_train_logger_mlflow_lands_in_a_local_mlruns(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="MLflow logging needs the mlflow extra")
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    log_dir = tmp_path / "logs"
    argv = [*TRAIN, "--compile.mode", "off", "--logger", "mlflow,csv", "--log-dir", str(log_dir)]
    assert main(argv) == 0
    client = MlflowClient(tracking_uri=(log_dir / "mlruns").as_uri())
    (experiment,) = [e for e in client.search_experiments() if e.name == "torchturbo"]
    (run,) = client.search_runs([experiment.experiment_id])
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == _csv_losses(log_dir)
    assert run.data.params["precision.dtype"] == "fp32"
    assert run.data.params["compile.mode"] == "off"
    assert run.info.status == "FINISHED"


@pytest.mark.parametrize(("name", "module"), [("wandb", "wandb"), ("mlflow", "mlflow")])
def test_a_named_logger_whose_package_is_missing_says_how_to_get_it(
    name, module, tmp_path, monkeypatch, capsys
):
    monkeypatch.setitem(sys.modules, module, None)  # `import wandb` raises ImportError
    assert main([*TRAIN, "--logger", name, "--log-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"--logger {name}:" in err and f"pip install 'torchturbo[{name}]'" in err
