"""The torchturbo command: smoke runs on a tiny recipe, and one clear line per user error."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from torchturbo.cli import main
from torchturbo.config import TurboConfig

TINY = str(Path(__file__).parent / "recipes" / "tiny.py") + ":recipe"


def test_version_prints_versions_and_bf16_support(capsys):
    assert main(["version"]) == 0
    out = capsys.readouterr().out
    for key in ("torchturbo", "torch", "cuda", "device", "cpu bf16 instructions", "measured"):
        assert key in out


def test_bench_on_a_recipe_prints_a_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", TINY, "--device", "cpu", "--steps", "2", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "baseline" in table and "fast" in table and "MFU" in table
    rows = json.loads(out.read_text())["results"]
    assert [r["variant"] for r in rows] == ["baseline", "fast"]
    assert rows[0]["ratio"] == 1.0 and rows[1]["ratio"] > 0
    assert all(r["mfu"] > 0 for r in rows)


def test_bench_says_once_when_a_distributed_section_is_unused_in_one_process(tmp_path, capsys):
    config = tmp_path / "ddp.toml"
    config.write_text('[distributed]\ncomm_hook = "fp16"\n')
    assert main(["bench", TINY, "--device", "cpu", "--steps", "2", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert out.count("distributed not applied: one process: launch with torchrun") == 1


def test_tune_writes_a_loadable_config_and_a_self_contained_report(tmp_path, capsys):
    out = tmp_path / "report"
    code = main(["tune", TINY, "--device", "cpu", "--time-budget", "40s", "--out", str(out)])
    assert code == 0
    config = TurboConfig.load(out / "turbo.toml")
    results = json.loads((out / "results.json").read_text())
    for key in ("baseline_throughput", "best_throughput", "confirmed_ratio", "unit", "candidates"):
        assert key in results
    assert config.precision.dtype in ("fp32", "tf32", "bf16", "fp16")
    html = (out / "report.html").read_text()
    assert "<img" in html and "https://" not in html and "<script" not in html
    printed = " ".join(capsys.readouterr().out.split())  # the terminal wraps the headline
    assert "over fp32 eager" in printed or "keep the defaults" in printed or "keep fp32" in printed
    # No recipe nor --planned-steps says how long the job is: the headline says it assumed one.
    assert "1,000 steps (assumed, give --planned-steps" in printed
    assert results["job"]["assumed"] and results["planned_steps"] == 1000


def _squeezed(text: str) -> str:  # rich wraps lines at 80 columns, paths anywhere
    return "".join(text.split())


def _tune_argv(out: Path) -> list[str]:
    return ["tune", TINY, "--device", "cpu", "--time-budget", "40s", "--out", str(out)]


def test_ctrl_c_in_tune_reports_what_was_measured_and_the_same_command_goes_on(
    tmp_path, capsys, monkeypatch
):
    from test_tune import CLIPPING

    from torchturbo.tune.search import run as search

    asked = []

    def ctrl_c_once_a_candidate_is_decided(ctx):
        asked.append(1)
        if len(asked) == 2:  # stages are asked again once a candidate is decided
            raise KeyboardInterrupt
        return []

    real = search.tune
    interrupting = {**CLIPPING, "interrupt": ctrl_c_once_a_candidate_is_decided}
    monkeypatch.setattr(search, "tune", functools.partial(real, stages=interrupting))
    out = tmp_path / "report"
    assert main(_tune_argv(out)) == 75
    printed = _squeezed(capsys.readouterr().out)
    kept = out / "results.json"
    assert _squeezed(f"stopped by SIGINT: 1 decided candidate(s) kept in {kept}") in printed
    assert _squeezed("Stopped by SIGINT: nothing adopted") in printed  # the headline
    results = json.loads(kept.read_text())
    assert results["confirmation"]["state"] == "interrupted"
    # The report replaced the progress record, all of it there and nothing else left behind.
    assert {"report.html", "report.md", "turbo.toml"} <= {p.name for p in out.iterdir()}
    assert not (out / "progress.json").exists() and not list(out.glob(".*"))

    monkeypatch.setattr(search, "tune", functools.partial(real, stages=CLIPPING))
    assert main(_tune_argv(out)) == 0
    printed = _squeezed(capsys.readouterr().out)
    assert _squeezed(f"reused 1 measured candidates from {kept}") in printed
    rows = json.loads(kept.read_text())["candidates"]
    assert [r["name"] for r in rows if r["reused"]] == ["clip 10"]


def test_a_stop_before_anything_is_measured_leaves_the_directory_as_it_was(
    tmp_path, capsys, monkeypatch
):
    import signal

    from torchturbo.reliability.preemption import StopNow
    from torchturbo.tune.search import run as search

    def stopped_at_once(*args, **kwargs):
        raise StopNow(signal.SIGTERM, "stopped at once")

    monkeypatch.setattr(search, "tune", stopped_at_once)
    out = tmp_path / "report"
    assert main(_tune_argv(out)) == 75
    assert "SIGTERM: stopped at once; nothing was decided" in capsys.readouterr().err
    assert not out.exists()


def test_tune_keeps_every_decided_row_as_it_goes(tmp_path, monkeypatch):
    """progress.json holds each row once decided: what a kill -9 would leave to reuse."""
    from test_tune import CLIPPING

    from torchturbo.cli.tune import PROGRESS

    assert PROGRESS == "progress.json"  # the CLI names it without importing torch: one name

    from torchturbo.tune.report import write
    from torchturbo.tune.search import run as search

    kept = []
    real_keep = write.keep_progress

    def keep(out, partial):
        kept.append([row["name"] for row in partial["candidates"]])
        return real_keep(out, partial)

    monkeypatch.setattr(write, "keep_progress", keep)
    monkeypatch.setattr(search, "tune", functools.partial(search.tune, stages=CLIPPING))
    assert main(_tune_argv(tmp_path / "report")) == 0
    assert write.PROGRESS == PROGRESS
    decided = ["loader settings", "clip 10", "clip 20"]
    assert kept == [decided[:1], decided[:2], decided]


def test_a_second_tune_into_the_same_out_is_refused_naming_the_first(tmp_path, capsys):
    from torchturbo.cli.tune import TUNE_OUT
    from torchturbo.resume.lock import Owner, hold_directory

    out = tmp_path / "report"
    out.mkdir()
    with hold_directory(out, Owner(*TUNE_OUT)):
        assert main(_tune_argv(out)) == 2
    error = capsys.readouterr().err
    assert f"tune --out {str(out)!r} is in use by another run (pid " in error
    assert "two tunes writing one folder would mix their reports" in error
    assert list(out.iterdir()) == []


def test_tune_refuses_an_out_without_room_before_the_search(tmp_path, capsys, monkeypatch):
    from torchturbo.resume import files

    monkeypatch.setattr(files, "free_space", lambda directory: 2 * 2**20)
    assert main(_tune_argv(tmp_path / "report")) == 2
    error = capsys.readouterr().err
    assert "has 2.0 MiB free, and the report needs about 16.0 MiB" in error


def test_a_report_that_cannot_be_written_loses_nothing_printed(tmp_path, capsys, monkeypatch):
    import errno

    from test_tune import CLIPPING

    from torchturbo.tune.report import write
    from torchturbo.tune.search import run as search

    def full(out_dir, results, config_toml):
        raise OSError(errno.ENOSPC, "No space left on device", str(out_dir / "report.html"))

    monkeypatch.setattr(write, "write_report", full)
    monkeypatch.setattr(search, "tune", functools.partial(search.tune, stages=CLIPPING))
    assert main(_tune_argv(tmp_path / "report")) == 2
    printed = capsys.readouterr()
    assert "Measured 2 candidates" in printed.out  # the headline, before the write
    assert "the report could not be written (No space left on device); what was measured" in (
        " ".join(printed.err.split())
    )


def test_doctor_prints_the_checklist_and_writes_json(tmp_path, capsys):
    out = tmp_path / "doctor.json"
    assert main(["doctor", TINY, "--device", "cpu", "--steps", "2", "--json", str(out)]) == 0
    assert "compute-bound" in capsys.readouterr().out or "input-bound" in out.read_text()
    items = json.loads(out.read_text())["items"]
    assert len(items) == 15
    assert {"mixed precision", "TensorCore alignment"} <= {item["name"] for item in items}


def test_export_writes_a_verified_artefact(tmp_path, capsys):
    out = tmp_path / "tiny.pt2"
    assert main(["export", TINY, "--out", str(out)]) == 0
    assert out.is_file() and "max relative difference" in capsys.readouterr().out


def test_train_under_a_tiny_memory_budget_splits_and_reports_the_micro_batch(capsys):
    argv = ["train", TINY, "--device", "cpu", "--steps", "2", "--activation-budget", "200KiB"]
    assert main(argv) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert "trained to optimizer step 2" in last and "micro-batch split 1 " not in last


def test_train_checkpoints_and_resumes(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    args = ["train", TINY, "--device", "cpu", "--checkpoint-dir", str(ckpt), "--save-every", "2"]
    assert main([*args, "--steps", "2"]) == 0
    assert main([*args, "--steps", "4", "--resume"]) == 0
    out = capsys.readouterr().out
    assert "trained to optimizer step 4" in out and "resumed from" in out
    assert "resumed from None" not in out.splitlines()[-1]
    # The resume line says how the loader reached its position: 2 of 8 batches, by index.
    assert (
        f"resumed from {ckpt / 'ckpt-0000000002'} at optimizer step 2; data: epoch 0, 2 "
        "batches in: the batch sampler's indices skipped, no sample loaded"
    ) in out


@pytest.mark.parametrize(("times", "status"), [(1, 75), (2, 128 + 15)])
def test_train_exits_75_after_saving_or_128_plus_the_signal_when_stopped_at_once(
    tmp_path, monkeypatch, capsys, times, status
):
    from torchturbo.reliability import preemption

    monkeypatch.setattr(preemption, "SAME_SIGNAL_S", 0.0)  # the repeat is a second signal
    monkeypatch.setenv("MARKED_SIGTERMS", f"3:{times}")
    marked = str(Path(__file__).parent / "recipes" / "marked.py") + ":recipe"
    argv = ["train", marked, "--device", "cpu", "--steps", "8", "--checkpoint-dir", str(tmp_path)]
    assert main([*argv, "--save-every", "2"]) == status
    out = capsys.readouterr().out
    if times == 1:
        assert f"SIGTERM: stopped after optimizer step 3 and saved it in {tmp_path}" in out
    else:
        assert "SIGTERM: a second stop signal: stopped at once, inside a step" in out
        assert [p.name for p in tmp_path.iterdir()] == ["ckpt-0000000002"]


def test_train_prints_plain_progress_lines_when_its_output_is_no_terminal(monkeypatch, capsys):
    from torchturbo.cli import train as train_command

    monkeypatch.setattr(train_command, "PROGRESS_EVERY_S", 0.0)  # every step, for the test
    assert main(["train", TINY, "--device", "cpu", "--steps", "3"]) == 0
    captured = capsys.readouterr()
    lines = [line for line in captured.out.splitlines() if line.startswith("train ")]
    steps = [line.split(" · ")[0] for line in lines]
    assert steps[-3:] == [f"train tiny step {n}/3" for n in (1, 2, 3)]
    assert " samples/s · ETA 0:00 · saved nothing" in lines[-1]
    assert "resumed from" not in captured.out  # not resumed: not said
    assert "no checkpoint (give --checkpoint-dir to keep one)" in captured.out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "missing.py:recipe"], "does not exist"),
        (["bench", TINY.replace(":recipe", ":nope")], "has no 'nope'"),
        (["bench", TINY.replace(":recipe", ":not_a_recipe")], "returned int"),
        (["bench", "--workload", "imagenet"], "imagenet"),
        (["bench", TINY, "--steps", "1"], "argument --steps: 1 is out of range"),
        (["bench", TINY, "--device", "cuda:7"], "no CUDA device"),
        (["train", TINY, "--steps", "2", "--resume"], "--resume needs --checkpoint-dir"),
    ],
)
def test_user_errors_print_one_line_and_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_a_bad_config_file_names_the_key(tmp_path, capsys):
    bad = tmp_path / "turbo.toml"
    bad.write_text('[precision]\ndtype = "fp8"\n')
    assert main(["bench", TINY, "--config", str(bad)]) == 2
    assert "dtype = 'fp8'" in capsys.readouterr().err


def test_an_output_path_that_is_a_file_is_refused_before_tuning(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["tune", TINY, "--out", str(blocker)]) == 2
    assert str(blocker) in capsys.readouterr().err


def test_debug_shows_the_traceback():
    result = subprocess.run(
        [sys.executable, "-m", "torchturbo", "--debug", "bench", "missing.py:recipe"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0 and "Traceback" in result.stderr
