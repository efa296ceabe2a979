"""The report document: one list of blocks, rendered to markdown and to self-contained HTML.

:func:`build_blocks` lays out the report once (headline, tables, plots, how to use the tuned
config), and both renderers walk the same list, so the markdown and the HTML never disagree. The
HTML is written by hand with ``html.escape`` rather than through a markdown library or a template
engine: it is a handful of headings, tables and images, a page that must open offline needs no
more, and it costs no dependency.
"""

from __future__ import annotations

import base64
import html
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from torchturbo.config import ConfigError, TurboConfig
from torchturbo.techniques import registry
from torchturbo.tune.report.fields import adopted_rows
from torchturbo.tune.report.plots import PLOTS
from torchturbo.tune.report.summary import (
    batch_line,
    batch_notes,
    budget_line,
    confirmation_line,
    headline,
    incremental_note,
    loader_line,
    system_line,
)
from torchturbo.tune.report.tables import (
    BATCH_HEADERS,
    CANDIDATE_HEADERS,
    INCREMENTAL_HEADERS,
    batch_rows,
    candidate_rows,
    header_row,
    incremental_rows,
)

#: Verdicts that colour their row in HTML (CSS classes: spaces become dashes).
_VERDICTS = ("adopted", "rejected", "undecided", "not measured", "not applicable")


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


def build_blocks(
    results: dict, drawn: Iterable[str], *, plots_left_out: str | None = None
) -> list[_Block]:
    """The report, in order; ``drawn`` names the plots that have a PNG (the rest say why not);
    ``plots_left_out`` says why there are none at all (no matplotlib)."""
    drawn = set(drawn)
    recipe = str(results.get("recipe") or "recipe")
    blocks: list[_Block] = [
        _Heading(f"torchturbo tune report: {recipe}", 1),
        _Para(system_line(results)),
        _Para(headline(results), strong=True),
        _Para(confirmation_line(results)),
        _Para(budget_line(results)),
        *_batch_blocks(results),
        _Heading("Incremental table"),
        _Para(incremental_note(results)),
        _Grid(header_row(INCREMENTAL_HEADERS, results), incremental_rows(results)),
        _Heading("Every candidate"),
        _Para(
            "In the article's stage order (they were measured in order of expected gain per "
            "second). Adopted, rejected with the rule and its numbers, undecided (measured, but "
            "stopped before the rule decided: its estimate and the rounds it would need), not "
            "measured (the budget, with the time it needed) or not applicable (the fact that says "
            "so)."
        ),
        _Grid(header_row(CANDIDATE_HEADERS, results), candidate_rows(results), verdict_column=2),
        _Heading("Input pipeline"),
        _Para(loader_line(results)),
        _Heading("Plots"),
    ]
    if plots_left_out:
        blocks.append(_Para(f"The plots were left out: {plots_left_out}."))
    for plot in () if plots_left_out else PLOTS:
        if plot.name in drawn:
            blocks.append(_Image(plot.name, plot.caption))
        else:
            blocks.append(_Para(f"No {plot.name} plot: the results hold {plot.missing}."))
    blocks += [
        _Heading("How to use"),
        _Para("The tuned configuration is turbo.toml, beside this report. In a training script:"),
        _Code(usage_snippet(results), "python"),
        _Para("To measure it again, side by side with the baseline:"),
        _Code(f"torchturbo bench {recipe} --config turbo.toml", "bash"),
    ]
    blocks += trainer_blocks()
    return blocks


def _batch_blocks(results: dict) -> list[_Block]:
    """The batch finder's section (``--find-batch``): its choice, what it kept and changed, and
    every micro-batch size it measured; nothing without it."""
    line = batch_line(results)
    if not line:
        return []
    return [
        _Heading("Batch for the budget"),
        _Para(line + "."),
        *(_Para(note[0].upper() + note[1:] + ".") for note in batch_notes(results)),
        _Grid(BATCH_HEADERS, batch_rows(results)),
    ]


