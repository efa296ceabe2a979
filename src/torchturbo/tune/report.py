"""The tuner's outputs: turbo.toml, results.json, report.md, report.html and PNG plots.

``torchturbo tune`` ends with a JSON-ready ``results`` dict; this module turns it into what a user
reads and reuses. results.json is the record (``torchturbo report`` can redraw everything from it),
turbo.toml is the tuned config, and the reports show the incremental table (baseline, then one
adopted technique per row, as torchtitan tabulates its benchmarks), every candidate with its
verdict and reason, the loader verdict and four plots.

The markdown and the HTML are rendered from one list of blocks, so the two never disagree. The
HTML is written by hand with ``html.escape`` rather than through a markdown library or a template
engine: it is a handful of headings, tables and images, a page that must open offline needs no
more, and it costs no dependency. Plots use matplotlib's object API on an Agg canvas rather than
pyplot, so drawing never switches the caller's backend or leaves figures in pyplot's registry.

Every file is written to a temporary name in the output folder and renamed into place, so an
interrupted run leaves the previous file or the new one, never half of one.
"""

from __future__ import annotations

import base64
import errno
import html
import io
import json
import math
import os
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.table import Table
from rich.text import Text

from torchturbo.report import format_bytes

if TYPE_CHECKING:
    from matplotlib.figure import Figure

BASELINE_LABEL = "fp32 eager"
_VERDICTS = ("adopted", "rejected", "skipped", "kept")


# --- reading the results: tolerant of nulls, since unmeasured fields are null -------------------


def _num(value: Any) -> float | None:
    """A finite number, or None for null, NaN and anything that is not a number."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _ratio(value: float | None, reference: float | None) -> float | None:
    return value / reference if value is not None and reference else None


def _baseline_candidate(results: dict) -> dict:
    """The candidate measured for stage "baseline", if the tuner recorded one (else empty)."""
    return next((c for c in results.get("candidates") or [] if c.get("stage") == "baseline"), {})


def _adopted_candidate(results: dict, name: str) -> dict:
    """The measurement behind an adopted name: its adopted candidate, else its stage's record."""
    candidates = results.get("candidates") or []
    for c in candidates:
        if c.get("name") == name and c.get("verdict") == "adopted":
            return c
    stage = next((s for s in results.get("stages") or [] if s.get("best") == name), {})
    return {"stage": stage.get("stage"), "name": name, **stage}


# --- formatting -----------------------------------------------------------------------------


def _fmt_rate(value: Any) -> str:
    v = _num(value)
    if v is None:
        return "n/a"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _fmt_x(value: Any) -> str:
    v = _num(value)
    return "n/a" if v is None else f"{v:.2f}x"


def _fmt_pct(value: Any) -> str:
    v = _num(value)
    return "n/a" if v is None else f"{100 * v:.1f}%"


def _fmt_float(value: Any, digits: int) -> str:
    v = _num(value)
    return "n/a" if v is None else f"{v:.{digits}f}"


def _fmt_int(value: Any) -> str:
    v = _num(value)
    return "n/a" if v is None else f"{v:,.0f}"


def _fmt_bytes(value: Any) -> str:
    v = _num(value)
    return format_bytes(None if v is None else int(v))


def _fmt_parity(parity: Any) -> str:
    if not isinstance(parity, dict):
        return "n/a"
    if parity.get("finite") is False:
        return "non-finite"
    return _fmt_pct(parity.get("relative_diff"))


# --- the tables: one source for the terminal, markdown and HTML -------------------------------

_INCREMENTAL_HEADERS = (
    "configuration",
    "stage",
    "{unit}",
    "vs baseline",
    "vs previous row",
    "step ms",
    "peak memory",
    "break-even steps",
)


