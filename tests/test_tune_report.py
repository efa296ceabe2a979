"""The tuner's report: every file written, the HTML self-contained and escaped, writes atomic."""

from __future__ import annotations

import base64
import copy
import json
import os
import re
from pathlib import Path

import pytest
from rich.console import Console

import torchturbo.results as results_module
from torchturbo.config import TurboConfig
from torchturbo.tune.report import incremental_table, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ERROR_REASON = "error: RuntimeError('<built-in method conv2d> got an unexpected dtype & layout')"
ALL_PLOTS = {"throughput", "memory", "breakdown", "loss"}


def _candidate(stage: str, name: str, verdict: str, reason: str, **fields) -> dict:
    measured: dict = {
        "config": TurboConfig().to_dict(),
        "throughput": None,
        "ratio": None,
        "noise": None,
        "step_ms": None,
        "memory_bytes": None,
        "one_time_s": None,
        "break_even_steps": None,
        "parity": None,
    }
    measured.update(fields, stage=stage, name=name, verdict=verdict, reason=reason)
    return measured


def _parity(diff: float, ok: bool = True, finite: bool = True) -> dict:
    return {
        "reference_loss": 2.30,
        "loss": 2.30 * (1 + diff),
        "relative_diff": diff,
        "finite": finite,
        "ok": ok,
    }


def full_results() -> dict:
    """A realistic run: adopted, kept, rejected (parity and a crash), skipped, nulls."""
    mib = 2**20
    return {
        "recipe": "vision",
        "device": "cpu",
        "torch": "2.13.0+cpu",
        "date": "2026-11-29T16:40:00",
        "unit": "samples/s",
        "baseline_throughput": 812.0,
        "best_throughput": 2100.0,
        "confirmed_ratio": 2.5,
        "confirmation": {
            "baseline_step_ms": 80.1,
            "best_step_ms": 31.9,
            "noise": 0.03,
            "repeats": 9,
        },
        "time_budget_s": 240.0,
        "elapsed_s": 201.3,
        "memory_budget_bytes": 600 * mib,
        "planned_steps": 10000,
        "loss_tolerance": 0.05,
        "stages": [
            {
                "stage": "precision",
                "best": "bf16",
                "throughput": 1500.0,
                "memory_bytes": 400 * mib,
                "skipped_reason": None,
            },
            {
                "stage": "memory_format",
                "best": "channels_last",
                "throughput": 2100.0,
                "memory_bytes": 380 * mib,
                "skipped_reason": None,
            },
            {
                "stage": "compile",
                "best": None,
                "throughput": 2100.0,
                "memory_bytes": 380 * mib,
                "skipped_reason": None,
            },
            {
                "stage": "dynamic_batching",
                "best": None,
                "throughput": 2100.0,
                "memory_bytes": None,
                "skipped_reason": "the recipe gives no lengths",
            },
        ],
        "candidates": [
            _candidate(
                "baseline",
                "baseline",
                "kept",
                "the reference",
                throughput=812.0,
                ratio=1.0,
                noise=0.02,
                step_ms=78.8,
                memory_bytes=520 * mib,
            ),
            _candidate(
                "precision",
                "bf16",
                "adopted",
                "1.85x faster (noise 3%), loss within 0.4% of fp32",
                throughput=1500.0,
                ratio=1.85,
                noise=0.03,
                step_ms=43.0,
                memory_bytes=400 * mib,
                one_time_s=0.4,
                break_even_steps=3,
                parity=_parity(0.004),
            ),
            _candidate(
                "precision",
                "fp16",
                "rejected",
                "loss parity: 12.1% > 5% | unstable",
                throughput=1450.0,
                ratio=1.79,
                noise=0.04,
                step_ms=44.1,
                parity=_parity(0.121, ok=False),
            ),
            _candidate(
                "memory_format",
                "channels_last",
                "adopted",
                "1.40x over bf16",
                throughput=2100.0,
                ratio=1.40,  # against the best of its time (bf16), so 1.85 x 1.40 = 2.59 overall
                noise=0.03,
                step_ms=30.5,
                memory_bytes=380 * mib,
                one_time_s=0.1,
                break_even_steps=1,
                parity=_parity(0.002),
            ),
            _candidate("compile", "compile:default", "rejected", ERROR_REASON),
            _candidate("dynamic_batching", "bucketing", "skipped", "the recipe gives no lengths"),
        ],
        "adopted": ["bf16", "channels_last"],
        "breakdown": {
            "baseline": {"forward": 0.031, "backward": 0.045, "optimizer": 0.004},
            "best": {"forward": 0.011, "backward": 0.017, "optimizer": 0.003},
        },
        "loss_curves": {
            "baseline": [2.31, 2.29, 2.25, 2.20, 2.14],
            "best": [2.31, 2.28, 2.25, 2.21, 2.13],
        },
        "loader": {
            "verdict": "compute-bound",
            "reason": "the step waits 1% of its time on data",
            "chosen": {"num_workers": 2, "pin_memory": False},
        },
        "system": {"torchturbo": "0.1.0", "torch": "2.13.0+cpu", "device": "cpu: x86_64, 2 cores"},
    }


