"""The command follows the conventions users expect: --version, global options after the
command, one meaning per option name, choices and defaults in --help."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from torchturbo import __version__
from torchturbo.cli import main
from torchturbo.cli.arguments import EXPORT_METHODS, SIZE_CHOICES, WORKLOADS
from torchturbo.cli.parser import build_parser
from torchturbo.recipe import RecipeError

TINY = str(Path(__file__).parent / "recipes" / "tiny.py") + ":recipe"


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_version_flag_prints_the_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"torchturbo {__version__}"


@pytest.mark.parametrize("position", ["before", "after"])
def test_debug_is_accepted_before_and_after_the_command(position: str) -> None:
    argv = ["bench", "missing.py:recipe"]
    argv = ["--debug", *argv] if position == "before" else [argv[0], "--debug", *argv[1:]]
    with pytest.raises(RecipeError, match="does not exist"):
        main(argv)


def test_without_debug_the_same_error_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "missing.py:recipe"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_memory_budget_means_total_memory_and_only_tune_has_it() -> None:
    owners = {
        name: {s for a in sub._actions for s in a.option_strings}
        for name, sub in _subcommands().items()
    }
    assert [n for n, options in owners.items() if "--memory-budget" in options] == ["tune"]
    assert [n for n, options in owners.items() if "--activation-budget" in options] == ["train"]
    assert main(["train", TINY, "--steps", "1", "--memory-budget", "1GiB"]) == 2


def _help(parser: argparse.ArgumentParser) -> str:
    return " ".join(parser.format_help().split())  # whatever the terminal width wrapped


def test_help_shows_choices_and_defaults() -> None:
    commands = _subcommands()
    bench = _help(commands["bench"])
    assert "{vision,segmentation,text}" in bench and "(default: vision)" in bench
    assert "(default: 15)" in bench and "{baseline,fast}" in bench and "(default: fast)" in bench
    tune = _help(commands["tune"])
    assert "(default: 5m)" in tune and "else 1,000, assumed)" in tune
    assert "(default: None)" not in tune and "(default: False)" not in tune
    assert "{export,torchscript}" in _help(commands["export"])
    assert "whether bf16 is native here" in _help(commands["version"])


def test_every_help_fits_80_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    texts = [build_parser().format_help(), *(p.format_help() for p in _subcommands().values())]
    for text in texts:
        assert max(len(line) for line in text.splitlines()) <= 80


def test_the_article_is_named_once() -> None:
    texts = [build_parser().format_help(), *(p.format_help() for p in _subcommands().values())]
    assert sum(text.count("实战技巧") for text in texts) == 1


def test_listed_names_match_what_the_package_accepts() -> None:
    from torchturbo.techniques.tools.export import METHODS
    from torchturbo.workloads import SIZE_CHOICES as SIZES
    from torchturbo.workloads import WORKLOADS as REGISTERED

    assert tuple(REGISTERED) == WORKLOADS
    assert SIZES == SIZE_CHOICES
    assert METHODS == EXPORT_METHODS


def test_export_from_a_train_checkpoint_says_which_weights_and_the_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "ckpt"
    train = ["train", TINY, "--device", "cpu", "--steps", "2", "--checkpoint-dir", str(ckpt)]
    assert main(train) == 0
    out = tmp_path / "tiny.pt2"
    assert main(["export", TINY, "--checkpoint", str(ckpt), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}: " in printed and "of trained weights" in printed
    assert "KiB" in printed and "max relative difference" in printed


def test_help_does_not_import_torch() -> None:
    """--help and --version answer at once: the choices they list are not read from torch code."""
    import subprocess
    import sys

    probe = (
        "import sys; from torchturbo.cli.parser import build_parser; build_parser().format_help(); "
        "print(sorted(m for m in ('torch', 'rich', 'matplotlib') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "[]"


def test_only_a_command_that_takes_a_config_imports_the_config_module() -> None:
    """The --section.field options need config.py (0.1-0.2 s of start-up): `torchturbo --help`
    and the other commands do not wait for it; `bench --help` lists the options, so it does."""
    import subprocess
    import sys

    probe = (
        "import sys, contextlib, io; from torchturbo.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out: main(sys.argv[1:])\n"
        "print('torchturbo.config' in sys.modules, '--precision.dtype' in out.getvalue())"
    )
    seen = {
        command: subprocess.run(
            [sys.executable, "-c", probe, *command.split()],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout.split()
        for command in ("--help", "tune --help", "bench --help")
    }
    assert seen == {
        "--help": ["False", "False"],
        "tune --help": ["False", "False"],
        "bench --help": ["True", "True"],
    }
