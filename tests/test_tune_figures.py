"""One consistent set of figures: the results.json of real (small) tune runs, and the report
written from it, checked row against row.

Every table row's throughput over the row above's must reproduce its ratio column (within 2%,
the rounding of printed figures), the last row over the first the confirmed ratio, and every
candidate's throughput over its reference's its own ratio, in results.json, the terminal table,
report.md and report.html alike.
"""

from __future__ import annotations

import html
import itertools
import json
import re
import time
from pathlib import Path

import pytest
import torch
from rich.console import Console
from test_tune import tiny_recipe

from torchturbo.techniques.framework.proposal import Candidate
from torchturbo.trials.trial import Trial
from torchturbo.tune.report.tables import incremental_rows
from torchturbo.tune.report.write import incremental_table, write_report
from torchturbo.tune.search.run import TuneOptions, tune
from torchturbo.tune.search.stages import tuner_stages

#: Printed figures are rounded (ratios to 2 decimals, throughputs to 3-4 digits).
TOLERANCE = 0.02


def assert_consistent_json(results: dict) -> None:
    """Every figure in results.json agrees with the others."""
    rows = results["confirmation"]["rows"]
    for above, row in itertools.pairwise(rows):
        assert row["throughput"] / above["throughput"] == pytest.approx(
            row["ratio"], rel=TOLERANCE
        ), row["name"]
    if rows:
        overall = rows[-1]["throughput"] / rows[0]["throughput"]
        assert overall == pytest.approx(results["confirmed_ratio"], rel=TOLERANCE)
    assert results["best_throughput"] / results["baseline_throughput"] == pytest.approx(
        results["confirmed_ratio"], rel=TOLERANCE
    )
    for c in results["candidates"]:
        if c.get("ratio") is not None:
            assert c["throughput"] / c["reference_throughput"] == pytest.approx(
                c["ratio"], rel=TOLERANCE
            ), c["name"]


