"""Every output of a tuning run says the same thing: a replacement is shown as one, the
table, the throughput plot, the headline, results.json and turbo.toml agree on every figure,
and the doctor shows one figure per lever. Files are written through symbolic links, and
``--json -`` writes to standard output."""

from __future__ import annotations

import html
import json
import os
import re
from pathlib import Path

import pytest

from torchturbo.cli import main
from torchturbo.config import TurboConfig
from torchturbo.output.results_file import write_atomic, write_results
from torchturbo.tune.report.fields import adoption_label, flat_settings, replaced_by, replacements
from torchturbo.tune.report.plots import throughput_bars
from torchturbo.tune.report.summary import headline, incremental_note, loader_line
from torchturbo.tune.report.tables import candidate_rows, incremental_figures, incremental_rows

TINY = f"{Path(__file__).parent / 'recipes' / 'tiny.py'}:recipe"


def _settings(config: dict) -> dict:
    """A config dict flattened as the report reads it, less the compile cache's folder (the
    written one is relative to turbo.toml)."""
    return {k: v for k, v in flat_settings(config).items() if k != "compile.cache_dir"}


def _row(name: str, stage: str, config: TurboConfig, throughput: float) -> dict:
    return {"name": name, "stage": stage, "verdict": "adopted", "config": config.to_dict(),
            "reason": "faster", "throughput": throughput, "ratio": 1.1}  # fmt: skip


def _replacing_results() -> dict:
    """Packing adopted, then length buckets over it; bf16, then fp16+scaler over it: turbo.toml
    holds length buckets and fp16 only. The confirmation measured bf16 above fp16+scaler."""
    base = TurboConfig()
    packing = base.replace(data__batches="packed")
    buckets = packing.replace(data__batches="buckets")
    bf16 = buckets.replace(precision__dtype="bf16")
    fp16 = bf16.replace(precision__dtype="fp16")
    chain = [
        {"name": "baseline (fp32 eager)", "stage": "", "throughput": 100.0, "step_ms": 80.0},
        {"name": "+ packing", "stage": "packing", "throughput": 180.0, "ratio": 1.8},
        {"name": "+ length buckets", "stage": "dynamic_batching", "throughput": 200.0,
         "ratio": 1.11},
        {"name": "+ bf16", "stage": "precision", "throughput": 254.0, "ratio": 1.27},
        {"name": "+ fp16+scaler", "stage": "precision", "throughput": 238.0, "ratio": 0.94},
    ]  # fmt: skip
    return {
        "unit": "tokens/s",
        "baseline_throughput": 100.0,
        "candidates": [
            {
                "stage": "baseline",
                "name": "fp32 eager",
                "verdict": "reference",
                "config": base.to_dict(),
            },
            _row("packing", "packing", packing, 180.0),
            _row("length buckets", "dynamic_batching", buckets, 200.0),
            _row("bf16", "precision", bf16, 250.0),
            _row("fp16+scaler", "precision", fp16, 260.0),
        ],
        "adopted": ["packing", "length buckets", "bf16", "fp16+scaler"],
        "confirmation": {"state": "confirmed", "rows": chain, "ratio": 2.38},
    }


def test_a_later_adoption_that_took_back_an_earlier_one_is_shown_as_a_replacement():
    results = _replacing_results()
    assert replacements(results) == {"length buckets": ("packing",), "fp16+scaler": ("bf16",)}
    assert replaced_by(results) == {"packing": "length buckets", "bf16": "fp16+scaler"}
    labels = [row[0] for row in incremental_rows(results)]
    assert labels == [
        "baseline (fp32 eager)",
        "+ packing",
        "+ length buckets instead of packing",
        "+ bf16",
        "+ fp16+scaler instead of bf16",
    ]
    # The candidate table says which adopted rows turbo.toml no longer holds.
    reasons = {row[1]: row[-1] for row in candidate_rows(results)}
    assert reasons["packing"].endswith("; replaced by length buckets (turbo.toml holds that)")
    assert "replaced" not in reasons["length buckets"]


