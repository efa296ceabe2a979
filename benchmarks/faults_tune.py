"""Rows of benchmarks/faults.py about ``torchturbo tune``: a stop signal, Ctrl-C and a kill
mid-search, two tunes into one --out, an --out without room or write permission. Each from
fresh processes on tests/recipes/marked.py (50 ms steps) with a long planned job, so that the
compile stage is measured and the search lasts a minute. For a tune, **kept/trained** counts
candidates: those kept after the fault over those decided when it struck, and **resume
identical** says whether the same command then reused every one of them.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from fault_runs import MARKED, TIMEOUT_S, TORCHTURBO, Bench, Proc, Row, in_tmpfs, run


def _tune(out: Path, *more: Any) -> list[Any]:
    budget = ["--time-budget", "3m", "--planned-steps", 100_000]
    return [*TORCHTURBO, "tune", MARKED, "--device", "cpu", *budget, "--out", out, *more]


def _decided(path: Path) -> list[str]:
    """The candidates a record decided by measurement (the loader is measured afresh)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return [
        row["name"]
        for row in record.get("candidates", [])
        if row["verdict"] in ("adopted", "rejected") and row["stage"] != "data_loader"
    ]


def _once_decided(out: Path, proc: Proc) -> list[str]:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline and proc.process.poll() is None:
        if decided := _decided(out / "progress.json"):
            return decided
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"no candidate decided:\n{proc.output[-3000:]}")


def _reused_by_the_next_run(out: Path, decided: list[str]) -> bool:
    again = run(_tune(out, "--only", "precision"))
    rows = json.loads((out / "results.json").read_text())["candidates"]
    reused = {row["name"] for row in rows if row.get("reused")}
    return again.process.returncode == 0 and set(decided) <= reused


def signal_mid_search(bench: Bench, signum: int) -> Row:
    out = bench.dir(f"tune-{signum}")
    proc = Proc(_tune(out))
    decided = _once_decided(out, proc)
    os.kill(proc.process.pid, signum)
    status = proc.finish()
    record = out / ("progress.json" if signum == signal.SIGKILL else "results.json")
    kept = _decided(record)
    line = proc.last_line(r"stopped by|stopped at once") or f"(killed: {record.name} kept)"
    return Row(
        f"{signal.Signals(signum).name} to tune mid-search",
        status,
        len(kept),
        len(decided),
        _reused_by_the_next_run(out, kept),
        line,
    )


def second_tune(bench: Bench) -> Row:
    out = bench.dir("second-tune")
    first = Proc(_tune(out))
    _once_decided(out, first)
    second = run(_tune(out))
    first_status = first.finish()
    return Row(
        "a second tune into the same --out",
        second.process.returncode,
        len(_decided(out / "results.json")),
        None,
        first_status == 0,
        second.last_line(),
    )


def out_problem(bench: Bench, kind: str) -> Row | None:
    """--out on a tmpfs too small for the report, or on a read-only one (``unshare``)."""
    if not bench.unshare:
        return None
    mount = bench.work / "mount"
    options = "size=1m" if kind == "full" else "size=1m,ro"
    proc = in_tmpfs(bench, options, _tune(mount / "report"))
    fault = "tune --out on a 1 MiB tmpfs" if kind == "full" else "tune --out read-only"
    return Row(fault, proc.process.returncode, None, 0, None, proc.last_line())


TUNE_FAULTS = {
    "tune-sigterm": lambda b: signal_mid_search(b, signal.SIGTERM),
    "tune-sigint": lambda b: signal_mid_search(b, signal.SIGINT),
    "tune-sigkill": lambda b: signal_mid_search(b, signal.SIGKILL),
    "tune-second": second_tune,
    "tune-full": lambda b: out_problem(b, "full"),
    "tune-read-only": lambda b: out_problem(b, "read-only"),
}
