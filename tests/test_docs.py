"""The README and docs agree with the code and with each other.

Every shell command they show is read back and checked to name what exists: a torchturbo
subcommand and its options, a script in the repository and the options it parses, a make
target; a config file it passes is in the repository or made by an earlier command on the same
page; and a page that runs a bare ``python``/``torchturbo`` says to activate the venv first.
Running every command would take hours; this catches what goes stale. The two READMEs must
carry the same sections and quote the same figures, section by section.
"""

from __future__ import annotations

import argparse
import re
import shlex
from collections import Counter
from pathlib import Path

import pytest

from torchturbo.cli import full_parser

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", ROOT / "README.zh-CN.md", *sorted((ROOT / "docs").rglob("*.md"))]
# Programs a page may run besides ours: the shell's and the system's.
_TOOLS = {
    "apt-get", "cat", "cd", "chromium", "echo", "export", "git", "ls", "mkdir", "pip",
    "printf", "rm", "source", "tar", "tmux", "unzip",
}  # fmt: skip
# Ours, by the name a page may use for them; bare names need an activated venv.
_VENV = (".venv/bin/", "")
_ACTIVATE = "source .venv/bin/activate"
_SHELL = ("bash", "sh", "shell", "console")
_NOT_SHELL = ("python", "toml", "json", "cpp", "text")
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
_INLINE = re.compile(r"`([^`\n]+)`")


def _options(parser: argparse.ArgumentParser) -> set[str]:
    """A parser's options, with those of its own subcommands (`config show`'s for `config`)."""
    own = {s for a in parser._actions for s in a.option_strings}
    nested = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return own.union(*(_options(sub) for a in nested for sub in a.choices.values()))


def _subcommand_options() -> dict[str, set[str]]:
    parser = full_parser()
    globals_ = {s for a in parser._actions for s in a.option_strings}
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: globals_ | _options(sub) for name, sub in action.choices.items()}


SUBCOMMANDS = _subcommand_options()
MAKE_TARGETS = set(re.findall(r"^([\w.-]+):", (ROOT / "Makefile").read_text(), re.M))


