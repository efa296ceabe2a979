"""The GPU suite's CPU dry run: the script a GPU session will run must not rot in between."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "gpu_suite.py"


@pytest.mark.slow
def test_gpu_suite_dry_run_on_cpu_writes_json_and_table(tmp_path):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert set(data["workloads"]) == {"vision", "segmentation", "text"}
    for rows in data["workloads"].values():
        assert rows[0]["variant"] == "baseline" and rows[0]["ratio"] == 1.0
        assert all(row["mfu"] is not None and row["mfu"] > 0 for row in rows)
    assert data["tune_vision"]["confirmed_ratio"] > 0
    table = (tmp_path / "gpu_suite.md").read_text()
    assert "| vision | baseline | 1.00x |" in table
    assert set(data["extras"]) == {"bucketing", "augment", "kernels", "inference"}
    for name, extra in data["extras"].items():
        assert "error" not in extra, extra.get("error")
        assert f"- `benchmarks/{name}.py`: ok" in table
    assert data["extras"]["bucketing"]["ratio"] > 0