def _incremental_rows(results: dict) -> list[tuple[str, ...]]:
    """Baseline, then each adopted technique in order with the cumulative throughput it reached."""
    baseline = _num(results.get("baseline_throughput"))
    base_candidate = _baseline_candidate(results)
    rows = [
        (
            f"baseline ({BASELINE_LABEL})",
            "",
            _fmt_rate(baseline),
            _fmt_x(1.0 if baseline else None),
            "",
            _fmt_float(base_candidate.get("step_ms"), 1),
            _fmt_bytes(base_candidate.get("memory_bytes")),
            "",
        )
    ]
    # A candidate's "ratio" is measured against the best of its time, interleaved in one run, so
    # the ratio to the baseline is the product of the ratios of the rows so far.
    previous = baseline
    cumulative: float | None = 1.0
    for name in results.get("adopted") or []:
        c = _adopted_candidate(results, name)
        throughput = _num(c.get("throughput"))
        vs_previous = _num(c.get("ratio"))
        if vs_previous is None:
            vs_previous = _ratio(throughput, previous)
        cumulative = None if cumulative is None or vs_previous is None else cumulative * vs_previous
        rows.append(
            (
                f"+ {name}",
                str(c.get("stage") or ""),
                _fmt_rate(throughput),
                _fmt_x(cumulative),
                _fmt_x(vs_previous),
                _fmt_float(c.get("step_ms"), 1),
                _fmt_bytes(c.get("memory_bytes")),
                _fmt_int(c.get("break_even_steps")),
            )
        )
        previous = throughput
    return rows


_CANDIDATE_HEADERS = (
    "stage",
    "candidate",
    "verdict",
    "{unit}",
    "vs best so far",
    "noise",
    "step ms",
    "peak memory",
    "one-time s",
    "break-even steps",
    "loss vs reference",
    "reason",
)


def _candidate_rows(results: dict) -> list[tuple[str, ...]]:
    rows = []
    for c in results.get("candidates") or []:
        vs_best = _num(c.get("ratio"))  # measured against the best of its time, same run
        rows.append(
            (
                str(c.get("stage") or ""),
                str(c.get("name") or ""),
                str(c.get("verdict") or ""),
                _fmt_rate(c.get("throughput")),
                _fmt_x(vs_best),
                _fmt_pct(c.get("noise")),
                _fmt_float(c.get("step_ms"), 1),
                _fmt_bytes(c.get("memory_bytes")),
                _fmt_float(c.get("one_time_s"), 2),
                _fmt_int(c.get("break_even_steps")),
                _fmt_parity(c.get("parity")),
                str(c.get("reason") or ""),
            )
        )
    return rows


_STAGE_HEADERS = ("stage", "best after it", "{unit}", "vs baseline", "peak memory", "note")


def _stage_rows(results: dict) -> list[tuple[str, ...]]:
    baseline = _num(results.get("baseline_throughput"))
    adopted = set(results.get("adopted") or [])
    rows = []
    for s in results.get("stages") or []:
        best = s.get("best")
        if s.get("skipped_reason"):
            note = f"skipped: {s['skipped_reason']}"
        else:
            note = "adopted" if best in adopted else "nothing adopted"
        rows.append(
            (
                str(s.get("stage") or ""),
                str(best or "unchanged"),
                _fmt_rate(s.get("throughput")),
                _fmt_x(_ratio(_num(s.get("throughput")), baseline)),
                _fmt_bytes(s.get("memory_bytes")),
                note,
            )
        )
    return rows


def _headers(template: tuple[str, ...], results: dict) -> tuple[str, ...]:
    unit = str(results.get("unit") or "throughput")
    return tuple(h.format(unit=unit) for h in template)


def _headline(results: dict) -> str:
    """The one number a user came for, with its unit; says plainly when it is not confirmed."""
    unit = str(results.get("unit") or "throughput")
    confirmed = _num(results.get("confirmed_ratio"))
    if confirmed is None:
        best = _num(results.get("best_throughput"))
        searched = _fmt_x(_ratio(best, _num(results.get("baseline_throughput"))))
        return f"Not confirmed: the search measured {searched} over {BASELINE_LABEL}, {unit}"
    if not results.get("adopted"):
        return (
            f"Nothing beat {BASELINE_LABEL}: keep the defaults "
            f"(confirmation measured {confirmed:.2f}x, {unit})"
        )
    return f"Confirmed {confirmed:.2f}x over {BASELINE_LABEL}, {unit}"


def _confirmation_line(results: dict) -> str:
    unit = str(results.get("unit") or "throughput")
    search = (
        f"Search: {_fmt_rate(results.get('baseline_throughput'))} → "
        f"{_fmt_rate(results.get('best_throughput'))} {unit}."
    )
    c = results.get("confirmation")
    if not isinstance(c, dict):
        return search
    return (
        f"Final confirmation run, baseline and chosen interleaved: "
        f"{_fmt_float(c.get('baseline_step_ms'), 1)} ms → {_fmt_float(c.get('best_step_ms'), 1)} "
        f"ms per step (noise {_fmt_pct(c.get('noise'))}, {_fmt_int(c.get('repeats'))} repeats). "
        + search
    )


