"""The prepared GPU session (benchmarks/gpu_session.py): what it runs fits the lent machine's
limits (8 minutes, 8 files, the CUDA tests all there), and a part that overruns its limit is
stopped and recorded while the next one still runs."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_session  # noqa: E402
from gpu_session import PARTS, TOTAL_S, Part, Session, files_written, run  # noqa: E402


def test_the_session_collects_every_file_with_cuda_tests():
    decorator = "@pytest.mark." + "cuda"  # spelt apart: this file is not one of them
    marked = {
        f"tests/{path.name}"
        for path in (ROOT / "tests").glob("test_*.py")
        if decorator in path.read_text()
    }
    assert set(gpu_session.CUDA_TESTS) == marked


def test_the_session_fits_the_lent_machines_limits():
    files = files_written(PARTS)
    assert len(files) == len(set(files)) <= 8  # what comes back from $OUT
    assert sum(part.estimate_s for part in PARTS) <= TOTAL_S <= 8 * 60
    assert [p.name for p in PARTS][:2] == ["cuda_tests", "llm_jobs"]  # what proves most first


def test_a_part_past_its_limit_is_stopped_and_the_next_still_runs(tmp_path):
    slow = Part("slow", (sys.executable, "-c", "import time; time.sleep(30)"), estimate_s=1)
    keeps = Part(
        "keeps",
        (sys.executable, "-c", "open('{scratch}/made.json', 'w').write('{{}}'); print('hi')"),
        estimate_s=5,
        log="keeps.txt",
        keep={"made.json": "kept.json"},
    )
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    out.mkdir()
    scratch.mkdir()
    begin = time.perf_counter()
    run([slow, keeps], Session(out, scratch, total_s=60))
    assert time.perf_counter() - begin < 20
    parts = json.loads((out / "session.json").read_text())["parts"]
    assert parts["slow"]["state"] == "stopped at its limit of 2 s"
    assert parts["keeps"]["state"] == "ok"
    assert (out / "kept.json").read_text() == "{}" and (out / "keeps.txt").read_text() == "hi\n"