def assert_consistent_table(cells: list[list[str]]) -> None:
    """Rows of the incremental table as printed: name, stage, throughput, ratio, ..."""
    for above, row in itertools.pairwise(cells):
        ratio = float(row[3].split("x")[0])
        assert _number(row[2]) / _number(above[2]) == pytest.approx(ratio, rel=TOLERANCE), row


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def _markdown_rows(markdown: str, first: str) -> list[list[str]]:
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first} |"))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def _html_rows(page: str, first: str) -> list[list[str]]:
    tables = re.findall(r"<table.*?</table>", page, re.DOTALL)
    table = next(t for t in tables if f">{first}<" in t)
    rows = []
    for tr in re.findall(r"<tr>(.*?)</tr>", table, re.DOTALL):
        cells = [html.unescape(c).strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", tr, re.S)]
        if cells:
            rows.append(cells)
    return rows


def check_report(results: dict, out: Path) -> None:
    assert_consistent_json(results)
    rows = [list(r) for r in incremental_rows(results)]
    assert_consistent_table(rows)
    console = Console(record=True, width=200)
    console.print(incremental_table(results))
    terminal = console.export_text()
    for row in rows:
        assert row[2] in terminal and row[3] in terminal
    paths = write_report(out, results, "")
    written = json.loads(paths["results"].read_text())
    assert_consistent_json(written)
    for printed in (
        _markdown_rows(paths["markdown"].read_text(), rows[0][0]),
        _html_rows(paths["html"].read_text(), rows[0][0]),
    ):
        assert [r[:4] for r in printed] == [r[:4] for r in rows]
        assert_consistent_table(printed)


def _paced(monkeypatch: pytest.MonkeyPatch, seconds: dict[float | None, float]) -> list[float]:
    """Trials step on a clock they advance themselves, by ``seconds[max_norm]`` per step: a
    deterministic chain of techniques, each faster than the one before."""
    now = [0.0]
    real_step = Trial.step

    def step(self: Trial) -> None:
        real_step(self)
        now[0] += seconds[self.config.clipping.max_norm]

    monkeypatch.setattr(Trial, "step", step)
    return now


def test_a_chain_of_adoptions_reports_one_consistent_set_of_figures(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    now = _paced(monkeypatch, {None: 0.04, 10.0: 0.02, 20.0: 0.0125})
    stages = {
        "first": lambda ctx: [Candidate("half", ctx.best.replace(clipping__max_norm=10.0), 2.0)],
        "second": lambda ctx: [Candidate("faster", ctx.best.replace(clipping__max_norm=20.0), 1.6)],
    }
    options = TuneOptions(time_budget_s=3000, device="cpu", max_rounds=6, planned_steps=500)
    config, result = tune(tiny_recipe(), options, stages=stages, clock=lambda: now[0])
    results = result.to_dict()
    assert results["adopted"][-2:] == ["half", "faster"] and config.clipping.max_norm == 20.0
    rows = results["confirmation"]["rows"]
    assert [r["name"] for r in rows] == ["baseline (fp32 eager)", "+ half", "+ faster"]
    assert [round(r.get("ratio") or 1.0, 2) for r in rows] == [1.0, 2.0, 1.6]
    assert results["confirmed_ratio"] == pytest.approx(3.2, rel=0.01)
    check_report(results, tmp_path)
    # The job in the headline: 500 steps from --planned-steps, timed both ways.
    job = results["job"]
    assert job["steps"] == 500 and job["source"] == "--planned-steps"
    assert job["baseline_s"] == pytest.approx(500 * 0.04, rel=0.05)
    assert job["best_s"] < job["baseline_s"]


def test_the_checker_fails_on_rows_from_different_measurements(tmp_path: Path) -> None:
    """Negative control: the old table (baseline row from its own earlier measurement, each
    adoption from its search comparison) fails the check the issue's reader made."""
    results = {
        "confirmed_ratio": 2.54,
        "baseline_throughput": 15_002.0,
        "best_throughput": 19_104.0,
        "candidates": [],
        "confirmation": {
            "rows": [
                {"name": "baseline", "throughput": 15_002.0},
                {"name": "+ length buckets", "throughput": 19_104.0, "ratio": 2.54},
            ]
        },
    }
    with pytest.raises(AssertionError):
        assert_consistent_json(results)


@pytest.mark.slow
def test_a_real_tune_run_reports_one_consistent_set_of_figures(tmp_path: Path) -> None:
    """Real techniques on a real (small) model and real clocks: whatever this machine adopts,
    its figures agree with one another."""
    torch.manual_seed(0)
    options = TuneOptions(
        time_budget_s=120, device="cpu", only=("precision", "memory_format", "optimizer")
    )
    started = time.perf_counter()
    _, result = tune(tiny_recipe(), options, stages={n: tuner_stages()[n] for n in options.only})
    assert time.perf_counter() - started < 300
    results = result.to_dict()
    assert results["job"]["assumed"] and "assumed" in results["job"]["source"]
    if results["confirmation"]["rows"]:
        check_report(results, tmp_path)
    else:  # nothing adopted: the baseline's own measurement is the only row
        assert len(incremental_rows(results)) == 1
        assert_consistent_json(results)


def test_a_memory_plans_row_shows_its_measured_footprint() -> None:
    """A plan's name has " + " inside it; its row read it as three adoptions, found none, and
    printed n/a for the footprint that decided it (a GPT-2 under --memory-budget)."""
    plan = "plan: ckpt transformer.h.0 + micro-batch 2 x4 + bf16 optimizer state"
    results = {
        "candidates": [
            {"name": "fp32 eager", "stage": "baseline", "memory_bytes": 147_067_604},
            {"name": "compile:default", "verdict": "adopted", "memory_bytes": 60_000_000},
            {"name": plan, "verdict": "adopted", "memory_bytes": 62_304_980, "one_time_s": 0.0},
        ],
        "adopted": [plan, "compile:default"],
        "confirmation": {
            "rows": [
                {"name": "baseline (fp32 eager)", "throughput": 3373.0, "step_ms": 149.4},
                {"name": f"+ {plan}", "stage": "memory", "throughput": 2001.0, "ratio": 0.59},
                {"name": f"+ {plan} + compile:default", "stage": "compile", "ratio": 1.1},
            ]
        },
    }
    rows = incremental_rows(results)
    assert [row[5] for row in rows] == ["140.3 MiB", "59.4 MiB", "57.2 MiB"]
    results["confirmation"]["rows"][2]["name"] = ""  # a row without a name still prints
    assert [row[5] for row in incremental_rows(results)][2] == "n/a"
