"""The tuner's outputs: the terminal table, and turbo.toml, results.json, reports and PNG plots.

``torchturbo tune`` ends with a JSON-ready ``results`` dict; this module turns it into what a user
reads and reuses. results.json is the record (``torchturbo report`` can redraw everything from it),
turbo.toml is the tuned config, and the reports show the incremental table (baseline, then one
adopted technique per row, as torchtitan tabulates its benchmarks), every candidate with its
verdict and reason, the loader verdict and four plots.

This is the entry point; the work lives beside it, one job per module: ``fields`` (reading and
formatting values), ``tables`` (rows), ``summary`` (sentences), ``plots`` (matplotlib figures),
``document`` (markdown and HTML text) and ``files`` (atomic writes).
"""

from __future__ import annotations

import json
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


#: What an interrupted run measured (see ``tune.search.run.TuneInterrupted``); the next run in the
#: same directory reads it before results.json, and a finished run removes it.
INTERRUPTED = "interrupted.json"


def read_previous(out_dir: Path) -> list[tuple[dict, str]]:
    """What previous runs left in ``out_dir``, each with its path: an interrupted run's
    interrupted.json first (it also holds what that run reused), then results.json. A file that
    is missing or unreadable is left out: the run then starts afresh, as it would without it."""
    found = []
    for name in (INTERRUPTED, "results.json"):
        path = Path(out_dir) / name
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            found.append((data, str(path)))
    return found


def keep_interrupted(out_dir: Path, partial: dict) -> Path:
    """Write what an interrupted run measured to ``out_dir``/interrupted.json; return its path."""
    out_dir = Path(out_dir)
    prepare_dir(out_dir)
    path = out_dir / INTERRUPTED
    write_atomic(path, (json.dumps(partial, indent=2) + "\n").encode())
    return path


def write_report(out_dir: Path, results: dict, config_toml: str) -> dict[str, Path]:
    """Write turbo.toml, results.json, report.md, report.html and the PNG plots; return their paths.

    ``out_dir`` is created if missing. The returned keys are ``"config"`` (turbo.toml),
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
    paths = {"results": out_dir / "results.json", "config": out_dir / "turbo.toml"}
    # The record and the config first: if drawing fails later, the measurements are kept.
    write_atomic(paths["results"], record.encode())
    (out_dir / INTERRUPTED).unlink(missing_ok=True)  # what it kept is in this record now
    write_atomic(paths["config"], config_toml.encode())
    paths.update(write_trainer_settings(out_dir, TurboConfig.from_toml(config_toml)))

    pngs: dict[str, bytes] = {}
    left_out = plots_left_out()
    for plot in PLOTS:
        figure = None if left_out else plot.draw(results)
        path = out_dir / f"{plot.name}.png"
        if figure is None:
            path.unlink(missing_ok=True)  # a previous run's plot would contradict this report
            continue
        pngs[plot.name] = png(figure)
        paths[plot.name] = path
        write_atomic(path, pngs[plot.name])

    blocks = build_blocks(results, pngs, plots_left_out=left_out)
    title = f"torchturbo tune report: {results.get('recipe') or 'recipe'}"
    paths["markdown"] = out_dir / "report.md"
    paths["html"] = out_dir / "report.html"
    write_atomic(paths["markdown"], render_markdown(blocks).encode())
    write_atomic(paths["html"], render_html(blocks, pngs, title).encode())
    return paths
