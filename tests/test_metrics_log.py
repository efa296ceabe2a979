"""Metrics logging: what train writes is read back by TensorBoard's own reader and from the CSV."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
from conftest import torchrun_two

from torchturbo import TurboConfig
from torchturbo.cli import main
from torchturbo.recipe import load_recipe
from torchturbo.runs.metrics_log import (
    CSV_NAME,
    CSVWriter,
    Loggers,
    log_tune_results,
    metric_name,
    open_loggers,
)
from torchturbo.runs.train import train
from torchturbo.workloads.text import text

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")

TINY = str(Path(__file__).parent / "recipes" / "tiny.py") + ":recipe"
CONFIG = TurboConfig(device="cpu")


def read_events(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the event files of ``log_dir``, read by TensorBoard's EventAccumulator."""
    accumulator = event_accumulator.EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {
        tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }


def read_csv(path: Path) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            series.setdefault(row["metric"], []).append((int(row["step"]), float(row["value"])))
    return series


class Recorder:
    """A user's logger: the one method of the interface and nothing else."""

    def __init__(self) -> None:
        self.records: list[tuple[int, dict[str, float]]] = []

    def log(self, step, metrics) -> None:
        self.records.append((step, dict(metrics)))


def small_text():
    return text(num_samples=96, d_model=64, num_layers=1, batch_size=8)


def test_train_writes_event_files_that_tensorboard_reads_back(tmp_path):
    with open_loggers(tmp_path) as loggers:
        result = train(load_recipe(TINY), CONFIG, steps=4, logger=loggers)
    events = read_events(tmp_path)
    assert {"train/loss", "train/samples_per_s", "train/mfu", "train/lr"} <= set(events)
    assert {"train/skipped_steps", "train/micro_batches", "memory/rss_bytes"} <= set(events)
    assert [step for step, _ in events["train/loss"]] == [1, 2, 3, 4]
    # The logged loss of the last step is the loss train() reports (float32 in the event file).
    assert events["train/loss"][-1][1] == pytest.approx(result.last_loss, rel=1e-6)
    assert [v for _, v in events["train/lr"]] == pytest.approx([1e-2] * 4)  # tiny: lr=1e-2
    assert all(value > 0 for _, value in events["train/samples_per_s"] + events["train/mfu"])
    # The CSV holds the same records.
    rows = read_csv(tmp_path / CSV_NAME)
    assert set(rows) == set(events)
    assert [v for _, v in rows["train/loss"]] == pytest.approx(
        [v for _, v in events["train/loss"]], rel=1e-6
    )


def test_token_recipes_log_tokens_per_second_and_the_window_mean_loss():
    recorder = Recorder()
    config = CONFIG.replace(accumulation__steps=2)
    result = train(small_text(), config, steps=2, logger=recorder)
    assert [step for step, _ in recorder.records] == [1, 2]
    last = recorder.records[-1][1]
    assert "train/tokens_per_s" in last and "train/samples_per_s" not in last
    # The window's loss is token-weighted over both micro-batches, not the last one's loss.
    assert last["train/loss"] != pytest.approx(result.last_loss, rel=1e-9)
    assert math.isfinite(last["train/loss"]) and 0 < last["train/loss"] < 10


def test_logging_does_not_move_the_training_random_stream():
    # The text model has dropout: counting FLOPs on a fresh model and measuring the peak draw
    # random numbers, and without a forked RNG the logged run would train differently.
    plain = train(small_text(), CONFIG, steps=3)
    logged = train(small_text(), CONFIG, steps=3, logger=Recorder())
    assert logged.last_loss == plain.last_loss


def test_micro_batch_splits_are_logged():
    recorder = Recorder()
    # ~36 kB per sample kept for backward (see test_train.py): 60 kB splits a batch of 8.
    config = CONFIG.replace(reliability__memory_budget_bytes=60_000)
    result = train(load_recipe(TINY), config, steps=2, logger=recorder)
    assert result.micro_batch_split > 1
    assert recorder.records[-1][1]["train/micro_batches"] == result.micro_batch_split


def test_only_rank_zero_opens_writers(tmp_path, monkeypatch):
    launch = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}
    launch |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    for name, value in launch.items():
        monkeypatch.setenv(name, value)
    with open_loggers(tmp_path / "rank1") as loggers:
        loggers.log(1, {"train/loss": 1.0})
    assert loggers.loggers == [] and not (tmp_path / "rank1").exists()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with open_loggers(tmp_path / "rank0") as loggers:
        loggers.log(1, {"train/loss": 1.0})
    assert read_events(tmp_path / "rank0") == {"train/loss": [(1, 1.0)]}


def test_csv_appends_across_runs_with_one_header(tmp_path):
    path = tmp_path / "m.csv"
    for step in (1, 2):
        writer = CSVWriter(path)
        writer.log(step, {"a": 0.5, "b/c": float("nan")})
        writer.close()
    rows = read_csv(path)
    assert rows["a"] == [(1, 0.5), (2, 0.5)]
    assert all(math.isnan(v) for _, v in rows["b/c"])