def _lines(block: str) -> list[str]:
    """Logical lines of a shell block: continuations joined, prompts dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [line.strip().removeprefix("$ ") for line in joined.splitlines() if line.strip()]


def _program(word: str) -> str:
    for prefix in _VENV:
        if prefix and word.startswith(prefix):
            return word.removeprefix(prefix)
    return word


def _ours(words: list[str]) -> bool:
    first = words[0] if words else ""
    program = _program(first)
    if program in ("torchturbo", "torchrun", "make"):
        return True
    return program in ("python", "python3") and len(words) > 1


def commands(text: str) -> list[tuple[list[str], str | None]]:
    """(words, the code block it is in, or None inline) for each command on a page, in order.

    Shell blocks (bash, sh, console) hold commands only; other code blocks and inline code
    count where they start with one of our programs (the rest is sample output or prose).
    """
    found = []
    blocks = [
        (m.group(1) in _SHELL, True, m.group(2))
        for m in _FENCE.finditer(text)
        if m.group(1) not in _NOT_SHELL
    ]
    blocks += [(False, False, m.group(1)) for m in _INLINE.finditer(_FENCE.sub("", text))]
    for shell, fenced, block in blocks:
        for line in _lines(block):
            try:
                words = shlex.split(line, comments=True)
            except ValueError:
                continue  # not shell (a snippet of prose in backticks)
            # Inline, a lone program name is a mention ("run it under `torchrun`").
            runnable = _ours(words) and "..." not in line and (fenced or len(words) > 1)
            if words and (shell or runnable):
                found.append((words, block if fenced else None))
    return found


def _check(words: list[str], made: set[str]) -> list[str]:
    """What is wrong with one command; records files it makes in ``made``."""
    if ">" in words:
        made.add(words[words.index(">") + 1])
        words = words[: words.index(">")]
    while words and re.match(r"^[A-Z_]+=", words[0]):  # VAR=value prefixes
        words = words[1:]
    program = _program(words[0])
    if program in _TOOLS:
        return []
    if program == "make":
        bad = [w for w in words[1:] if "=" not in w and w not in MAKE_TARGETS]
        return [f"make has no target {w!r}" for w in bad]
    if program in ("python", "python3"):
        if words[1:3] == ["-m", "torchturbo"]:
            return _check_torchturbo(words[3:], made)
        if words[1] in ("-c", "-m"):
            return []
        return _check_script(words[1], words[2:])
    if program == "torchrun":
        return _check_torchrun(words[1:], made)
    if program == "torchturbo":
        if "launch" in words[1:2]:  # torchrun's options and command, as torchrun takes them
            return _check_torchrun(words[2:], made)
        return _check_torchturbo(words[1:], made)
    return [f"unknown program {words[0]!r}"]


def _check_torchrun(rest: list[str], made: set[str]) -> list[str]:
    while rest and rest[0].startswith("-") and rest[0] != "-m":
        rest = rest[2:] if "=" not in rest[0] and rest[0] != "--standalone" else rest[1:]
    if rest[:2] == ["-m", "torchturbo"]:
        return _check_torchturbo(rest[2:], made)
    # Otherwise the user's own training script (docs/distributed.md), or one of ours.
    ours = rest and rest[0].startswith("benchmarks/")
    return _check_script(rest[0], rest[1:]) if ours else []


def _check_torchturbo(args: list[str], made: set[str]) -> list[str]:
    options = [a.split("=")[0] for a in args if a.startswith("-")]
    command = next((a for a in args if not a.startswith("-")), None)
    if command is None:
        unknown = set(options) - SUBCOMMANDS["version"]
        return [f"torchturbo has no option {o}" for o in sorted(unknown)]
    if command not in SUBCOMMANDS:
        return [f"torchturbo has no command {command!r}"]
    problems = [f"torchturbo {command} has no option {o}" for o in options]
    problems = [p for p, o in zip(problems, options, strict=True) if o not in SUBCOMMANDS[command]]
    if "--config" in args[:-1]:
        config = args[args.index("--config") + 1]
        if config not in made and not (ROOT / config).exists():
            problems.append(f"--config {config}: no earlier command on the page makes it")
    if command == "tune":
        out = args[args.index("--out") + 1] if "--out" in args[:-1] else "turbo-report"
        made.add(f"{out.rstrip('/')}/turbo.toml")
    return problems


def _check_script(script: str, args: list[str]) -> list[str]:
    path = ROOT / script
    if not path.is_file():
        return [f"no script {script}"]
    source = path.read_text()
    options = {a.split("=")[0] for a in args if a.startswith("--")}
    return [f"{script} parses no {o}" for o in sorted(options) if f'"{o}"' not in source]


@pytest.mark.parametrize("page", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_names_what_exists(page: Path) -> None:
    made: set[str] = set()
    problems = []
    for words, _ in commands(page.read_text()):
        problems += [f"{' '.join(words)}: {p}" for p in _check(words, made)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_bare_commands_come_with_the_venv_activation(page: Path) -> None:
    text = page.read_text()
    # Not bare: pip (needs no torch), and a block that sets PYTHONPATH itself (docs/gpu.md's
    # commands for a lent GPU machine, which has its own Python and torch).
    bare = [
        " ".join(words)
        for words, block in commands(text)
        if block is not None
        and words[0] in ("python", "python3", "torchturbo", "torchrun")
        and words[1:3] != ["-m", "pip"]
        and "PYTHONPATH=" not in block
    ]
    assert not bare or _ACTIVATE in text, f"{page.name} runs {bare[:3]} without saying {_ACTIVATE}"


def test_the_checker_catches_what_it_is_for() -> None:
    """Negative controls: each kind of stale command is reported."""
    page = """```bash
torchturbo tune --workload text --memory-budget 2GiB --no-such-flag
torchturbo benchmark --workload text
torchrun --nproc-per-node 2 -m torchturbo bench --config ddp_fp16.toml
python benchmarks/techniques.py --no-such-option
make no-such-target
frobnicate --now
```"""
    problems = [p for words, _ in commands(page) for p in _check(words, set())]
    for expected in (
        "torchturbo tune has no option --no-such-flag",
        "torchturbo has no command 'benchmark'",
        "--config ddp_fp16.toml: no earlier command on the page makes it",
        "benchmarks/techniques.py parses no --no-such-option",
        "make has no target 'no-such-target'",
        "unknown program 'frobnicate'",
    ):
        assert expected in problems
    assert len(problems) == 6
    made_first = "```bash\nprintf 'x' > ddp_fp16.toml\ntorchturbo bench --config ddp_fp16.toml\n```"
    made: set[str] = set()
    assert [p for words, _ in commands(made_first) for p in _check(words, made)] == []


# --- the two READMEs ---------------------------------------------------------------------

# A figure: a number with the unit that makes it a measurement. Chinese writes 倍 for x.
_FIGURE = re.compile(r"(?<![\w.])(\d[\d,]*(?:\.\d+)?)\s?(x|倍|%|MiB|GiB|KiB|MB|GB|ms)(?!\w)")


def _sections(path: Path) -> list[tuple[str, str]]:
    """(heading, body) per ``## `` section, the text before the first one included."""
    parts = re.split(r"^## (.+)$", path.read_text(), flags=re.M)
    return [("", parts[0]), *zip(parts[1::2], parts[2::2], strict=True)]


def figures(text: str) -> Counter[str]:
    unit = {"倍": "x"}
    return Counter(f"{n.replace(',', '')}{unit.get(u, u)}" for n, u in _FIGURE.findall(text))


def test_the_readmes_have_the_same_sections_and_quote_the_same_figures() -> None:
    english, chinese = _sections(ROOT / "README.md"), _sections(ROOT / "README.zh-CN.md")
    assert len(english) == len(chinese), (
        [h for h, _ in english],
        [h for h, _ in chinese],
    )
    for (heading, en), (zh_heading, zh) in zip(english, chinese, strict=True):
        assert figures(en) == figures(zh), f"section {heading!r} / {zh_heading!r}"
        assert figures(en) or heading in ("", "Layout") or "```" in en


def test_figures_are_read_in_both_languages() -> None:
    assert figures("bf16 2.06x on vision, −83% memory, 4.27 倍, 71.6% → 4.4%") == Counter(
        ["2.06x", "83%", "4.27x", "71.6%", "4.4%"]
    )


def test_negative_control_a_figure_replaced_by_words_is_seen() -> None:
    """What the Chinese README used to do: "已完成" (done) where English quotes 1.87x."""
    english = "bf16 2.06x on vision, 1.87x on segmentation"
    chinese = "已完成；本机 bf16 在 vision 上 2.06 倍"
    assert figures(english) - figures(chinese) == Counter(["1.87x"])