def usage_snippet(results: dict) -> str:
    """Python that applies turbo.toml to a training loop (tests/test_snippets.py runs it)."""
    rows = adopted_rows(results)
    config = rows[-1].get("config") if rows else None
    fingerprint = results.get("fingerprint")
    size = fingerprint.get("batch_size") if isinstance(fingerprint, dict) else None
    arguments = f"batch_size={size if isinstance(size, int) else 32}"
    if "lengths" in _plan_needs(config):
        arguments += ", lengths=lengths"  # the batch plan needs one length per sample
    return (
        "import torchturbo\n\n"
        'turbo = torchturbo.Turbo(torchturbo.TurboConfig.load("turbo.toml"))\n'
        f"model, optimizer, loader = turbo.setup(model, optimizer, dataset, {arguments})\n"
        "for batch in loader:\n"
        "    metrics = turbo.step(loss_fn, batch)  # loss_fn(model, batch) -> loss or (loss, count)"
    )


def _plan_needs(config: Any) -> frozenset[str]:
    """What the batch plan of a row's config needs of ``Turbo.setup`` (``registry``); nothing
    for a config that is not one (a results file of another version)."""
    try:
        return registry.plan_needs(TurboConfig.from_dict(config))
    except (ConfigError, ValueError, TypeError):
        return frozenset()


def trainer_blocks() -> list[_Block]:
    """The tuned config in the Hugging Face Trainer and in Lightning: the other two ways in.

    Both files named here are written beside turbo.toml
    (``tune.report.files.write_trainer_settings``); their docstrings list what each trainer's
    keywords do not carry.
    """
    return [
        _Heading("In a Hugging Face Trainer", 3),
        _Para(
            "hf_trainer.py, beside this report, holds the equivalent TrainingArguments keywords "
            "(paste them, or compute them from turbo.toml as below). TurboTrainer applies what "
            "the Trainer has no argument for: token-budget length buckets, channels_last, DDP "
            "comm hooks. The file's docstring lists what a plain Trainer misses."
        ),
        _Code(
            "from torchturbo import TurboConfig\n"
            "from torchturbo.integrations.transformers import TurboTrainer, training_arguments\n"
            "from transformers import TrainingArguments\n\n"
            'config = TurboConfig.load("turbo.toml")\n'
            'args = TrainingArguments(output_dir="out", per_device_train_batch_size=16,\n'
            "                         **training_arguments(config).kwargs)\n"
            "trainer = TurboTrainer(model=model, args=args, train_dataset=dataset,\n"
            "                       data_collator=collator, turbo_config=config)\n"
            "trainer.train()",
            "python",
        ),
        _Heading("In Lightning", 3),
        _Para(
            "lightning_trainer.py holds the equivalent Trainer keywords; the callback applies "
            "the model transforms (channels_last, checkpointing, compile) at setup, in the "
            "engine's order."
        ),
        _Code(
            "import lightning as L\n"
            "from torchturbo import TurboConfig\n"
            "from torchturbo.integrations.lightning import TurboLightningCallback, "
            "trainer_kwargs\n\n"
            'config = TurboConfig.load("turbo.toml")\n'
            "trainer = L.Trainer(max_epochs=3, callbacks=[TurboLightningCallback(config)],\n"
            "                    **trainer_kwargs(config).kwargs)\n"
            "trainer.fit(module, datamodule=datamodule)",
            "python",
        ),
    ]


def _md(text: str) -> str:
    """Markdown-safe inline text: no raw HTML, no table breaks."""
    return html.escape(text, quote=False).replace("|", "\\|").replace("\n", " ")


def render_markdown(blocks: list[_Block]) -> str:
    """report.md: images are linked to the PNGs written beside it."""
    parts = []
    for block in blocks:
        match block:
            case _Heading(text, level):
                parts.append(f"{'#' * level} {_md(text)}")
            case _Para(text, strong):
                parts.append(f"**{_md(text)}**" if strong else _md(text))
            case _Grid(headers, rows):
                rule = (" ---: |" if numeric else " --- |" for numeric in _numeric_columns(rows))
                lines = [
                    "| " + " | ".join(map(_md, headers)) + " |",
                    "|" + "".join(rule),
                    *("| " + " | ".join(map(_md, row)) + " |" for row in rows),
                ]
                parts.append("\n".join(lines))
            case _Image(name, caption):
                parts.append(f"![{_md(caption)}]({name}.png)")
            case _Code(text, language):
                parts.append(f"```{language}\n{text}\n```")
    return "\n\n".join(parts) + "\n"