def _system_line(results: dict) -> str:
    system = results.get("system")
    if not isinstance(system, dict) or not system:
        system = {k: results.get(k) for k in ("torch", "device") if results.get(k)}
    parts = [f"{k}: {v}" for k, v in system.items()]
    if results.get("date"):
        parts.append(f"run {results['date']}")
    return " · ".join(parts) or "system not recorded"


def _budget_line(results: dict) -> str:
    memory_budget = results.get("memory_budget_bytes")
    return (
        f"Recipe {results.get('recipe', 'n/a')} on {results.get('device', 'n/a')}. "
        f"The search took {_fmt_float(results.get('elapsed_s'), 0)} s of a "
        f"{_fmt_float(results.get('time_budget_s'), 0)} s budget; memory budget: "
        f"{'none' if memory_budget is None else _fmt_bytes(memory_budget)}; planned run: "
        f"{_fmt_int(results.get('planned_steps'))} steps (one-time costs such as compilation are "
        f"weighed against it); loss tolerance: {_fmt_pct(results.get('loss_tolerance'))}."
    )


def _loader_line(results: dict) -> str:
    loader = results.get("loader")
    if not isinstance(loader, dict):
        return "The input pipeline was not measured."
    chosen = loader.get("chosen")
    settings = ", ".join(f"{k}={v}" for k, v in chosen.items()) if isinstance(chosen, dict) else ""
    reason = str(loader.get("reason") or "").strip().rstrip(".")
    verdict = f"Verdict: {loader.get('verdict', 'n/a')}" + (f", {reason}" if reason else "")
    return f"{verdict}. Chosen settings: {settings or 'none'}."


def incremental_table(results: dict) -> Table:
    """The terminal table: one technique per row, like torchtitan's incremental benchmark tables.

    Row one is the baseline; each further row adds one adopted technique (in adoption order) and
    shows the cumulative throughput, its ratio to the baseline and to the row above.
    """
    table = Table(
        title=f"torchturbo tune: {results.get('recipe', '')} on {results.get('device', '')}",
        caption=_headline(results),
    )
    headers = _headers(_INCREMENTAL_HEADERS, results)
    for i, header in enumerate(headers):
        table.add_column(header, justify="left" if i < 2 else "right")
    # Text cells, not strings: names and reasons must never be read as rich markup.
    for row in _incremental_rows(results):
        table.add_row(*(Text(cell) for cell in row))
    return table


# --- plots ------------------------------------------------------------------------------------

_BASELINE_COLOR = "#757575"
_ADOPTED_COLOR = "#2e7d32"
_UNCHANGED_COLOR = "#bdbdbd"


def _figure(height: float = 3.6) -> Figure:
    # Imported here: matplotlib takes a noticeable fraction of a second to import, and the
    # terminal table (or `import torchturbo.tune.report`) should not pay for it.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7.0, height), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _plain(label: str) -> str:
    """Matplotlib reads `$...$` as math; names must print as they are."""
    return label.replace("$", r"\$")


def _stage_bars(
    results: dict, baseline: float | None, key: str, scale: float
) -> tuple[list[str], list[float], list[str]]:
    """Bar labels, values and colours: the baseline (when known), then each stage in order."""
    labels, values, colors = [], [], []
    if baseline is not None:
        labels.append("baseline")
        values.append(baseline / scale)
        colors.append(_BASELINE_COLOR)
    adopted = set(results.get("adopted") or [])
    for s in results.get("stages") or []:
        value = _num(s.get(key))
        if value is None:
            continue
        changed = s.get("best") in adopted and not s.get("skipped_reason")
        suffix = f"+ {s['best']}" if changed else "skipped" if s.get("skipped_reason") else "kept"
        labels.append(_plain(f"{s.get('stage')}: {suffix}"))
        values.append(value / scale)
        colors.append(_ADOPTED_COLOR if changed else _UNCHANGED_COLOR)
    return labels, values, colors


