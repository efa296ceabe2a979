"""The tuner's outputs: the terminal table, and turbo.toml, results.json, reports and PNG plots.

``torchturbo tune`` ends with a JSON-ready ``results`` dict; this module turns it into what a user
reads and reuses. results.json is the record (``torchturbo report`` can redraw everything from it),
turbo.toml is the tuned config, and the reports show the incremental table (baseline, then one
adopted technique per row, as torchtitan tabulates its benchmarks), every candidate with its
verdict and reason, the loader verdict and four plots.

This is the entry point; the work lives beside it, one job per module: ``fields`` (reading and
formatting values), ``tables`` (rows), ``summary`` (sentences), ``plots`` (matplotlib figures),
``document`` (markdown and HTML text) and ``files`` (the output folder, the trainer settings).
The report's files replace the previous ones together, through a staging folder and its
manifest. Written by hand: a move that a kill cut short must be finished by the next run, under
the folder's lock, which no library for atomic files offers for a set of files.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from rich.table import Table
from rich.text import Text

from torchturbo.config import TurboConfig
from torchturbo.output.results_file import write_atomic
from torchturbo.tune.report.document import build_blocks, render_html, render_markdown
from torchturbo.tune.report.files import prepare_dir, write_trainer_settings
from torchturbo.tune.report.plots import PLOTS, plots_left_out, png
from torchturbo.tune.report.tables import INCREMENTAL_HEADERS, header_row, incremental_rows


def incremental_table(results: dict) -> Table:
    """The terminal table: one technique per row, like torchtitan's incremental benchmark tables.

    Row one is the baseline; each further row adds one adopted technique (in adoption order) with
    the throughput and the ratio over the row above that adopted it. The headline (the confirmed
    ratio over the baseline) is printed under it by the caller.
    """
    table = Table(
        title=f"torchturbo tune: {results.get('recipe', '')} on {results.get('device', '')}"
    )
    headers = header_row(INCREMENTAL_HEADERS, results)
    for i, header in enumerate(headers):
        table.add_column(header, justify="left" if i < 2 else "right")
    # Text cells, not strings: names and reasons must never be read as rich markup.
    for row in incremental_rows(results):
        table.add_row(*(Text(cell) for cell in row))
    return table


#: The run's record so far, rewritten after every decided row (``tune(on_record=)``): what a run
#: stopped or killed at any point measured. The next run in the same directory reads it before
#: results.json; a report that replaces it removes it.
PROGRESS = "progress.json"
#: The folder a report is written into before it replaces the previous one, file by file.
STAGING = ".report-next"
#: Written into the staging folder once every file is there: the list of files to move into
#: place and of those to remove. Without it the staging folder is a report not yet complete.
MANIFEST = "manifest.json"


def read_previous(out_dir: Path) -> list[tuple[dict, str]]:
    """What previous runs left in ``out_dir``, each with its path: a run's progress.json first (it
    also holds what that run reused), then results.json. A file that is missing or unreadable is
    left out: the run then starts afresh, as it would without it."""
    found = []
    for name in (PROGRESS, "results.json"):
        path = Path(out_dir) / name
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            found.append((data, str(path)))
    return found


def keep_progress(out_dir: Path, partial: dict) -> Path:
    """Write the run's record so far to ``out_dir``/progress.json; return its path."""
    out_dir = Path(out_dir)
    prepare_dir(out_dir)
    path = out_dir / PROGRESS
    write_atomic(path, (json.dumps(partial, indent=2) + "\n").encode())
    return path


def finish_replacement(out_dir: Path) -> None:
    """Leave ``out_dir`` holding one run's report: a replacement that a kill cut short is
    finished when its staging folder was complete (its manifest written), else dropped; a
    temporary file a kill left beside progress.json is removed. Call it holding the folder's
    lock (``resume.lock.hold_directory``)."""
    out_dir = Path(out_dir)
    staging = out_dir / STAGING
    if (staging / MANIFEST).is_file():
        _move_into_place(out_dir, json.loads((staging / MANIFEST).read_text()))
    shutil.rmtree(staging, ignore_errors=True)
    for stray in out_dir.glob(f".{PROGRESS}.*.tmp"):
        stray.unlink(missing_ok=True)


