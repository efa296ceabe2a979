"""A real ``torchturbo tune`` process stopped by a signal or killed: what it measured is kept.

Each test starts the command on the tiny recipe, waits until its first decided rows are in
``--out/progress.json`` (the compile stage is still ahead, tens of seconds), then signals it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

TINY = str(Path(__file__).parent / "recipes" / "tiny.py") + ":recipe"
#: Seconds a run may take to reach its first decided rows, and to stop once signalled.
START_S, STOP_S = 120, 60


def _tune(out: Path, *more: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "torchturbo", "tune", TINY, "--device", "cpu"]
    return subprocess.Popen(
        [*command, "--time-budget", "3m", "--out", str(out), *more],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _decided(record: dict) -> list[str]:
    """The candidates a record holds decided by measurement (the loader is measured afresh)."""
    return [
        row["name"]
        for row in record["candidates"]
        if row["verdict"] in ("adopted", "rejected") and row["stage"] != "data_loader"
    ]


def _once_rows_are_kept(process: subprocess.Popen, out: Path) -> dict:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline and process.poll() is None:
        try:
            progress = json.loads((out / "progress.json").read_text())
        except (OSError, ValueError):
            time.sleep(0.2)
            continue
        if _decided(progress):
            return progress
        time.sleep(0.2)
    process.kill()
    raise AssertionError(f"no decided row kept: {process.communicate()[0]}")


def test_sigterm_mid_search_writes_the_report_of_what_was_measured_and_exits_75(tmp_path):
    out = tmp_path / "report"
    process = _tune(out)
    _once_rows_are_kept(process, out)
    process.send_signal(signal.SIGTERM)
    printed, _ = process.communicate(timeout=STOP_S)
    assert process.returncode == 75, printed
    assert "stopped by SIGTERM:" in printed and "the same command goes on" in printed
    results = json.loads((out / "results.json").read_text())
    assert results["confirmation"]["state"] == "interrupted"
    assert _decided(results)
    assert (out / "report.html").exists() and (out / "turbo.toml").exists()
    # One report, nothing half-written or stray beside it.
    assert not (out / "progress.json").exists()
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []


def test_a_killed_tune_leaves_its_decided_rows_and_the_next_run_reuses_them(tmp_path):
    out = tmp_path / "report"
    process = _tune(out)
    kept = _once_rows_are_kept(process, out)
    os.kill(process.pid, signal.SIGKILL)
    process.communicate(timeout=STOP_S)
    decided = _decided(kept)
    again = _tune(out, "--only", "precision")
    printed, _ = again.communicate(timeout=START_S + STOP_S)
    assert again.returncode == 0, printed
    assert "reused" in printed and "progress.json" in printed, printed
    rows = json.loads((out / "results.json").read_text())["candidates"]
    assert decided and {r["name"] for r in rows if r.get("reused")} >= set(decided)