# A number, with an optional unit: what right-aligns a column ("1,500", "1.85x", "3.0%",
# "400.0 MiB", "0.40"). Cells that say a value is missing do not decide either way.
_NUMBER = re.compile(r"^[-+−]?[\d,]*\.?\d+(e[-+]?\d+)?\s*(x|%|ms|s|B|KiB|MiB|GiB|TiB)?$")
_NO_VALUE = frozenset({"", "n/a", "non-finite", "-"})
# A column whose cells run longer than this holds phrases (a reason): it gets room to wrap
# inside the table's scrolling box rather than becoming a one-word-wide sliver.
_PROSE_CHARS = 24


def _numeric_columns(rows: list[tuple[str, ...]]) -> list[bool]:
    """Per column: every cell a number (or a missing value), and at least one number."""
    if not rows:
        return []
    columns = list(zip(*rows, strict=True))
    return [
        any(_NUMBER.match(c) for c in cells)
        and all(c in _NO_VALUE or _NUMBER.match(c) for c in cells)
        for cells in columns
    ]


_STYLE = """
body { font-family: system-ui, sans-serif; max-width: 1200px; margin: 2em auto; padding: 0 1em;
       color: #212121; line-height: 1.45; }
h1, h2, p, figcaption { overflow-wrap: anywhere; }
.headline { font-size: 1.3em; }
.grid { overflow-x: auto; margin: 0.5em 0 1.5em; }
table { border-collapse: collapse; font-size: 0.9em; }
th, td { border: 1px solid #e0e0e0; padding: 0.3em 0.6em; text-align: left; vertical-align: top; }
th { background: #f5f5f5; }
.num { text-align: right; white-space: nowrap; font-variant-numeric: tabular-nums; }
td.prose { min-width: 16em; }
tr.adopted td { background: #e8f5e9; }
tr.rejected td { background: #ffebee; }
tr.undecided td { background: #fff8e1; }
tr.not-measured td, tr.not-applicable td { color: #424242; }
tr.not-measured td:first-child, tr.not-applicable td:first-child {
  box-shadow: inset 3px 0 #bdbdbd; }
pre { background: #f5f5f5; padding: 0.8em; overflow-x: auto; }
figure { margin: 1.5em 0; }
img { max-width: 100%; height: auto; }
figcaption { color: #424242; font-size: 0.95em; max-width: 48em; }
@media (max-width: 600px) {
  body { margin: 1em auto; padding: 0 0.6em; }
  h1 { font-size: 1.5em; }
}
"""


def _html_grid(grid: _Grid) -> str:
    """A table in its own horizontally scrolling box: on a narrow screen the table scrolls, the
    page does not. Numbers are right-aligned; columns of sentences get room to wrap."""
    numeric = _numeric_columns(grid.rows) or [False] * len(grid.headers)
    prose = [any(len(row[i]) > _PROSE_CHARS for row in grid.rows) for i in range(len(numeric))]
    classes = [
        ' class="num"' if num else ' class="prose"' if wide else ""
        for num, wide in zip(numeric, prose, strict=True)
    ]
    head = "".join(
        f"<th{cls if 'num' in cls else ''}>{html.escape(h)}</th>"
        for h, cls in zip(grid.headers, classes, strict=True)
    )
    body = []
    for row in grid.rows:
        verdict = row[grid.verdict_column] if grid.verdict_column is not None else ""
        attr = f' class="{verdict.replace(" ", "-")}"' if verdict in _VERDICTS else ""
        cells = "".join(
            f"<td{cls}>{html.escape(cell)}</td>" for cell, cls in zip(row, classes, strict=True)
        )
        body.append(f"<tr{attr}>{cells}</tr>")
    table = f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
    return f'<div class="grid">{table}</div>'


def render_html(blocks: list[_Block], pngs: dict[str, bytes], title: str) -> str:
    """report.html: one self-contained page, every text escaped and every PNG embedded."""
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
