"""Every config field is a command-line option, checked by the config's own rules, over --config
and --preset; `config show` prints the result with its sources; `config schema` describes the
file; bash and zsh complete the options."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from torchturbo.cli import full_parser, main
from torchturbo.cli.arguments import DEFAULT_PRESETS, Parser
from torchturbo.cli.parser import build_parser
from torchturbo.config import ConfigError, TurboConfig
from torchturbo.config.fields import config_fields
from torchturbo.config.options import DEST
from torchturbo.config.resolve import resolve

TINY = str(Path(__file__).parent / "recipes" / "tiny.py") + ":recipe"
SECTION_FIELDS = [field for field in config_fields() if field.section]


def _subcommand(*names: str) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = full_parser()
    for name in names:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


def _overrides(*argv: str) -> dict[str, object]:
    args = build_parser().parse_args(["config", "show", *argv])
    return {given.field.key: given.value for given in getattr(args, DEST)}


@pytest.mark.parametrize("command", [("bench",), ("train",), ("doctor",), ("config", "show")])
def test_every_field_is_an_option_of_every_command_that_takes_a_config(command):
    options = _subcommand(*command)._option_string_actions
    for field in SECTION_FIELDS:
        assert f"--{field.key}" in options
        assert (f"--no-{field.key}" in options) == (field.value_type is bool)
    assert "--precision.dtype" not in _subcommand("tune")._option_string_actions


def test_every_field_is_documented_and_its_choices_are_shown():
    help_text = " ".join(_subcommand("bench").format_help().split())
    for field in SECTION_FIELDS:
        assert field.doc, f"{field.key} has no #: comment in config.py"
    assert "--precision.dtype {fp32,tf32,bf16,fp16}" in help_text
    assert "--data.batches {rows,buckets,packed}" in help_text
    assert "--[no-]chunked_loss.enabled" in help_text
    assert "[--SECTION.FIELD VALUE ...]" in help_text


# Each option's text and what the file would hold for it.
READ_AS_IN_THE_FILE = [
    (["--precision.dtype", "bf16"], {"precision.dtype": "bf16"}),
    (["--compile.mode=max-autotune"], {"compile.mode": "max-autotune"}),
    (["--data.batches", "buckets"], {"data.batches": "buckets"}),
    (["--data.batches=packed"], {"data.batches": "packed"}),
    (["--no-data.non_blocking"], {"data.non_blocking": False}),
    # a flag also says which: --flag=true|false (yes/no, on/off, 1/0), and --no-flag=false
    (["--chunked_loss.enabled=true"], {"chunked_loss.enabled": True}),
    (["--chunked_loss.enabled=false"], {"chunked_loss.enabled": False}),
    (["--chunked_loss.enabled=Off"], {"chunked_loss.enabled": False}),
    (["--data.pin_memory=1"], {"data.pin_memory": True}),
    (["--no-data.non_blocking=false"], {"data.non_blocking": True}),
    (
        ["--checkpointing.mode", "selective", "--checkpointing.module_types", "Block, Layer"],
        {"checkpointing.mode": "selective", "checkpointing.module_types": ("Block", "Layer")},
    ),
    (["--data.num_workers", "2"], {"data.num_workers": 2}),
    (["--clipping.max_norm", "0.5"], {"clipping.max_norm": 0.5}),
    (["--clipping.max_norm", "none"], {"clipping.max_norm": None}),
    (["--clipping.norm_type", "inf"], {"clipping.norm_type": float("inf")}),
    # sizes in the file's unit, bytes, which a size with a unit also gives
    (["--reliability.memory_budget_bytes", "1000"], {"reliability.memory_budget_bytes": 1000}),
    (["--reliability.memory_budget_bytes", "64MiB"], {"reliability.memory_budget_bytes": 64 << 20}),
    (["--distributed.bucket_cap_mb", "12.5"], {"distributed.bucket_cap_mb": 12.5}),
]


@pytest.mark.parametrize(("argv", "expected"), READ_AS_IN_THE_FILE)
def test_values_are_read_as_the_file_reads_them(argv, expected):
    assert _overrides(*argv) == expected
    config = resolve(
        overrides=build_parser().parse_args(["config", "show", *argv]).config_overrides
    )
    for key, value in expected.items():
        section, name = key.split(".")
        assert getattr(getattr(config.config, section), name) == value


def _as_typed(value: object) -> str:
    """A field's value as a user types it after its option."""
    if value is None:
        return "none"
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)