def test_negative_control_adoptions_that_add_up_are_not_replacements():
    results = _replacing_results()
    base = TurboConfig()
    layout = base.replace(memory_format__channels_last=True)
    results["candidates"][1:] = [
        _row("bf16", "precision", base.replace(precision__dtype="bf16"), 200.0),
        _row("channels_last", "memory_format", layout.replace(precision__dtype="bf16"), 230.0),
    ]
    results["adopted"] = ["bf16", "channels_last"]
    assert replacements(results) == {}
    assert adoption_label("channels_last", results) == "channels_last"


def test_the_throughput_plot_draws_the_tables_figures_and_says_why_a_bar_stands_higher():
    results = _replacing_results()
    bars = throughput_bars(results)
    figures = incremental_figures(results)
    assert [value for _, value, _ in bars] == [row["throughput"] for row in figures]
    by_label = {label: colour for label, _, colour in bars}
    bf16 = next(label for label in by_label if label.startswith("+ bf16"))
    assert bf16 == "+ bf16 (precision), replaced by fp16+scaler"  # 254 drawn above 238: said
    assert by_label[bf16] != by_label["+ fp16+scaler instead of bf16 (precision)"]
    # The last bar over the first is the confirmed ratio, as in the headline.
    assert bars[-1][1] / bars[0][1] == pytest.approx(results["confirmation"]["ratio"])


def test_the_incremental_tables_sentence_says_where_its_figures_come_from():
    results = _replacing_results()
    assert "come from the confirmation" in incremental_note(results)
    assert "measurement that adopted it" not in incremental_note(results)
    results["confirmation"] = {"state": "not needed", "rows": []}
    assert incremental_note(results).startswith("Nothing was adopted")


def test_a_reused_candidate_says_what_its_figures_were_measured_against():
    results = _replacing_results()
    results["candidates"][1] |= {
        "reused": True, "against": "fp32 eager", "reference_throughput": 585.0, "throughput": 778.0
    }  # fmt: skip
    reason = next(row[-1] for row in candidate_rows(results) if row[1] == "packing")
    assert "measured there at 778 against 585 tokens/s of fp32 eager, not this run's" in reason


def test_the_loader_verdict_is_said_once():
    loader = {"verdict": "compute-bound", "reason": "compute-bound: 2% input wait", "chosen": {}}
    line = loader_line({"loader": loader})
    assert line.startswith("Verdict: compute-bound, 2% input wait") and line.count("bound") == 1


def test_a_file_is_written_through_a_symbolic_link(tmp_path):
    target = tmp_path / "kept" / "results.json"
    target.parent.mkdir()
    target.write_text("old")
    link = tmp_path / "results.json"
    link.symlink_to(target)
    write_atomic(link, b"new")
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_text() == "new"


