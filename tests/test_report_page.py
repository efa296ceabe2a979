"""report.html in a real browser at desktop and phone widths, and the plots that go into it.

A headless Chromium loads the report with a small probe script appended (the report itself has
none). Headless windows are at least 500 px wide, so the report is loaded into an iframe of the
width under test (its media queries then see that width); the probe posts the page's
measurements to the outer page, which writes them into the DOM that ``--dump-dom`` prints.
Skipped where no Chromium is installed (``apt-get install chromium``; ``.ci/run`` does it).
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from test_tune_report import CONFIG_TOML, full_results

from torchturbo.tune.report.document import _numeric_columns
from torchturbo.tune.report.plots import PLOTS, _plot_loss, relative_loss_difference
from torchturbo.tune.report.write import write_report

_BROWSER = next(
    (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)),
    None,
)
_PROBE = """<script>
window.addEventListener("load", () => {
  const style = (selector, property) => {
    const element = document.querySelector(selector);
    return element ? getComputedStyle(element)[property] : null;
  };
  parent.postMessage(JSON.stringify({
    scroll: document.documentElement.scrollWidth,
    viewport: document.documentElement.clientWidth,
    numberAlign: style("td.num", "textAlign"),
    secondary: style("tr.not-measured td, tr.not-applicable td", "color"),
    caption: style("figcaption", "color"),
    figures: document.querySelectorAll("figure img").length,
  }), "*");
});
</script>"""
_FRAME = """<!DOCTYPE html><html><body style="margin:0">
<iframe src="{src}" style="border:0;width:{width}px;height:1000px"></iframe>
<pre id="probe"></pre>
<script>
window.addEventListener("message", (event) => {{
  document.getElementById("probe").textContent = event.data;
}});
</script></body></html>"""


def _report(tmp_path: Path) -> Path:
    results = full_results()
    # Long unbreakable names are what push a narrow page sideways.
    results["recipe"] = "/home/someone/projects/segmentation/experiments/my_recipe.py:recipe"
    return write_report(tmp_path / "report", results, CONFIG_TOML)["html"]


def _browse(page: Path, width: int, tmp_path: Path, *, screenshot: Path | None = None) -> dict:
    """Load ``page`` in a frame ``width`` CSS pixels wide; the probe's measurements."""
    probe = page.with_name(f"probe-{page.name}")
    probe.write_text(page.read_text().replace("</body>", _PROBE + "</body>"))
    frame = page.with_name(f"frame-{width}-{page.name}")
    frame.write_text(_FRAME.format(src=probe.name, width=width))
    flags = [
        _BROWSER,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={tmp_path / f'profile-{width}-{page.stem}'}",
        f"--window-size={max(width, 500) + 20},1040",
        "--virtual-time-budget=5000",  # let the load handlers run before the DOM is dumped
    ]
    dom = subprocess.run(
        [*flags, "--dump-dom", frame.as_uri()], capture_output=True, text=True, timeout=120
    ).stdout
    found = re.search(r'<pre id="probe">(.+?)</pre>', dom)
    assert found, f"the probe did not report at {width} px:\n{dom[-2000:]}"
    if screenshot is not None:  # for a person to look at: kept in the test's tmp_path
        subprocess.run(
            [*flags, f"--screenshot={screenshot}", frame.as_uri()], capture_output=True, timeout=120
        )
    return json.loads(html.unescape(found.group(1)))


def _rgb(css: str) -> tuple[int, int, int]:
    r, g, b = (int(v) for v in re.findall(r"\d+", css)[:3])
    return r, g, b


def _contrast(foreground: tuple[int, ...], background: tuple[int, ...]) -> float:
    """WCAG 2 contrast ratio of two sRGB colours."""

    def luminance(rgb: tuple[int, ...]) -> float:
        linear = [(c / 255) / 12.92 if c <= 10 else ((c / 255 + 0.055) / 1.055) ** 2.4 for c in rgb]
        return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]

    light, dark = sorted((luminance(foreground), luminance(background)), reverse=True)
    return (light + 0.05) / (dark + 0.05)


@pytest.mark.skipif(_BROWSER is None, reason="no Chromium (apt-get install chromium)")
@pytest.mark.parametrize("width", [1280, 400])
def test_the_page_never_scrolls_sideways(tmp_path: Path, width: int) -> None:
    page = _report(tmp_path)
    shot = tmp_path / f"report-{width}.png"
    measured = _browse(page, width, tmp_path, screenshot=shot)
    assert measured["scroll"] <= measured["viewport"] <= width, (measured, shot)
    assert measured["figures"] == len(PLOTS)
    assert measured["numberAlign"] == "right"
    # Secondary text (skipped rows, captions) reads at the WCAG AAA ratio on white.
    for key in ("secondary", "caption"):
        assert _contrast(_rgb(measured[key]), (255, 255, 255)) >= 7, measured[key]


@pytest.mark.skipif(_BROWSER is None, reason="no Chromium (apt-get install chromium)")
def test_negative_control_tables_without_their_box_push_the_page_wide(tmp_path: Path) -> None:
    page = _report(tmp_path)
    boxless = page.with_name("boxless.html")
    boxless.write_text(page.read_text().replace(".grid { overflow-x: auto;", ".grid {"))
    measured = _browse(boxless, 400, tmp_path)
    assert measured["scroll"] > measured["viewport"], measured


def test_numbers_are_right_aligned_in_markdown_and_html(tmp_path: Path) -> None:
    page = _report(tmp_path)
    markdown = page.with_name("report.md").read_text()
    assert "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |" in markdown
    html = page.read_text()
    assert '<td class="num">1,500</td>' in html and '<td class="num">400.0 MiB</td>' in html
    assert '<div class="grid"><table>' in html


def test_numeric_columns_are_told_from_text_columns() -> None:
    rows = [
        ("baseline", "812", "1.00x", "n/a", "78.8", "the reference"),
        ("bf16", "1,500", "1.85x", "3.0%", "520.0 MiB", "1.85x faster (noise 3%)"),
    ]
    assert _numeric_columns(rows) == [False, True, True, True, True, False]
    assert _numeric_columns([("n/a", "")]) == [False, False]  # nothing says it is a number


def test_captions_add_to_the_titles_instead_of_repeating_them() -> None:
    results = full_results()
    for plot in PLOTS:
        title = plot.draw(results).axes[0].get_title()
        assert title.lower() not in plot.caption.lower() and len(plot.caption) > 2 * len(title)


def test_overlapping_loss_curves_stay_distinguishable() -> None:
    results = full_results()
    results["loss_curves"] = {"baseline": [2.3, 2.2, 2.1], "best": [2.3, 2.2, 2.1]}
    figure = _plot_loss(results)
    curves, difference = figure.axes
    baseline, chosen = curves.get_lines()
    assert baseline.get_marker() != chosen.get_marker()
    assert baseline.get_linestyle() != chosen.get_linestyle()
    assert chosen.get_zorder() >= baseline.get_zorder()
    # Identical curves: the difference panel shows a flat zero, not an empty plot.
    assert list(difference.get_lines()[0].get_ydata()) == [0.0, 0.0, 0.0]


def test_relative_loss_difference_uses_steps_both_curves_have() -> None:
    curves = {"baseline": [2.0, None, 4.0, 1.0], "best": [2.2, 3.0, 3.0]}
    steps, differences = relative_loss_difference(curves)
    assert steps == [1, 3]
    assert differences == pytest.approx([10.0, -25.0])