def _barh(figure: Figure, labels: list[str], values: list[float], colors: list[str]) -> Any:
    axes = figure.add_subplot()
    bars = axes.barh(range(len(values)), values, color=colors)
    axes.set_yticks(range(len(values)), labels, fontsize=8)
    axes.invert_yaxis()  # baseline on top, stages downwards in the order they ran
    axes.grid(axis="x", alpha=0.3)
    return axes, bars


def _plot_throughput(results: dict) -> Figure | None:
    baseline = _num(results.get("baseline_throughput"))
    labels, values, colors = _stage_bars(results, baseline, "throughput", 1.0)
    if not values or (baseline is not None and len(values) == 1):
        return None
    figure = _figure(height=1.2 + 0.35 * len(values))
    axes, bars = _barh(figure, labels, values, colors)
    if baseline:
        axes.bar_label(bars, [f"{v / baseline:.2f}x" for v in values], padding=3, fontsize=8)
        axes.set_xlim(0, max(values) * 1.15)
    axes.set_xlabel(str(results.get("unit") or "throughput"))
    axes.set_title("Throughput after each stage (green: a technique adopted)", fontsize=10)
    return figure


def _plot_memory(results: dict) -> Figure | None:
    mib = 2.0**20
    baseline = _num(_baseline_candidate(results).get("memory_bytes"))
    labels, values, colors = _stage_bars(results, baseline, "memory_bytes", mib)
    if not values or (baseline is not None and len(values) == 1):
        return None
    figure = _figure(height=1.2 + 0.35 * len(values))
    axes, bars = _barh(figure, labels, values, colors)
    axes.bar_label(bars, [f"{v:,.0f}" for v in values], padding=3, fontsize=8)
    budget = _num(results.get("memory_budget_bytes"))
    limit = max(values)
    if budget is not None:
        axes.axvline(budget / mib, color="#c62828", linestyle="--", label="memory budget")
        axes.legend(fontsize=8, loc="lower right")
        limit = max(limit, budget / mib)
    axes.set_xlim(0, limit * 1.15)
    axes.set_xlabel("peak memory (MiB)")
    axes.set_title("Peak memory after each stage", fontsize=10)
    return figure


def _plot_breakdown(results: dict) -> Figure | None:
    breakdown = results.get("breakdown")
    if not isinstance(breakdown, dict):
        return None
    columns = {
        label: {k: v for k, v in (breakdown.get(key) or {}).items() if _num(v) is not None}
        for key, label in (("baseline", "baseline"), ("best", "chosen"))
    }
    columns = {label: phases for label, phases in columns.items() if phases}
    if not columns:
        return None
    # Phases in the order they first appear: the order of a step (forward, backward, ...).
    phases = list(dict.fromkeys(p for column in columns.values() for p in column))
    figure = _figure()
    axes = figure.add_subplot()
    bottoms = [0.0] * len(columns)
    for phase in phases:
        heights = [1000 * float(column.get(phase, 0.0)) for column in columns.values()]
        axes.bar(list(columns), heights, bottom=bottoms, label=_plain(phase), width=0.5)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    for x, total in enumerate(bottoms):
        axes.annotate(f"{total:.1f} ms", (x, total), ha="center", va="bottom", fontsize=8)
    axes.set_ylim(0, max(bottoms) * 1.15 or 1.0)
    axes.set_ylabel("ms per step")
    axes.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    axes.set_title("Where a step's time goes, before and after", fontsize=10)
    return figure


def _plot_loss(results: dict) -> Figure | None:
    curves = results.get("loss_curves")
    if not isinstance(curves, dict):
        return None
    series = {}
    for key, label in (("baseline", f"baseline ({BASELINE_LABEL})"), ("best", "chosen")):
        points = [(i, v) for i, v in enumerate(curves.get(key) or [], 1) if _num(v) is not None]
        if points:
            series[label] = points
    if not series:
        return None
    from matplotlib.ticker import MaxNLocator  # lazily, as in _figure

    figure = _figure()
    axes = figure.add_subplot()
    for label, points in series.items():
        steps, losses = zip(*points, strict=True)
        axes.plot(steps, losses, label=label, marker="." if len(points) < 30 else None)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    axes.set_title("Training loss, baseline and chosen configuration", fontsize=10)
    return figure


@dataclass(frozen=True)
class _Plot:
    name: str
    caption: str
    draw: Callable[[dict], Figure | None]
    missing: str  # said in the report when the results hold no data for it