def _move_into_place(out_dir: Path, manifest: dict) -> None:
    """Each staged file renamed over its old self (a rename is atomic), the files the new report
    has none of removed, progress.json last (its rows are in the new results.json)."""
    staging = out_dir / STAGING
    for name in manifest["files"]:
        if (staging / name).exists():  # else moved already by a replacement cut short
            target = out_dir / name
            if target.is_symlink():  # a results.json linked from a dashboard stays linked
                write_atomic(target, (staging / name).read_bytes())
                (staging / name).unlink()
            else:
                os.replace(staging / name, target)
    for name in manifest["remove"]:
        (out_dir / name).unlink(missing_ok=True)


def write_report(out_dir: Path, results: dict, config_toml: str) -> dict[str, Path]:
    """Write turbo.toml, results.json, report.md, report.html and the PNG plots; return their paths.

    ``out_dir`` is created if missing. The files replace the previous report's together: they
    are written into a staging folder first, and moved into place once all of them are there,
    so that a kill leaves either report, never a mix of two (:func:`finish_replacement`
    completes a move that was cut short). The returned keys are ``"config"`` (turbo.toml),
    ``"results"`` (results.json), ``"markdown"`` (report.md), ``"html"`` (report.html),
    ``"hf_trainer"`` and ``"lightning"`` (the same settings for those trainers) and one
    per plot drawn, from ``"throughput"``, ``"memory"``, ``"breakdown"``, ``"loss"``
    (``<name>.png``); a plot whose data is missing is left out and the reports say why, and so
    are all of them without matplotlib (:func:`~torchturbo.tune.report.plots.plots_left_out`).
    Raises PermissionError / NotADirectoryError naming ``out_dir`` when it cannot be written, and
    TypeError (before writing anything) when ``results`` is not JSON-serialisable.
    """
    out_dir = Path(out_dir)
    record = json.dumps(results, indent=2) + "\n"
    prepare_dir(out_dir)
    finish_replacement(out_dir)
    staging = out_dir / STAGING
    staging.mkdir()
    try:
        staged = _stage(staging, results, record, config_toml)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    drawn = {path.name for path in staged.values()}
    manifest = {
        "files": sorted(drawn),
        "remove": [PROGRESS] + [f"{p.name}.png" for p in PLOTS if f"{p.name}.png" not in drawn],
    }
    write_atomic(staging / MANIFEST, json.dumps(manifest).encode())
    _move_into_place(out_dir, manifest)
    shutil.rmtree(staging, ignore_errors=True)
    return {key: out_dir / path.name for key, path in staged.items()}


def _stage(staging: Path, results: dict, record: str, config_toml: str) -> dict[str, Path]:
    """Every file of the report written into ``staging``; their paths by key."""
    paths = {"results": staging / "results.json", "config": staging / "turbo.toml"}
    paths["results"].write_text(record)
    paths["config"].write_text(config_toml)
    paths.update(write_trainer_settings(staging, TurboConfig.from_toml(config_toml)))
    pngs: dict[str, bytes] = {}
    left_out = plots_left_out()
    for plot in PLOTS:
        figure = None if left_out else plot.draw(results)
        if figure is None:
            continue
        pngs[plot.name] = png(figure)
        paths[plot.name] = staging / f"{plot.name}.png"
        paths[plot.name].write_bytes(pngs[plot.name])
    blocks = build_blocks(results, pngs, plots_left_out=left_out)
    title = f"torchturbo tune report: {results.get('recipe') or 'recipe'}"
    paths["markdown"] = staging / "report.md"
    paths["html"] = staging / "report.html"
    paths["markdown"].write_text(render_markdown(blocks))
    paths["html"].write_text(render_html(blocks, pngs, title))
    for path in paths.values():  # on disk before the manifest says the report is complete
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    return paths
