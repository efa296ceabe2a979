"""The tuner's report: every file written, the HTML self-contained and escaped, writes atomic."""

from __future__ import annotations

import base64
import copy
import dataclasses
import json
import os
import re
from pathlib import Path

import pytest
from rich.console import Console

import torchturbo.output.results_file as results_module
from torchturbo.config import TurboConfig
from torchturbo.techniques.framework.decide import Parity, RatioEstimate
from torchturbo.tune.report.write import (
    MANIFEST,
    STAGING,
    finish_replacement,
    incremental_table,
    write_report,
)
from torchturbo.tune.search.outcome import Comparison, Confirmation, Outcome, TuneResult

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ERROR_REASON = "error: RuntimeError('<built-in method conv2d> got an unexpected dtype & layout')"
ALL_PLOTS = {"throughput", "memory", "breakdown", "loss"}


def _speed(ratio: float, noise: float = 0.03, rounds: int = 5) -> RatioEstimate:
    return RatioEstimate(
        ratio=ratio,
        low=ratio / (1 + noise),
        high=ratio * (1 + noise),
        rounds=rounds,
        decision="faster" if ratio / (1 + noise) > 1.02 else "not faster",
    )


def _comparison(against: str, ratio: float, step_ms: float, throughput: float) -> Comparison:
    return Comparison(
        against=against,
        speed=_speed(ratio),
        steps_per_round=2,
        step_ms=step_ms,
        reference_step_ms=step_ms * ratio,
        throughput=throughput,
        reference_throughput=throughput / ratio,
        step_samples_ms=(step_ms, step_ms * 1.01, step_ms * 0.99),
    )


def _parity(diff: float, ok: bool = True, finite: bool = True) -> Parity:
    return Parity(2.30, 2.30 * (1 + diff), diff, finite, ok)


def _outcome(stage: str, name: str, verdict: str, reason: str, **fields) -> Outcome:
    return Outcome(
        stage=stage,
        name=name,
        config=TurboConfig().to_dict(),
        verdict=verdict,
        reason=reason,
        **fields,
    )


def full_result() -> TuneResult:
    """A realistic run: adopted, rejected (parity and a crash), not measured, not applicable."""
    mib = 2**20
    return TuneResult(
        recipe="vision",
        device="cpu",
        processes=1,
        torch="2.13.0+cpu",
        date="2026-11-29T16:40:00",
        unit="samples/s",
        baseline=_outcome(
            "baseline", "fp32 eager", "reference", "the reference", memory_bytes=520 * mib
        ),
        baseline_step_ms=78.8,
        baseline_throughput=812.0,
        candidates=(
            _outcome(
                "precision",
                "bf16",
                "adopted",
                "1.85x faster, loss within 0.4% of fp32",
                comparison=_comparison("fp32 eager", 1.85, 43.0, 1500.0),
                memory_bytes=400 * mib,
                one_time_s=0.4,
                break_even_steps=3,
                parity=_parity(0.004),
                loss_curve=(2.31, 2.28, 2.25),
            ),
            _outcome(
                "precision",
                "fp16+scaler",
                "rejected",
                "loss parity: 12.1% > 5% | unstable",
                comparison=_comparison("bf16", 1.02, 44.1, 1450.0),
                parity=_parity(0.121, ok=False),
            ),
            _outcome(
                "precision",
                "tf32",
                "not applicable",
                "TF32 is a CUDA tensor-core mode; a tf32 matrix product runs at 1.00x",
            ),
            _outcome(
                "memory_format",
                "channels_last",
                "adopted",
                "1.40x over bf16",
                comparison=_comparison("bf16", 1.40, 30.5, 2100.0),
                memory_bytes=380 * mib,
                one_time_s=0.1,
                break_even_steps=1,
                parity=_parity(0.002),
            ),
            _outcome("compile", "compile:default", "rejected", ERROR_REASON),
            _outcome(
                "dynamic_batching",
                "length buckets",
                "not measured",
                "budget: needs ~70 s, 40 s left",
                estimate_s=70.0,
            ),
        ),
        adopted=("bf16", "channels_last"),
        confirmation=Confirmation(
            state="confirmed",
            comparison=_comparison("fp32 eager", 1.85 * 1.40, 30.4, 812.0 * 1.85 * 1.40),
            rows=(
                {
                    "name": "baseline (fp32 eager)",
                    "stage": "",
                    "step_ms": 78.7,
                    "throughput": 812.0,
                },
                {
                    "name": "+ bf16",
                    "stage": "precision",
                    **_comparison("baseline (fp32 eager)", 1.85, 42.5, 812.0 * 1.85).to_dict(),
                },
                {
                    "name": "+ channels_last",
                    "stage": "memory_format",
                    **_comparison("+ bf16", 1.40, 30.4, 812.0 * 1.85 * 1.40).to_dict(),
                },
            ),
        ),
        facts={"gemm_speedup": {"bf16": 4.1}},
        loader={
            "verdict": "compute-bound",
            "reason": "the step waits 1% of its time on data",
            "chosen": {"num_workers": 2, "pin_memory": False},
        },
        time_budget_s=240.0,
        elapsed_s=201.3,
        memory_budget_bytes=600 * mib,
        planned_steps=10000,
        planned_steps_source="--planned-steps",
        loss_tolerance=0.05,
        unmeasured_s=70.0,
        reused_from=None,
        reuse_note="",
        breakdown={
            "baseline": {"forward": 0.031, "backward": 0.045, "optimizer": 0.004},
            "best": {"forward": 0.011, "backward": 0.017, "optimizer": 0.003},
        },
        loss_curves={
            "baseline": [2.31, 2.29, 2.25, 2.20, 2.14],
            "best": [2.31, 2.28, 2.25, 2.21, 2.13],
        },
        system={"torchturbo": "0.1.0", "torch": "2.13.0+cpu", "device": "cpu: x86_64, 2 cores"},
        fingerprint={"recipe": "vision", "batch_size": 16},
    )