_PLOTS = (
    _Plot("throughput", "Throughput after each stage", _plot_throughput, "no stage throughputs"),
    _Plot("memory", "Peak memory after each stage", _plot_memory, "no memory figures"),
    _Plot("breakdown", "Step time by phase", _plot_breakdown, "no step-time breakdown"),
    _Plot("loss", "Loss curves", _plot_loss, "no loss curves"),
)


def _png(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()


# --- documents: a list of blocks, rendered to markdown and to HTML ----------------------------


@dataclass(frozen=True)
class _Heading:
    text: str
    level: int = 2


@dataclass(frozen=True)
class _Para:
    text: str
    strong: bool = False


@dataclass(frozen=True)
class _Grid:
    headers: tuple[str, ...]
    rows: list[tuple[str, ...]]
    verdict_column: int | None = None  # colours rows in HTML


@dataclass(frozen=True)
class _Image:
    name: str
    caption: str


@dataclass(frozen=True)
class _Code:
    text: str
    language: str


_Block = _Heading | _Para | _Grid | _Image | _Code


def _blocks(results: dict, drawn: Iterable[str]) -> list[_Block]:
    drawn = set(drawn)
    recipe = str(results.get("recipe") or "recipe")
    blocks: list[_Block] = [
        _Heading(f"torchturbo tune report: {recipe}", 1),
        _Para(_system_line(results)),
        _Para(_headline(results), strong=True),
        _Para(_confirmation_line(results)),
        _Para(_budget_line(results)),
        _Heading("Incremental table"),
        _Para("The baseline, then one adopted technique per row; throughput is cumulative."),
        _Grid(_headers(_INCREMENTAL_HEADERS, results), _incremental_rows(results)),
        _Heading("Stages"),
        _Grid(_headers(_STAGE_HEADERS, results), _stage_rows(results)),
        _Heading("Every candidate"),
        _Grid(_headers(_CANDIDATE_HEADERS, results), _candidate_rows(results), verdict_column=2),
        _Heading("Input pipeline"),
        _Para(_loader_line(results)),
        _Heading("Plots"),
    ]
    for plot in _PLOTS:
        if plot.name in drawn:
            blocks.append(_Image(plot.name, plot.caption))
        else:
            blocks.append(_Para(f"No {plot.name} plot: the results hold {plot.missing}."))
    blocks += [
        _Heading("How to use"),
        _Para("The tuned configuration is turbo.toml, beside this report. In a training script:"),
        _Code(
            "import torchturbo\n\n"
            'turbo = torchturbo.Turbo(torchturbo.TurboConfig.load("turbo.toml"))\n'
            "model, optimizer, loader = turbo.setup(model, optimizer, dataset)\n"
            "for batch in loader:\n"
            "    metrics = turbo.step(loss_fn, batch)",
            "python",
        ),
        _Para("To measure it again, side by side with the baseline:"),
        _Code(f"torchturbo bench {recipe} --config turbo.toml", "bash"),
    ]
    return blocks


def _md(text: str) -> str:
    """Markdown-safe inline text: no raw HTML, no table breaks."""
    return html.escape(text, quote=False).replace("|", "\\|").replace("\n", " ")


def _markdown(blocks: list[_Block]) -> str:
    parts = []
    for block in blocks:
        match block:
            case _Heading(text, level):
                parts.append(f"{'#' * level} {_md(text)}")
            case _Para(text, strong):
                parts.append(f"**{_md(text)}**" if strong else _md(text))
            case _Grid(headers, rows):
                lines = [
                    "| " + " | ".join(map(_md, headers)) + " |",
                    "|" + " --- |" * len(headers),
                    *("| " + " | ".join(map(_md, row)) + " |" for row in rows),
                ]
                parts.append("\n".join(lines))
            case _Image(name, caption):
                parts.append(f"![{_md(caption)}]({name}.png)")
            case _Code(text, language):
                parts.append(f"```{language}\n{text}\n```")
    return "\n\n".join(parts) + "\n"


_STYLE = """
body { font-family: system-ui, sans-serif; max-width: 1200px; margin: 2em auto; padding: 0 1em;
       color: #212121; line-height: 1.45; }
.headline { font-size: 1.3em; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }
th, td { border: 1px solid #e0e0e0; padding: 0.3em 0.6em; text-align: left; vertical-align: top; }
th { background: #f5f5f5; }
tr.adopted td { background: #e8f5e9; }
tr.rejected td { background: #ffebee; }
tr.skipped td, tr.kept td { color: #616161; }
pre { background: #f5f5f5; padding: 0.8em; overflow-x: auto; }
figure { margin: 1em 0; }
img { max-width: 100%; }
"""


def _html_grid(grid: _Grid) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in grid.headers)
    body = []
    for row in grid.rows:
        verdict = row[grid.verdict_column] if grid.verdict_column is not None else ""
        attr = f' class="{verdict}"' if verdict in _VERDICTS else ""
        cells = "".join(f"<td>{html.escape(cell)}</td>" for cell in row)
        body.append(f"<tr{attr}>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _html(blocks: list[_Block], pngs: dict[str, bytes], title: str) -> str:
    parts = []
    for block in blocks:
        match block:
            case _Heading(text, level):
                parts.append(f"<h{level}>{html.escape(text)}</h{level}>")
            case _Para(text, strong):
                inner = f"<strong>{html.escape(text)}</strong>" if strong else html.escape(text)
                parts.append(f'<p class="headline">{inner}</p>' if strong else f"<p>{inner}</p>")
            case _Grid():
                parts.append(_html_grid(block))
            case _Image(name, caption):
                # Embedded, not linked: the page must open offline and survive being mailed alone.
                data = base64.b64encode(pngs[name]).decode("ascii")
                parts.append(
                    f'<figure><img src="data:image/png;base64,{data}" alt="{html.escape(caption)}">'
                    f"<figcaption>{html.escape(caption)}</figcaption></figure>"
                )
            case _Code(text, _):
                parts.append(f"<pre><code>{html.escape(text)}</code></pre>")
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{html.escape(title)}</title>\n<style>{_STYLE}</style>\n</head>\n<body>\n"
        + "\n".join(parts)
        + "\n</body>\n</html>\n"
    )