@pytest.mark.parametrize("field", SECTION_FIELDS, ids=lambda f: f.key)
def test_every_option_given_its_default_reads_back_the_default(field):
    if field.value_type is bool and field.default is None:
        argv = [f"--{field.key}=none"]
    elif field.value_type is bool:
        argv = [f"--{field.key}" if field.default else f"--no-{field.key}"]
    else:
        argv = [f"--{field.key}", _as_typed(field.default)]
    given = build_parser().parse_args(["config", "show", *argv]).config_overrides
    resolved = resolve(overrides=given)
    assert resolved.config == TurboConfig()
    assert resolved.sources[field.key] == argv[0].split("=")[0]


@pytest.mark.parametrize(
    ("option", "value", "toml"),
    [
        ("--precision.dtype", "fp8", '[precision]\ndtype = "fp8"'),
        ("--accumulation.steps", "four", '[accumulation]\nsteps = "four"'),
        ("--accumulation.steps", "0", "[accumulation]\nsteps = 0"),
        ("--data.num_workers", "5000", "[data]\nnum_workers = 5000"),
        ("--clipping.max_norm", "nan", "[clipping]\nmax_norm = nan"),
        ("--data.persistent_workers", None, "[data]\npersistent_workers = true"),
    ],
)
def test_a_bad_value_gets_the_same_one_line_error_as_in_the_file(
    option, value, toml, capsys, tmp_path
):
    with pytest.raises(ConfigError) as from_file:
        TurboConfig.from_toml(toml)
    argv = ["config", "show", option] + ([value] if value is not None else [])
    assert main(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert err.strip() == f"torchturbo config show: error: {option}: {from_file.value}"


EXIT_USAGE = 2


@pytest.mark.parametrize(
    ("typo", "suggestion"),
    [
        ("--precision.dtyp", "--precision.dtype"),
        ("--precison.dtype", "--precision.dtype"),
        ("--compile.mod", "--compile.mode"),
        ("--data.num-workers", "--data.num_workers"),
    ],
)
def test_a_misspelt_option_exits_2_with_one_line_naming_it_and_the_closest(
    typo, suggestion, capsys
):
    assert main(["bench", TINY, "--steps", "2", typo, "bf16"]) == EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"unknown option {typo} (did you mean {suggestion}?)" in err


def test_a_flag_that_may_be_none_takes_none_true_or_false_but_never_the_next_word(tmp_path):
    path = tmp_path / "turbo.toml"
    path.write_text("[compile]\ndynamic = true\n")
    for argv, expected in [
        (["--compile.dynamic"], True),
        (["--no-compile.dynamic"], False),
        (["--compile.dynamic=false"], False),
        (["--config", str(path), "--compile.dynamic=none"], None),  # back to torch's choice
    ]:
        args = build_parser().parse_args(["config", "show", *argv])
        assert (
            resolve(config_file=args.config, overrides=args.config_overrides).config.compile.dynamic
            is expected
        )
    args = build_parser().parse_args(["bench", "--compile.dynamic", TINY])
    assert args.recipe == TINY and [o.value for o in args.config_overrides] == [True]


def test_a_flag_that_cannot_be_none_never_takes_the_next_word_either():
    args = build_parser().parse_args(["bench", "--chunked_loss.enabled", TINY])
    assert args.recipe == TINY and [o.value for o in args.config_overrides] == [True]


@pytest.mark.parametrize(("typed", "read"), [("true", True), ("false", False), ("no", False)])
def test_a_plain_flag_takes_true_and_false_too(typed, read):
    args = build_parser().parse_args(["train", TINY, "--steps", "2", f"--resume={typed}"])
    assert args.resume is read


def test_negative_control_argparse_alone_takes_a_misspelt_option_as_an_abbreviation():
    bench = _subcommand("bench")
    args, _ = super(Parser, bench).parse_known_args([TINY, "--precision.dtyp", "bf16"])
    assert [(o.field.key, o.value) for o in args.config_overrides] == [("precision.dtype", "bf16")]


def test_precedence_is_options_then_file_then_preset_then_defaults(tmp_path):
    path = tmp_path / "turbo.toml"
    path.write_text('[precision]\ndtype = "fp32"\n[compile]\nmode = "default"\n')
    argv = ["--preset", "fast", "--config", str(path), "--compile.mode", "max-autotune"]
    args = build_parser().parse_args(["config", "show", *argv, "--device", "cpu"])
    resolved = resolve(
        preset=args.preset,
        config_file=args.config,
        overrides=args.config_overrides,
        device=args.device,
    )
    config, sources = resolved.config, resolved.sources
    assert config.compile.mode == "max-autotune" and sources["compile.mode"] == "--compile.mode"
    assert config.precision.dtype == "fp32" and sources["precision.dtype"] == str(path)
    assert config.memory_format.channels_last and sources["memory_format.channels_last"] == (
        "--preset fast"
    )
    assert config.data.num_workers == 0 and sources["data.num_workers"] == "default"
    assert config.device == "cpu" and sources["device"] == "--device"


def test_a_file_without_preset_goes_over_the_defaults_not_the_commands_preset(tmp_path, capsys):
    path = tmp_path / "turbo.toml"
    path.write_text("[data]\nnum_workers = 0\n")
    assert DEFAULT_PRESETS["bench"] == "fast"
    assert main(["config", "show", "bench", "--config", str(path)]) == 0
    assert TurboConfig.from_toml(capsys.readouterr().out).precision.dtype == "fp32"
    assert main(["config", "show", "bench"]) == 0
    assert TurboConfig.from_toml(capsys.readouterr().out).precision.dtype == "bf16"


def test_options_that_are_only_valid_together_are_checked_together():
    argv = ["--checkpointing.mode", "selective", "--checkpointing.every_n", "2"]
    args = build_parser().parse_args(["config", "show", *argv])
    config = resolve(overrides=args.config_overrides).config
    assert config.checkpointing.mode == "selective" and config.checkpointing.every_n == 2


def test_config_show_prints_toml_that_reads_back_as_the_config_with_each_source(tmp_path, capsys):
    path = tmp_path / "turbo.toml"
    path.write_text("[data]\nnum_workers = 2\npersistent_workers = true\n")
    argv = ["config", "show", "bench", "--config", str(path), "--precision.dtype", "bf16"]
    assert main([*argv, "--clipping.max_norm", "1.5"]) == 0
    text = capsys.readouterr().out
    expected = TurboConfig.from_toml(path.read_text()).replace(
        precision__dtype="bf16", clipping__max_norm=1.5
    )
    assert TurboConfig.from_toml(text) == expected
    lines = text.splitlines()
    assert 'dtype = "bf16"  # --precision.dtype' in lines
    assert f"num_workers = 2  # {path}" in lines
    assert "# prefetch_factor: not set  # default" in lines
    assert "max_norm = 1.5  # --clipping.max_norm" in lines


def test_bench_runs_the_config_an_option_chose(tmp_path, capsys):
    out = tmp_path / "rows.json"
    argv = ["bench", TINY, "--device", "cpu", "--steps", "2", "--json", str(out)]
    assert main([*argv, "--preset", "baseline", "--precision.dtype", "bf16"]) == 0
    rows = {row["variant"]: row for row in json.loads(out.read_text())["results"]}
    assert set(rows) == {"baseline", "baseline precision.dtype=bf16"}
    # the peak MFU is taken against is the row's number format's: a bf16 peak, or the fp32
    # one where bf16 is emulated, said so
    assert "bf16" in rows["baseline precision.dtype=bf16"]["mfu_peak"]
    assert "bf16" not in rows["baseline"]["mfu_peak"]


def test_the_schema_accepts_what_the_config_accepts_and_refuses_what_it_refuses(capsys):
    jsonschema = pytest.importorskip("jsonschema", reason="the test extras' jsonschema")
    assert main(["config", "schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    jsonschema.Draft7Validator.check_schema(schema)
    validator = jsonschema.Draft7Validator(schema)
    good = [
        TurboConfig().to_dict(),
        *(TurboConfig.preset(name).to_dict() for name in ("baseline", "fast")),
        {"device": "cuda:127", "clipping": {"max_norm": 1.0, "norm_type": float("inf")}},
        {"checkpointing": {"mode": "selective", "module_types": ["Block"]}},
    ]
    for data in good:
        TurboConfig.from_dict(data)
        assert not list(validator.iter_errors(data)), data
    bad = [
        {"precision": {"dtype": "fp8"}},
        {"precision": {"dtyp": "bf16"}},
        {"precison": {}},
        {"device": "cuda:128"},
        {"accumulation": {"steps": 0}},
        {"accumulation": {"steps": 1.5}},
        {"data": {"num_workers": 1025}},
        {"clipping": {"max_norm": 0}},
        {"distributed": {"bucket_cap_mb": 2**21}},
        {"checkpointing": {"module_types": "Block"}},
        {"reliability": {"auto_microbatch": "yes"}},
    ]
    for data in bad:
        with pytest.raises(ConfigError):
            TurboConfig.from_dict(data)
        assert list(validator.iter_errors(data)), data


def test_the_schema_documents_every_key():
    from torchturbo.config.schema import config_schema

    schema = config_schema()
    for field in config_fields():
        where = schema["properties"]
        node = where[field.section]["properties"][field.name] if field.section else where["device"]
        assert node["description"], field.key
        if field.choices:
            assert node["enum"] == list(field.choices)


def _completion(shell: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "torchturbo", "completion", shell],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return result.stdout


# complete_at WORD...: what bash offers for the last word, as `complete -F` would ask for it.
_BASH_COMPLETE = """
source "$1"
complete_at() {
  COMP_WORDS=("$@"); COMP_CWORD=$(($# - 1)); COMP_LINE="$*"; COMP_POINT=${#COMP_LINE}
  _shtab_torchturbo torchturbo "${COMP_WORDS[-1]}" "${COMP_WORDS[-2]}"
  echo "${COMPREPLY[*]}"
}
complete_at torchturbo bench --precision.dt
complete_at torchturbo train --precision.dtype ""
complete_at torchturbo config ""
"""


@pytest.mark.slow
def test_bash_completes_commands_config_options_and_their_choices(tmp_path):
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash on this machine")
    script = tmp_path / "torchturbo.bash"
    script.write_text(_completion("bash"))
    result = subprocess.run(
        [bash, "-c", _BASH_COMPLETE, "bash", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert result.stdout.splitlines() == ["--precision.dtype", "fp32 tf32 bf16 fp16", "show schema"]


@pytest.mark.slow
def test_zsh_loads_the_completion_with_the_config_options_and_their_choices(tmp_path):
    zsh = shutil.which("zsh")
    if zsh is None:
        pytest.skip("no zsh on this machine (apt-get install zsh)")
    script = tmp_path / "_torchturbo"
    script.write_text(_completion("zsh"))
    subprocess.run([zsh, "-n", str(script)], check=True, timeout=60)
    # Sourced after compinit, the script defines each command's _arguments specs (its last line,
    # a call that only a completion may make, fails outside one: that is expected).
    load = (
        'autoload -U compinit && compinit -u -D; source "$1"; '
        'print -l -- "${_shtab_torchturbo_bench_options[@]}"'
    )
    result = subprocess.run(
        [zsh, "-fc", load, "zsh", str(script)], capture_output=True, text=True, timeout=60
    )
    specs = result.stdout.splitlines()
    (dtype,) = [spec for spec in specs if spec.startswith("--precision.dtype[")]
    assert dtype.endswith(":(fp32 tf32 bf16 fp16)")
    assert any(spec.startswith("--no-chunked_loss.enabled") for spec in specs)