def full_results() -> dict:
    return full_result().to_dict()


def sparse_results() -> dict:
    """What a run on a machine without memory figures, with nothing adopted, leaves behind."""
    result = dataclasses.replace(
        full_result(),
        baseline=dataclasses.replace(full_result().baseline, memory_bytes=None),
        candidates=tuple(
            dataclasses.replace(c, memory_bytes=None, verdict="rejected")
            if c.verdict == "adopted"
            else c
            for c in full_result().candidates
        ),
        adopted=(),
        confirmation=Confirmation(state="not needed", comparison=None),
        breakdown={},
        loss_curves={},
        loader=None,
        system={},
        memory_budget_bytes=None,
    )
    return result.to_dict()


CONFIG_TOML = "# tuned by torchturbo on vision\n" + TurboConfig().to_toml()


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out_dir = tmp_path_factory.mktemp("tune") / "not" / "yet"
    return write_report(out_dir, full_results(), CONFIG_TOML)


def _img_sources(page: str) -> list[str]:
    return re.findall(r"<img\b[^>]*\bsrc=\"([^\"]*)\"", page)


def test_every_file_is_written(written: dict[str, Path]) -> None:
    files = {"config", "results", "markdown", "html", "hf_trainer", "lightning"}
    assert set(written) == {*files, *ALL_PLOTS}
    for path in written.values():
        assert path.is_file() and path.stat().st_size > 0, path
    names = {p.name for p in written["html"].parent.iterdir()}
    assert not [n for n in names if n.endswith(".tmp")], "temporary files left behind"
    for plot in ALL_PLOTS:
        assert written[plot].read_bytes().startswith(PNG_MAGIC)


def test_results_json_round_trips_and_config_is_verbatim(written: dict[str, Path]) -> None:
    assert json.loads(written["results"].read_text()) == full_results()
    assert written["config"].read_bytes() == CONFIG_TOML.encode()
    # The file the report tells the user to load does load.
    assert TurboConfig.load(written["config"]) == TurboConfig()


def test_html_is_self_contained(written: dict[str, Path]) -> None:
    page = written["html"].read_text()
    references = re.findall(r"\b(?:src|href)\s*=\s*[\"']?([^\"'\s>]*)", page, re.IGNORECASE)
    assert not [r for r in references if re.match(r"(https?:)?//", r, re.IGNORECASE)]
    for forbidden in ("<script", "<link", "@import", "url("):
        assert forbidden not in page.lower()
    sources = _img_sources(page)
    drawn = sorted(ALL_PLOTS & set(written))
    assert len(sources) == len(drawn) == 4
    embedded = set()
    for src in sources:
        assert src.startswith("data:image/png;base64,")
        png = base64.b64decode(src.removeprefix("data:image/png;base64,"), validate=True)
        assert png.startswith(PNG_MAGIC)
        embedded.add(png)
    # Each plot written to disk is the one embedded, not a stale or different drawing.
    assert embedded == {written[name].read_bytes() for name in drawn}