def test_tune_results_are_logged_per_candidate_with_and_without_curves():
    results = {
        "candidates": [
            {
                "name": "fp32 eager",
                "throughput": 100.0,
                "ratio": 1.0,
                "loss_curve": [2.0, 1.5, 1.25],
                "step_samples_ms": [10.0, 11.0],
            },
            {"name": "compile:default", "throughput": None, "ratio": None},  # skipped: no figures
            {"name": "bf16", "throughput": 150.0, "ratio": 1.5},  # before the curves were kept
        ],
        "loss_curves": {"baseline": [2.0, 1.5], "best": [2.0, 1.4]},
    }
    recorder = Recorder()
    assert log_tune_results(results, recorder) == 3 + 2 + 2 + 2 + 2 + 2
    logged = {(name, step): value for step, m in recorder.records for name, value in m.items()}
    assert logged[("tune/fp32_eager/loss", 2)] == 1.25
    assert logged[("tune/fp32_eager/step_ms", 1)] == 11.0
    assert logged[("tune/bf16/ratio", 0)] == 1.5
    assert logged[("tune/loss_curve/best", 1)] == 1.4
    assert not any(name.startswith("tune/compile_default") for name, _ in logged)


def test_metric_names_are_safe_tags():
    assert metric_name("tune", "micro-batch 4 x2") == "tune/micro-batch_4_x2"
    assert metric_name("tune", "compile:max-autotune") == "tune/compile_max-autotune"


def test_train_command_writes_the_log_dir(tmp_path, capsys):
    assert main(["train", TINY, "--steps", "2", "--log-dir", str(tmp_path / "logs")]) == 0
    assert [s for s, _ in read_events(tmp_path / "logs")["train/loss"]] == [1, 2]
    assert (tmp_path / "logs" / CSV_NAME).is_file()


def test_a_file_as_log_dir_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "f").write_text("")
    assert main(["train", TINY, "--steps", "1", "--log-dir", str(tmp_path / "f")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_loggers_fan_out_and_close_only_what_closes():
    closed: list[str] = []

    class Closing(Recorder):
        def close(self) -> None:
            closed.append("yes")

    first, second = Recorder(), Closing()
    with Loggers([first, second]) as both:
        both.log(3, {"x": 1.0})
    assert first.records == second.records == [(3, {"x": 1.0})] and closed == ["yes"]


@pytest.mark.slow
def test_train_under_torchrun_writes_one_set_of_event_files(tmp_path):
    log_dir = tmp_path / "logs"
    torchrun_two(
        ["-m", "torchturbo", "train", TINY, "--steps", "3", "--log-dir", str(log_dir)],
        timeout_s=180,
    )
    event_files = list(log_dir.glob("events.out.tfevents.*"))
    assert len(event_files) == 1, event_files
    assert [step for step, _ in read_events(log_dir)["train/loss"]] == [1, 2, 3]
    assert [step for step, _ in read_csv(log_dir / CSV_NAME)["train/loss"]] == [1, 2, 3]


class LightningStyle:
    """The other convention, and only it: ``log_metrics(metrics, step)``."""

    def __init__(self) -> None:
        self.records: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.records.append((step, dict(metrics)))


def test_a_log_metrics_logger_gets_the_same_records_as_a_log_one():
    plain, other = Recorder(), LightningStyle()
    train(load_recipe(TINY), CONFIG, steps=3, logger=plain)
    train(load_recipe(TINY), CONFIG, steps=3, logger=other)
    assert [s for s, _ in other.records] == [s for s, _ in plain.records] == [1, 2, 3]
    assert [set(m) for _, m in other.records] == [set(m) for _, m in plain.records]


def test_a_logger_with_neither_method_is_refused_by_name():
    from torchturbo.runs.metrics_log import as_metrics_logger

    with pytest.raises(TypeError, match=r"log_metrics.*Path has neither"):
        as_metrics_logger(Path("."))  # type: ignore[arg-type]


def test_lightning_loggers_receive_every_step(tmp_path):
    loggers = pytest.importorskip("lightning.pytorch.loggers", reason="the lightning extra")
    lightning_csv = loggers.CSVLogger(tmp_path, name="run", version=0)
    train(load_recipe(TINY), CONFIG, steps=3, logger=lightning_csv)
    # No finalize: each step is saved as it is logged, so a run that dies keeps its rows.
    with open(tmp_path / "run" / "version_0" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(row["step"]) for row in rows] == [1, 2, 3]
    assert all(math.isfinite(float(row["train/loss"])) for row in rows)
    board = loggers.TensorBoardLogger(tmp_path, name="tb", version=0)
    train(load_recipe(TINY), CONFIG, steps=2, logger=board)
    assert [step for step, _ in read_events(Path(board.log_dir))["train/loss"]] == [1, 2]


def test_the_cli_lists_the_loggers_that_open_loggers_opens():
    from torchturbo.cli.arguments import LOGGERS
    from torchturbo.runs.metrics_log import LOGGER_NAMES

    assert LOGGERS == LOGGER_NAMES


def test_an_unknown_logger_or_csv_without_a_log_dir_is_one_line(capsys):
    assert main(["train", TINY, "--steps", "1", "--logger", "neptune"]) == 2
    assert "'neptune': give logger names" in capsys.readouterr().err
    assert main(["train", TINY, "--steps", "1", "--logger", "csv"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("csv write into a log directory: give --log-dir")
    assert len(err.splitlines()) == 1