# --- writing ----------------------------------------------------------------------------------


def _write_atomic(path: Path, data: bytes) -> None:
    """Write beside ``path`` under a temporary name, then rename over it (atomic on POSIX)."""
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with open(temporary, "xb") as f:  # open(), not mkstemp: the file keeps the umask's mode
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def _prepare_dir(out_dir: Path) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(
            errno.ENOTDIR, "the report's output path exists and is not a folder", str(out_dir)
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise PermissionError(
            errno.EACCES, "the report's output folder is not writable", str(out_dir)
        )


def write_report(out_dir: Path, results: dict, config_toml: str) -> dict[str, Path]:
    """Write turbo.toml, results.json, report.md, report.html and the PNG plots; return their paths.

    ``out_dir`` is created if missing. The returned keys are ``"config"`` (turbo.toml),
    ``"results"`` (results.json), ``"markdown"`` (report.md), ``"html"`` (report.html) and one
    per plot drawn, from ``"throughput"``, ``"memory"``, ``"breakdown"``, ``"loss"``
    (``<name>.png``); a plot whose data is missing is left out and the reports say why.
    Raises PermissionError / NotADirectoryError naming ``out_dir`` when it cannot be written, and
    TypeError (before writing anything) when ``results`` is not JSON-serialisable.
    """
    out_dir = Path(out_dir)
    record = json.dumps(results, indent=2) + "\n"
    _prepare_dir(out_dir)
    paths = {"results": out_dir / "results.json", "config": out_dir / "turbo.toml"}
    # The record and the config first: if drawing fails later, the measurements are kept.
    _write_atomic(paths["results"], record.encode())
    _write_atomic(paths["config"], config_toml.encode())

    pngs: dict[str, bytes] = {}
    for plot in _PLOTS:
        figure = plot.draw(results)
        path = out_dir / f"{plot.name}.png"
        if figure is None:
            path.unlink(missing_ok=True)  # a previous run's plot would contradict this report
            continue
        pngs[plot.name] = _png(figure)
        paths[plot.name] = path
        _write_atomic(path, pngs[plot.name])

    blocks = _blocks(results, pngs)
    title = f"torchturbo tune report: {results.get('recipe') or 'recipe'}"
    paths["markdown"] = out_dir / "report.md"
    paths["html"] = out_dir / "report.html"
    _write_atomic(paths["markdown"], _markdown(blocks).encode())
    _write_atomic(paths["html"], _html(blocks, pngs, title).encode())
    return paths