def test_text_from_results_is_escaped(written: dict[str, Path]) -> None:
    page = written["html"].read_text()
    assert "RuntimeError(&#x27;&lt;built-in method conv2d&gt; got an unexpected dtype &amp;" in page
    assert "<built-in" not in page  # negative control: the raw reason would open a tag
    markdown = written["markdown"].read_text()
    assert "<built-in" not in markdown and "&lt;built-in" in markdown
    # A "|" in a reason must not add a column to the markdown table.
    table = [
        line for line in markdown.splitlines() if line.startswith("| precision | fp16+scaler ")
    ]
    header = next(line for line in markdown.splitlines() if line.startswith("| stage | candidate"))
    cells = re.compile(r"(?<!\\)\|")
    assert len(table) == 1 and len(cells.findall(table[0])) == len(cells.findall(header))


def test_markdown_has_headline_tables_images_and_usage(written: dict[str, Path]) -> None:
    markdown = written["markdown"].read_text()
    assert "Confirmed 2.59x (2.51-2.67) over fp32 eager, samples/s; not measured for lack" in (
        markdown
    )
    assert "**10,000 steps (--planned-steps): fp32 eager ~" in markdown
    # 240 s were needed for what ran, 70 s more for what did not: 310 s, about 6 min.
    assert "length buckets (a budget of about 6 min would measure them)" in markdown
    assert "torchturbo: 0.1.0" in markdown and "78.7 ms → 30.4 ms" in markdown
    for plot in ALL_PLOTS:
        assert f"]({plot}.png)" in markdown
    assert "| + channels_last | memory_format | 2,103 | 1.40x (1.36-1.44) |" in markdown
    assert (
        "Verdict: compute-bound, the step waits 1% of its time on data. "
        "Chosen settings: num_workers=2, pin_memory=False." in markdown
    )
    assert 'Turbo(torchturbo.TurboConfig.load("turbo.toml"))' in markdown
    assert "turbo.setup(model, optimizer, dataset, batch_size=16)" in markdown
    assert "torchturbo bench vision --config turbo.toml" in markdown


def test_one_figure_per_config_in_every_table(written: dict[str, Path]) -> None:
    """The ratio and interval that adopted a config are the ones every table shows for it."""
    markdown = written["markdown"].read_text()
    channels_last = [
        line for line in markdown.splitlines() if "channels_last" in line and "|" in line
    ]
    assert len(channels_last) == 2  # the incremental table and the candidate table
    assert all("1.40x (1.36-1.44)" in line for line in channels_last)


def test_incremental_table_has_baseline_then_each_adopted_technique() -> None:
    results = full_results()
    table = incremental_table(results)
    assert table.row_count == len(results["adopted"]) + 1
    labels = [str(label) for label in table.columns[0].cells]
    assert labels == ["baseline (fp32 eager)", "+ bf16", "+ channels_last"]
    # Each row's gain over the one above: the measurement that adopted it.
    assert [str(c) for c in table.columns[3].cells] == [
        "",
        "1.85x (1.80-1.91)",
        "1.40x (1.36-1.44)",
    ]


def test_incremental_table_prints_names_literally() -> None:
    results = full_results()
    results["adopted"] = ["compile[bold]"]
    row = dict(results["candidates"][1], name="compile[bold]", verdict="adopted")
    results["candidates"].append(row)
    results["confirmation"]["rows"][1]["name"] = "+ compile[bold]"
    console = Console(record=True, width=200)
    console.print(incremental_table(results))
    assert "+ compile[bold]" in console.export_text()


def test_missing_optional_data_still_writes_a_report(tmp_path: Path) -> None:
    first = write_report(tmp_path, full_results(), CONFIG_TOML)
    assert first["memory"].exists()
    paths = write_report(tmp_path, sparse_results(), CONFIG_TOML)
    files = {"config", "results", "markdown", "html", "hf_trainer", "lightning"}
    assert set(paths) == files
    # The earlier run's plots are gone rather than contradicting the new report.
    assert not (tmp_path / "memory.png").exists() and not (tmp_path / "loss.png").exists()
    markdown = paths["markdown"].read_text()
    assert "No memory plot: the results hold no memory figures." in markdown
    assert "No breakdown plot" in markdown and "No loss plot" in markdown
    assert "Measured 3 candidates: none beat fp32 eager beyond the noise" in markdown
    assert "No confirmation run: nothing was adopted" in markdown
    assert "The input pipeline was not measured." in markdown
    assert len(_img_sources(paths["html"].read_text())) == 0


def test_an_interrupted_write_keeps_the_previous_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_report(tmp_path, full_results(), CONFIG_TOML)
    before = (tmp_path / "results.json").read_bytes()

    def crash(fd: int) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(results_module.os, "fsync", crash)
    changed = copy.deepcopy(full_results())
    changed["elapsed_s"] = 1.0
    with pytest.raises(OSError, match="disk full"):
        write_report(tmp_path, changed, CONFIG_TOML)
    assert (tmp_path / "results.json").read_bytes() == before
    assert not list(tmp_path.glob(".*.tmp"))