def test_json_dash_is_standard_output(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_results("-", {"rows": [1, 2]})
    assert json.loads(capsys.readouterr().out)["rows"] == [1, 2]
    assert not (tmp_path / "-").exists()


@pytest.mark.slow
def test_bench_json_dash_keeps_stdout_for_the_json(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["bench", TINY, "--device", "cpu", "--steps", "2", "--json", "-"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["workload"] == "tiny"  # nothing else on stdout
    assert "torchturbo bench: tiny" in captured.err and not (tmp_path / "-").exists()
    # The progress too (its first line at once; later ones at least 2 s apart, and this bench
    # is quicker than that).
    assert any(line.startswith("bench tiny") for line in captured.err.splitlines())


#: A doctor's measured figure: its interval, or why none is quoted (``decide.describe``).
_MEASURED = re.compile(r"~\d+\.\d+x (?:\([^)]*\)|after \d+ rounds?, [^;]*?) against [\w.+-]+")


@pytest.mark.slow
def test_every_output_of_a_real_tune_and_doctor_run_agrees(tmp_path, capsys):
    """A real (short) tune and doctor of the same recipe, every output rendered and read back:
    the terminal, results.json, report.md, report.html, the plot's data, turbo.toml, the
    doctor's checklist, levers and JSON."""
    from torchturbo.tune.report.document import _md
    from torchturbo.tune.report.fields import adopted_rows

    out = tmp_path / "report"
    argv = ["tune", TINY, "--device", "cpu", "--time-budget", "40s", "--skip", "compile"]
    assert main([*argv, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    markdown = (out / "report.md").read_text()
    page = (out / "report.html").read_text()
    # One headline everywhere.
    line = headline(results)
    assert line in printed.splitlines()  # one line, never wrapped
    assert f"**{_md(line)}**" in markdown and html.escape(line) in page
    # The incremental table: the terminal's, the markdown's and the plot's figures are one.
    rows, figures = incremental_rows(results), incremental_figures(results)
    for row in rows:
        assert row[0] in printed and row[2] in printed
        assert "| " + " | ".join(map(_md, row)) + " |" in markdown
    bars = throughput_bars(results)
    assert [value for _, value, _ in bars] == [f["throughput"] for f in figures][: len(bars)]
    confirmation = results["confirmation"]
    if confirmation["state"] in ("confirmed", "consistent"):
        assert figures[-1]["throughput"] / figures[0]["throughput"] == pytest.approx(
            results["confirmed_ratio"], rel=1e-6
        )
    # What is adopted is what the candidate table, the incremental table and turbo.toml hold.
    kept = adopted_rows(results)
    verdicts = {row[1]: row[2] for row in candidate_rows(results)}
    assert all(verdicts[name] == "adopted" for name in results["adopted"])
    written = _settings(TurboConfig.from_toml((out / "turbo.toml").read_text()).to_dict())
    defaults = _settings(TurboConfig(device="cpu").to_dict())
    if kept and confirmation["state"] in ("confirmed", "consistent"):
        assert written == _settings(kept[-1]["config"])
    elif kept and confirmation["state"] == "dropped":
        # Each held adoption was re-measured alone, on the baseline: turbo.toml holds their own
        # changes, so every setting it changes is one a held adoption's config holds.
        held = [_settings(row["config"]) for row in kept]
        changed = {key: value for key, value in written.items() if defaults[key] != value}
        assert changed and all(any(h[key] == v for h in held) for key, v in changed.items())
    else:
        assert written == defaults
    labels = " ".join(f["label"] for f in figures)
    assert all(name in labels for name in results["adopted"] if name in verdicts)
    assert f"use it: torchturbo bench {TINY} --config {out / 'turbo.toml'}" in printed.splitlines()
    assert "measurement that adopted it" not in markdown

    diagnosis_path = tmp_path / "doctor.json"
    assert (
        main(["doctor", TINY, "--device", "cpu", "--steps", "2", "--json", str(diagnosis_path)])
        == 0
    )
    shown = capsys.readouterr().out
    diagnosis = json.loads(diagnosis_path.read_text())
    items = {item["name"]: item for item in diagnosis["items"]}
    item_of = {"channels_last": "channels_last", "bf16": "mixed precision"}
    for lever in diagnosis["levers"]:
        if lever["measured"]:
            figure = _MEASURED.search(lever["evidence"])[0]
            item = items[item_of[lever["name"]]]
            assert figure in item["evidence"], (lever, item)  # one figure for one measurement
            assert ("within noise" in lever["evidence"]) == (item["state"] == "within noise")
            assert f"{lever['name']} {lever['expected_gain']:.2f}x" in shown
        elif lever["expected_gain"] is None and lever["name"] in verdicts:
            # What the doctor says cannot help here, the tuner did not measure either.
            assert verdicts[lever["name"]] == "not applicable", lever
