"""The report's four plots (throughput, memory, step-time breakdown, loss) as PNG bytes.

:data:`PLOTS` lists them in report order, each with a caption and the words the report uses when
the results hold no data for it; a drawing function returns None rather than an empty figure.
Plots use matplotlib's object API on an Agg canvas rather than pyplot, so drawing never switches
the caller's backend or leaves figures in pyplot's registry. matplotlib is an extra
(``torchturbo[plots]``): without it :func:`plots_left_out` says so and the report has no plots.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torchturbo.tune.report.fields import (
    BASELINE_LABEL,
    adopted_rows,
    adoption_label,
    baseline_candidate,
    num,
    replacements,
)
from torchturbo.tune.report.tables import incremental_figures

if TYPE_CHECKING:
    from matplotlib.figure import Figure

_BASELINE_COLOR = "#757575"
_ADOPTED_COLOR = "#2e7d32"


#: How to get the plots where matplotlib is missing: the report and the CLI say it.
PLOTS_EXTRA = "pip install 'torchturbo[plots]' (or pip install matplotlib)"


def plots_left_out() -> str | None:
    """Why the report can draw no plots (matplotlib cannot be imported), or None."""
    try:
        import matplotlib  # noqa: F401  # the whole of the check: _figure imports the rest
    except ImportError:
        return f"matplotlib is not installed; {PLOTS_EXTRA} draws them"
    return None


def _figure(height: float = 3.6) -> Figure:
    # Imported here: matplotlib takes a noticeable fraction of a second to import, and the
    # terminal table (or `import torchturbo.tune.report.write`) should not pay for it.
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
    """Bar labels, values and colours: the baseline (when known), then each kept adoption."""
    labels, values, colors = [], [], []
    if baseline is not None:
        labels.append("baseline")
        values.append(baseline / scale)
        colors.append(_BASELINE_COLOR)
    replaced = replacements(results)
    for row in adopted_rows(results):
        value = num(row.get(key))
        if value is None:
            continue
        name = adoption_label(str(row.get("name")), results, replaced)
        labels.append(_plain(f"+ {name} ({row.get('stage')})"))
        values.append(value / scale)
        colors.append(_ADOPTED_COLOR)
    return labels, values, colors


def _barh(figure: Figure, labels: list[str], values: list[float], colors: list[str]) -> Any:
    axes = figure.add_subplot()
    bars = axes.barh(range(len(values)), values, color=colors)
    axes.set_yticks(range(len(values)), labels, fontsize=8)
    axes.invert_yaxis()  # baseline on top, stages downwards in the order they ran
    axes.grid(axis="x", alpha=0.3)
    return axes, bars


_REPLACED_COLOR = "#a5d6a7"


def throughput_bars(results: dict) -> list[tuple[str, float, str]]:
    """(label, throughput, colour) per bar of the throughput plot: the incremental table's
    rows (``tables.incremental_figures``), so that the plot shows the table's figures, all
    from the confirmation's rounds. A row a later adoption replaced is drawn pale and says by
    what, since its bar may stand above the one that replaced it (within the noise)."""
    bars = []
    for i, row in enumerate(incremental_figures(results)):
        value = num(row.get("throughput"))
        if value is None:
            continue
        label = "baseline" if i == 0 else str(row["label"])
        if row.get("stage"):
            label += f" ({row['stage']})"
        colour = _BASELINE_COLOR if i == 0 else _ADOPTED_COLOR
        if row.get("replaced_by"):
            label += f", replaced by {row['replaced_by']}"
            colour = _REPLACED_COLOR
        bars.append((_plain(label), value, colour))
    return bars


def _plot_throughput(results: dict) -> Figure | None:
    bars = throughput_bars(results)
    if len(bars) < 2:
        return None
    labels, values, colors = (list(column) for column in zip(*bars, strict=True))
    baseline = values[0]
    figure = _figure(height=1.2 + 0.35 * len(values))
    axes, drawn = _barh(figure, labels, values, colors)
    axes.bar_label(drawn, [f"{v / baseline:.2f}x" for v in values], padding=3, fontsize=8)
    axes.set_xlim(0, max(values) * 1.15)
    axes.set_xlabel(str(results.get("unit") or "throughput"))
    axes.set_title("Throughput as each adopted technique is added", fontsize=10)
    return figure


def _plot_memory(results: dict) -> Figure | None:
    mib = 2.0**20
    baseline = num(baseline_candidate(results).get("memory_bytes"))
    labels, values, colors = _stage_bars(results, baseline, "memory_bytes", mib)
    if not values or (baseline is not None and len(values) == 1):
        return None
    figure = _figure(height=1.2 + 0.35 * len(values))
    axes, bars = _barh(figure, labels, values, colors)
    axes.bar_label(bars, [f"{v:,.0f}" for v in values], padding=3, fontsize=8)
    budget = num(results.get("memory_budget_bytes"))
    limit = max(values)
    if budget is not None:
        axes.axvline(budget / mib, color="#c62828", linestyle="--", label="memory budget")
        axes.legend(fontsize=8, loc="lower right")
        limit = max(limit, budget / mib)
    axes.set_xlim(0, limit * 1.15)
    axes.set_xlabel("peak memory (MiB)")
    axes.set_title("Peak memory as each adopted technique is added", fontsize=10)
    return figure


def _plot_breakdown(results: dict) -> Figure | None:
    breakdown = results.get("breakdown")
    if not isinstance(breakdown, dict):
        return None
    columns = {
        label: {k: v for k, v in (breakdown.get(key) or {}).items() if num(v) is not None}
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
    series = {key: _finite_points(curves.get(key)) for key in ("baseline", "best")}
    if not any(series.values()):
        return None
    from matplotlib.ticker import MaxNLocator  # lazily, as in _figure

    figure = _figure(height=4.4)
    curves_axes, diff_axes = figure.subplots(
        2, 1, sharex=True, gridspec_kw={"height_ratios": (3, 2)}
    )
    # Parity makes the two curves overlap: different line styles and markers, the chosen one
    # drawn on top, keep both visible; the lower panel shows what the eye cannot.
    for key, label, color, style, marker in (
        ("baseline", f"baseline ({BASELINE_LABEL})", _BASELINE_COLOR, "-", "o"),
        ("best", "chosen", _ADOPTED_COLOR, "--", "x"),
    ):
        if series[key]:
            steps, losses = zip(*series[key], strict=True)
            curves_axes.plot(
                steps,
                losses,
                label=label,
                color=color,
                linestyle=style,
                marker=marker,
                markersize=5,
                markevery=max(1, len(steps) // 30),
            )
    curves_axes.set_ylabel("loss")
    curves_axes.grid(alpha=0.3)
    curves_axes.legend(fontsize=8)
    curves_axes.set_title("Training loss, baseline and chosen configuration", fontsize=10)
    compared, differences = relative_loss_difference(curves)
    if compared:
        diff_axes.plot(compared, differences, color=_ADOPTED_COLOR, marker="x", markersize=4)
    tolerance = num(results.get("loss_tolerance"))
    if tolerance is not None:
        diff_axes.axhspan(
            -100 * tolerance,
            100 * tolerance,
            color=_BASELINE_COLOR,
            alpha=0.15,
            lw=0,
            label=f"loss tolerance ±{100 * tolerance:g}%",
        )
        diff_axes.legend(fontsize=7, loc="upper left")
    diff_axes.axhline(0.0, color=_BASELINE_COLOR, linewidth=0.8)
    diff_axes.set_ylabel("chosen vs\nbaseline (%)", fontsize=8)
    diff_axes.set_xlabel("optimizer step")
    diff_axes.grid(alpha=0.3)
    diff_axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    return figure


def relative_loss_difference(curves: dict) -> tuple[list[int], list[float]]:
    """Steps where both curves have a loss, and (chosen - baseline) / |baseline| there, in %."""
    baseline = dict(_finite_points(curves.get("baseline")))
    steps, differences = [], []
    for step, loss in _finite_points(curves.get("best")):
        reference = baseline.get(step)
        if reference:
            steps.append(step)
            differences.append(100 * (loss - reference) / abs(reference))
    return steps, differences


def _finite_points(values: Any) -> list[tuple[int, float]]:
    """(1-based step, value) for each finite value of a curve."""
    points = []
    for step, value in enumerate(values or [], 1):
        v = num(value)
        if v is not None:
            points.append((step, v))
    return points


@dataclass(frozen=True)
class Plot:
    """One plot of the report: its file stem, caption and drawing function."""

    name: str
    caption: str
    draw: Callable[[dict], Figure | None]
    missing: str  # said in the report when the results hold no data for it


PLOTS = (
    Plot(
        "throughput",
        "One bar per row of the incremental table: the fp32 eager baseline (grey), then each "
        "adopted technique added in the order it was adopted (green), at the throughput the "
        "confirmation measured, all in the same paired rounds; a pale bar is a config a later "
        "row replaced. Labels give the ratio to the baseline's bar: the last one is the "
        "headline's ratio.",
        _plot_throughput,
        "no adoption confirmed against the baseline",
    ),
    Plot(
        "memory",
        "Peak step memory of the baseline and after each adopted technique, in MiB: what a step "
        "adds over what was resident before it, plus parameters and optimizer state (on CPU "
        "the process's resident-set high-water mark, on CUDA the allocator's peak). The dashed "
        "line is the memory budget, when one was given.",
        _plot_memory,
        "no memory figures",
    ),
    Plot(
        "breakdown",
        "Milliseconds of a training step by phase, the fp32 eager baseline against the chosen "
        "configuration; the number on each bar is the step's total.",
        _plot_breakdown,
        "no step-time breakdown",
    ),
    Plot(
        "loss",
        "Top: training loss per optimizer step from the same initial weights, the baseline "
        "(grey circles) and the chosen configuration (green crosses, dashed). Bottom: their "
        "difference in % of the baseline's loss, which stays readable where the curves "
        "overlap; the shaded band is the loss tolerance, which the tuner applies to the mean "
        "over the first steps.",
        _plot_loss,
        "no loss curves",
    ),
)


def png(figure: Figure) -> bytes:
    """The figure as PNG bytes, kept in memory: written to disk and embedded in the HTML."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()