def _cut_short(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, after_manifest: bool) -> bytes:
    """A report written over an earlier one, killed while its files are moved into place (after
    the first move), or before its manifest was written; the new results.json's bytes."""
    from torchturbo.tune.report import write

    write_report(tmp_path, full_results(), CONFIG_TOML)
    changed = copy.deepcopy(full_results())
    changed["elapsed_s"] = 1.0
    real_move = write._move_into_place

    def killed(out_dir: Path, manifest: dict) -> None:
        real_move(out_dir, {"files": manifest["files"][:1], "remove": []})
        raise KeyboardInterrupt  # a kill -9 runs nothing more: no cleanup either

    if after_manifest:
        monkeypatch.setattr(write, "_move_into_place", killed)
    else:
        monkeypatch.setattr(write, "write_atomic", lambda *a: (_ for _ in ()).throw(SystemExit))
    monkeypatch.setattr(write.shutil, "rmtree", lambda *a, **k: None)
    with pytest.raises((KeyboardInterrupt, SystemExit)):
        write_report(tmp_path, changed, CONFIG_TOML)
    monkeypatch.undo()
    return (json.dumps(changed, indent=2) + "\n").encode()


def test_a_replacement_cut_short_after_its_manifest_is_finished_by_the_next_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    new = _cut_short(tmp_path, monkeypatch, after_manifest=True)
    assert (tmp_path / STAGING / MANIFEST).exists()  # a mix on disk until the next run
    finish_replacement(tmp_path)
    assert (tmp_path / "results.json").read_bytes() == new
    assert "1 s of a" in (tmp_path / "report.md").read_text()  # the new report's budget line
    assert not (tmp_path / STAGING).exists()


def test_a_replacement_cut_short_before_its_manifest_is_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_report(tmp_path, full_results(), CONFIG_TOML)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    _cut_short(tmp_path, monkeypatch, after_manifest=False)
    finish_replacement(tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_an_interrupted_run_reports_its_adoptions_unconfirmed(tmp_path: Path) -> None:
    result = full_result()
    adopted = [c for c in result.candidates if c.verdict == "adopted"]
    rows = (
        {"name": "baseline (fp32 eager)", "stage": "", "step_ms": 78.8, "throughput": 812.0},
        *({"name": f"+ {o.name}", "stage": o.stage, **o.comparison.to_dict()} for o in adopted),
    )
    note = (
        "stopped by SIGTERM before the confirmation: the search's adoptions measured 2.59x "
        "together, unconfirmed; the same command measures the rest and confirms"
    )
    stopped = dataclasses.replace(
        result,
        confirmation=Confirmation(state="interrupted", comparison=None, note=note, rows=rows),
    )
    paths = write_report(tmp_path, stopped.to_dict(), CONFIG_TOML)
    markdown = " ".join(paths["markdown"].read_text().split())
    assert "Stopped by SIGTERM before the confirmation: the search's adoptions measured" in markdown
    assert "each with the measurement that adopted it" in markdown
    assert "+ channels_last" in markdown and "1.40x" in markdown


def test_unserialisable_results_fail_before_writing(tmp_path: Path) -> None:
    results = full_results()
    results["system"] = {"torch": object()}
    with pytest.raises(TypeError):
        write_report(tmp_path / "out", results, CONFIG_TOML)
    assert not (tmp_path / "out").exists()


def test_bad_output_folder_is_named(tmp_path: Path) -> None:
    a_file = tmp_path / "taken"
    a_file.write_text("")
    with pytest.raises(NotADirectoryError, match="taken"):
        write_report(a_file, full_results(), CONFIG_TOML)


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes anywhere")
def test_read_only_output_folder_is_named(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(PermissionError, match="locked"):
        write_report(locked, full_results(), CONFIG_TOML)


def test_without_matplotlib_the_report_says_the_plots_were_left_out_and_how_to_get_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = write_report(tmp_path, full_results(), CONFIG_TOML)
    assert first["throughput"].exists()
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    paths = write_report(tmp_path, full_results(), CONFIG_TOML)
    assert not set(paths) & ALL_PLOTS and not list(tmp_path.glob("*.png"))
    why = "matplotlib is not installed; pip install 'torchturbo[plots]' (or pip install matplotlib)"
    markdown = paths["markdown"].read_text()
    assert f"The plots were left out: {why} draws them." in markdown
    assert "No throughput plot" not in markdown  # not a per-plot reason: none were drawn
    html = paths["html"].read_text()
    assert "The plots were left out" in html and len(_img_sources(html)) == 0
