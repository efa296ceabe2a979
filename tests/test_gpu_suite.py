"""The GPU suite's CPU dry run: the script a GPU session will run must not rot in between."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "gpu_suite.py"
#: Sections that need CUDA and say so on a CPU rather than fail.
CUDA_ONLY = {"triton_op", "extra:host_copies", "extra:comm_hooks"}


@pytest.mark.slow
def test_gpu_suite_dry_run_on_cpu_writes_json_and_table(tmp_path):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads((tmp_path / "gpu_suite.json").read_text())
    states = {name: section["state"] for name, section in data["sections"].items()}
    assert states == {
        name: "not applicable" if name in CUDA_ONLY else "ok" for name in data["sections"]
    }, {name: data["sections"][name].get("reason") for name in states}
    assert "2 GPUs or more; 0 here" in data["sections"]["extra:comm_hooks"]["reason"]

    peaks = data["peaks"]
    assert peaks["fp32"]["emulated"] is None and peaks["fp32"]["measured_tflops"] > 0
    assert "no TF32 units" in peaks["tf32"]["emulated"]  # a CPU: stated against fp32
    assert peaks["tf32"]["stated"].startswith("fp32 peak")

    assert set(data["workloads"]) == {"vision", "segmentation", "text"}
    for rows in data["workloads"].values():
        assert rows[0]["variant"] == "baseline" and rows[0]["ratio"] == 1.0
        assert all(row["mfu"] is not None and row["mfu"] > 0 and row["mfu_peak"] for row in rows)
        fused = next(row for row in rows if row["variant"] == "optimizer:fused")
        assert "optimizer" not in fused["notes"]  # rebuilt fused on CPU too
    text = {row["variant"]: row for row in data["workloads"]["text"]}
    assert "compute capability" in text["float8+bf16"]["notes"]["float8"]  # not on a CPU

    for name in ("tune_vision", "tune_text"):
        assert data[name]["confirmed_ratio"] > 0
    table = (tmp_path / "gpu_suite.md").read_text()
    assert "| vision | baseline | 1.00x |" in table
    assert "- float8: not applicable: CPUs have no fp8" in table
    assert "| fp32 | yes |" in table
    for name in ("custom_kernels", "fused_optimizer", "bucketing", "augment", "inference"):
        assert f"| extra:{name} | ok |" in table
    assert data["extra:bucketing"]["ratio"] > 0
    assert {row["optimizer"] for row in data["extra:fused_optimizer"]["results"]} == {
        "Adam",
        "AdamW",
        "SGD",
    }