def sparse_results() -> dict:
    """What an early-stopped run on a machine without memory figures leaves behind."""
    results = full_results()
    for stage in results["stages"]:
        stage["memory_bytes"] = None
    for candidate in results["candidates"]:
        candidate["memory_bytes"] = None
    results.update(
        breakdown=None,
        loss_curves=None,
        loader=None,
        system=None,
        confirmation=None,
        confirmed_ratio=None,
        memory_budget_bytes=None,
    )
    return results


CONFIG_TOML = "# tuned by torchturbo on vision\n" + TurboConfig().to_toml()


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out_dir = tmp_path_factory.mktemp("tune") / "not" / "yet"
    return write_report(out_dir, full_results(), CONFIG_TOML)


def _img_sources(page: str) -> list[str]:
    return re.findall(r"<img\b[^>]*\bsrc=\"([^\"]*)\"", page)


def test_every_file_is_written(written: dict[str, Path]) -> None:
    assert set(written) == {"config", "results", "markdown", "html", *ALL_PLOTS}
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
    table = [line for line in markdown.splitlines() if line.startswith("| precision | fp16 ")]
    header = next(line for line in markdown.splitlines() if line.startswith("| stage | candidate"))
    cells = re.compile(r"(?<!\\)\|")
    assert len(table) == 1 and len(cells.findall(table[0])) == len(cells.findall(header))


def test_markdown_has_headline_tables_images_and_usage(written: dict[str, Path]) -> None:
    markdown = written["markdown"].read_text()
    assert "**Confirmed 2.50x over fp32 eager, samples/s**" in markdown
    assert "torchturbo: 0.1.0" in markdown and "80.1 ms → 31.9 ms" in markdown
    for plot in ALL_PLOTS:
        assert f"]({plot}.png)" in markdown
    assert "| + channels_last | memory_format | 2,100 | 2.59x | 1.40x |" in markdown
    assert (
        "Verdict: compute-bound, the step waits 1% of its time on data. "
        "Chosen settings: num_workers=2, pin_memory=False." in markdown
    )
    assert 'Turbo(torchturbo.TurboConfig.load("turbo.toml"))' in markdown
    assert "torchturbo bench vision --config turbo.toml" in markdown


def test_incremental_table_has_baseline_then_each_adopted_technique() -> None:
    results = full_results()
    table = incremental_table(results)
    assert table.row_count == len(results["adopted"]) + 1
    labels = [str(label) for label in table.columns[0].cells]
    assert labels == ["baseline (fp32 eager)", "+ bf16", "+ channels_last"]
    # Cumulative ratio to the baseline, and the gain of each row over the one above.
    assert [str(c) for c in table.columns[3].cells] == ["1.00x", "1.85x", "2.59x"]
    assert [str(c) for c in table.columns[4].cells] == ["", "1.85x", "1.40x"]


def test_incremental_table_prints_names_literally() -> None:
    results = full_results()
    results["adopted"] = ["compile[bold]"]
    results["candidates"].append(
        _candidate("compile", "compile[bold]", "adopted", "ok", throughput=900.0)
    )
    console = Console(record=True, width=200)
    console.print(incremental_table(results))
    assert "+ compile[bold]" in console.export_text()


def test_missing_optional_data_still_writes_a_report(tmp_path: Path) -> None:
    first = write_report(tmp_path, full_results(), CONFIG_TOML)
    assert first["memory"].exists()
    paths = write_report(tmp_path, sparse_results(), CONFIG_TOML)
    assert set(paths) == {"config", "results", "markdown", "html", "throughput"}
    # The earlier run's plots are gone rather than contradicting the new report.
    assert not (tmp_path / "memory.png").exists() and not (tmp_path / "loss.png").exists()
    markdown = paths["markdown"].read_text()
    assert "No memory plot: the results hold no memory figures." in markdown
    assert "No breakdown plot" in markdown and "No loss plot" in markdown
    assert "Not confirmed: the search measured 2.59x" in markdown
    assert "The input pipeline was not measured." in markdown
    assert len(_img_sources(paths["html"].read_text())) == 1


def test_an_interrupted_write_keeps_the_previous_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_report(tmp_path, full_results(), CONFIG_TOML)
    before = (tmp_path / "results.json").read_bytes()

    def crash(fd: int) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(results_module.os, "fsync", crash)
    changed = copy.deepcopy(full_results())
    changed["best_throughput"] = 1.0
    with pytest.raises(OSError, match="disk full"):
        write_report(tmp_path, changed, CONFIG_TOML)
    assert (tmp_path / "results.json").read_bytes() == before
    assert not list(tmp_path.glob(".*.tmp"))


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
