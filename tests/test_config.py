"""TurboConfig: every invalid field is a clear error; TOML round-trips exactly."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import tomli_w
from hypothesis import given, settings
from hypothesis import strategies as st

from torchturbo.config import (
    CheckpointConfig,
    ConfigError,
    DataConfig,
    Environment,
    PrecisionConfig,
    TurboConfig,
    check_environment,
    sections,
)

INVALID = [
    ("[chunked_loss]\nchunk_tokens = 0", "[chunked_loss] chunk_tokens = 0"),
    ('[activation_compression]\ndtype = "int8"', "[activation_compression] dtype = 'int8'"),
    ('device = "tpu 0"', "device = 'tpu 0'"),
    ('device = "xpu:"', "or another accelerator's name as torch spells it"),
    ('device = "cuda:banana"', "device = 'cuda:banana' is invalid"),
    ('device = "cuda:128"', "with N from 0 to 127"),  # torch's int8 index: cuda:-128
    ('device = "cuda:01"', "device = 'cuda:01'"),
    ('device = "CUDA"', "device = 'CUDA'"),
    ("device = 3", "device = 3 is invalid"),
    ('[precision]\ndtype = "fp8"', "'fp32', 'tf32', 'bf16', 'fp16'"),
    ('[precision]\ndtype = "fp16"\ngrad_scaler = false', "underflow"),
    ('[precision]\ndtype = "bf16"\ngrad_scaler = true', "only fp16 needs a GradScaler"),
    ("[memory_format]\nchannels_last = 1", "channels_last = 1 is invalid: expected bool"),
    ('[backend]\ncudnn_benchmark = "yes"', "cudnn_benchmark"),
    ('[compile]\nmode = "fast"', "'reduce-overhead'"),
    ("[compile]\nfullgraph = 0", "fullgraph"),
    ('[checkpointing]\nmode = "some"', "'selective'"),
    ('[checkpointing]\nmode = "selective"', "needs blocks, module_types"),
    ('[checkpointing]\nmode = "full"\nname_pattern = "x"', "only used with mode = 'selective'"),
    ('[checkpointing]\nmode = "full"\nevery_n = 0', "every_n = 0"),
    ('[checkpointing]\nmode = "selective"\nmodule_types = [1]', "module_types"),
    ('[accumulation]\nsteps = "4"', "steps = '4' is invalid: expected int"),
    ("[accumulation]\nsteps = 0", "steps = 0"),
    ("[accumulation]\nsteps = 99999999999999999999", "<= 2**63 - 1 (torch's int64)"),
    ("[accumulation]\nsteps = 4.0", "steps = 4.0 is invalid: expected int"),
    ("[accumulation]\nsteps = true", "steps = True is invalid: expected int"),
    ("[clipping]\nmax_norm = -1.0", "max_norm = -1.0"),
    ("[clipping]\nmax_norm = nan", "max_norm = nan is invalid: expected a finite number > 0"),
    ("[clipping]\nmax_norm = inf", "max_norm = inf is invalid: expected a finite number > 0"),
    (
        "[clipping]\nnorm_type = -3.0",
        "norm_type = -3.0 is invalid: expected a finite number >= 1, or inf",
    ),
    ("[clipping]\nnorm_type = 0.5", "norm_type = 0.5"),
    ("[clipping]\nnorm_type = nan", "norm_type = nan"),
    ("[clipping]\nnorm_type = -inf", "norm_type = -inf"),
    ('[optimizer]\nimplementation = "apex"', "'as_built', 'foreach', 'fused'"),
    ('[optimizer]\nstate = "2bit"', "'as_built', 'bf16', '8bit', '4bit', 'fp8'"),
    ("[precision]\nfloat8 = 1", "float8 = 1 is invalid: expected bool"),
    ('[liger_kernel]\nenabled = "yes"', "enabled = 'yes' is invalid: expected bool"),
    ("[data]\nnum_workers = -1", "num_workers = -1"),
    ("[data]\nnum_workers = 100000", "<= 1024 (each worker is a process)"),
    ("[data]\npad_to_multiple = 1000000", "pad_to_multiple = 1000000"),
    ("[data]\nbatches = 'buckets'\nmax_tokens = 64\npad_to_multiple = 128", "would not fit"),
    ("[data]\npersistent_workers = true", "needs num_workers > 0"),
    ("[data]\nprefetch_factor = 2", "needs num_workers > 0"),
    ("[data]\nnum_workers = 2\nprefetch_factor = 0", "prefetch_factor = 0"),
    ("[data]\nmax_tokens = 4096", "only used with batches = 'buckets' or 'packed'"),
    ("[data]\nbatches = 'buckets'\nmax_tokens = 0", "max_tokens = 0"),
    ("[data]\nbucketing = true", "[data] bucketing = true is now [data] batches = 'buckets'"),
    ("[data]\npacking = false", "[data] packing = false is now [data] batches = 'rows'"),
    ('[data]\nbatches = "sorted"', "'rows', 'buckets', 'packed'"),
    ("[data]\npad_to_multiple = 0", "pad_to_multiple = 0"),
    ("[reliability]\nkeep_last = 0", "keep_last = 0"),
    ("[reliability]\nmemory_budget_bytes = 0", "memory_budget_bytes = 0"),
    ("[reliability]\nmemory_budget_bytes = 1e9", "expected int or nothing"),
    ("[tune]\nmeasure_share = 0.9", "measure_share = 0.9"),
    ('[tune]\nin_run = "yes"', "in_run"),
    ("[reliability]\nnonfinite_patience = -1", "nonfinite_patience = -1"),
    ('[reliability]\nauto_microbatch = "yes"', "auto_microbatch"),
    ('[distributed]\nstrategy = "zero"', "'ddp', 'fsdp'"),
    ('[distributed]\ncomm_hook = "int8"', "'powersgd_fp16'"),
    ("[distributed]\npowersgd_rank = 0", "powersgd_rank = 0"),
    ("[distributed]\npowersgd_warmup = 1", "powersgd_warmup = 1"),
    ("[distributed]\nbucket_cap_mb = 0", "bucket_cap_mb = 0"),
    ("[distributed]\nbucket_cap_mb = nan", "bucket_cap_mb = nan"),
    ("[distributed]\nbucket_cap_mb = inf", "bucket_cap_mb = inf"),
    ("[distributed]\nbucket_cap_mb = 1e300", "<= 1048576"),
    ('[distributed]\nstrategy = "fsdp"\ncomm_hook = "fp16"', "does not apply"),
    ("[distributed]\npipeline_microbatches = 0", "pipeline_microbatches = 0"),
    ("[precision]\ncolour = 1", "unknown key(s) ['colour']"),
    ('[precision]\ndtyp = "bf16"', "did you mean 'dtyp' -> 'dtype'?"),
    ("[precison]\ndtype = 1", "did you mean 'precison' -> 'precision'?"),
    ("[turbo]\nx = 1", "unknown config section(s) ['turbo']"),
    ("precision = 3", "[precision] must be a table"),
    ("[precision", "not valid TOML"),
]


@pytest.mark.parametrize(("text", "message"), INVALID)
def test_invalid_config_names_the_field_and_the_allowed_values(text, message):
    with pytest.raises(ConfigError) as caught:
        TurboConfig.from_toml(text)
    assert message in str(caught.value)


def test_every_section_field_has_a_negative_case():
    """Each section type has at least one invalid example above, so validation cannot rot."""
    names = {"device", *TurboConfig().to_dict()}
    covered = {line.split("\n")[0].strip("[]").split(" ")[0] for line, _ in INVALID}
    assert names <= covered


CONFIGS = [
    TurboConfig(),
    TurboConfig.preset("fast"),
    TurboConfig(
        device="cuda:1",
        precision=PrecisionConfig(dtype="fp16", grad_scaler=True),
        checkpointing=CheckpointConfig(
            mode="selective", module_types=("Block", "Layer"), name_pattern="enc.*", every_n=2
        ),
        data=DataConfig(num_workers=2, prefetch_factor=4, persistent_workers=True),
    ).replace(clipping__max_norm=1.5, accumulation__steps=8, compile__mode="max-autotune"),
    TurboConfig.preset("fast").replace(precision__float8=True, optimizer__implementation="fused"),
]


@pytest.mark.parametrize("config", CONFIGS)
def test_toml_round_trip_is_exact(config, tmp_path):
    path = tmp_path / "turbo.toml"
    config.save(path)
    assert TurboConfig.load(path) == config
    assert TurboConfig.from_toml(config.to_toml()).to_toml() == config.to_toml()


def test_partial_toml_fills_defaults():
    config = TurboConfig.from_toml('[precision]\ndtype = "bf16"')
    assert config == TurboConfig(precision=PrecisionConfig(dtype="bf16"))


def test_a_file_over_a_base_keeps_what_it_leaves_out_and_checks_the_whole(tmp_path):
    fast = TurboConfig.preset("fast")
    path = tmp_path / "turbo.toml"
    path.write_text("[data]\nnum_workers = 2\n[precision]\nfloat8 = true\n")
    config = TurboConfig.load(path, base=fast)
    assert config.precision == PrecisionConfig(dtype="bf16", float8=True)  # dtype: the base's
    assert config.memory_format == fast.memory_format and config.data.num_workers == 2
    assert TurboConfig.load(path).precision.dtype == "fp32"  # no base: the defaults
    # The merged section is validated: the base's fp16 with the file's grad_scaler = false.
    fp16 = TurboConfig().replace(precision__dtype="fp16")
    with pytest.raises(ConfigError, match="fp16 gradients underflow"):
        TurboConfig.from_toml("[precision]\ngrad_scaler = false", base=fp16)


def test_load_names_the_file_in_errors(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[accumulation]\nsteps = 0")
    with pytest.raises(ConfigError, match=r"bad\.toml"):
        TurboConfig.load(path)
    with pytest.raises(ConfigError, match="does not exist"):
        TurboConfig.load(tmp_path / "missing.toml")


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ConfigError, match=r"\['baseline', 'fast'\]"):
        TurboConfig.preset("turbo")


def test_sections_are_frozen():
    config = TurboConfig()
    with pytest.raises(AttributeError):
        config.precision.dtype = "bf16"  # type: ignore[misc]


def test_replace_validates_the_fields_of_a_section_together():
    """selective + every_n is valid together, though selective alone is not (the memory stage)."""
    config = TurboConfig().replace(checkpointing__mode="selective", checkpointing__every_n=2)
    assert config.checkpointing == CheckpointConfig(mode="selective", every_n=2)
    with pytest.raises(ConfigError, match="needs blocks, module_types"):
        TurboConfig().replace(checkpointing__mode="selective")


def test_every_problem_of_a_file_is_reported_at_once(tmp_path):
    path = tmp_path / "turbo.toml"
    path.write_text(
        'device = "cuda:banana"\n[precision]\ndtype = "fp8"\n[clipping]\nmax_norm = nan\n'
        "[data]\nnum_workers = 0\npersistent_workers = true\n[colours]\nx = 1\n"
    )
    with pytest.raises(ConfigError) as caught:
        TurboConfig.load(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: 5 problems: ") and "\n" not in message
    for part in ("'cuda:banana'", "'fp8'", "max_norm = nan", "persistent_workers", "'colours'"):
        assert part in message
    assert len(caught.value.problems) == 5


def test_a_section_with_a_wrong_type_skips_its_combination_checks():
    """persistent_workers needs num_workers > 0, but num_workers = "2" is the problem to fix."""
    with pytest.raises(ConfigError) as caught:
        TurboConfig.from_toml('[data]\nnum_workers = "2"\npersistent_workers = true')
    assert caught.value.problems == ("[data] num_workers = '2' is invalid: expected int",)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda tmp: tmp, "is a directory, not a file"),
        (lambda tmp: Path("/dev/null"), "is a character device, not a file"),
        (lambda tmp: tmp / "missing.toml", "does not exist"),
        (lambda tmp: _write(tmp / "x.toml", b"\x00\xd0\xcf\x11\xe0binary"), "is not UTF-8 text"),
        (lambda tmp: _write(tmp / "x.toml", b"#" * (2 << 20)), "bytes, not a config file"),
        (lambda tmp: _write(tmp / "x.toml", b""), "is empty, so it sets nothing"),
        (lambda tmp: _write(tmp / "x.toml", b"\n  \n"), "is empty, so it sets nothing"),
        (lambda tmp: _loop(tmp / "x.toml"), "is a loop of symbolic links"),
    ],
    ids=["directory", "device", "missing", "binary", "huge", "empty", "blank", "link loop"],
)
def test_a_path_that_is_not_a_config_file_is_named_and_said_what_it_is(tmp_path, make, message):
    path = make(tmp_path)
    with pytest.raises(ConfigError, match=message) as caught:
        TurboConfig.load(path)
    assert repr(str(path)) in str(caught.value)


def _loop(path: Path) -> Path:
    """``path`` a link to a link back to it."""
    other = path.with_name("other.toml")
    path.symlink_to(other)
    other.symlink_to(path)
    return path


def test_a_byte_order_mark_is_read_as_the_text_it_starts(tmp_path):
    path = _write(tmp_path / "bom.toml", "\ufeff[accumulation]\nsteps = 4\n".encode())
    assert TurboConfig.load(path).accumulation.steps == 4


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_an_unreadable_config_file_is_named(tmp_path):
    path = _write(tmp_path / "x.toml", b"[precision]\n")
    path.chmod(0)
    with pytest.raises(ConfigError, match=r"cannot read config file .*x\.toml.*Permission denied"):
        TurboConfig.load(path)


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_deep_nesting_is_a_config_error_not_a_recursion_error():
    with pytest.raises(ConfigError, match="too deeply"):
        TurboConfig.from_toml("x = " + "[" * 5000 + "]" * 5000)
    nested: dict = {}
    for _ in range(10_000):
        nested = {"a": nested}
    with pytest.raises(ConfigError, match=r"\[precision\] dtype = \{'a': \{'a': \{\.\.\.\}\}\}"):
        TurboConfig.from_dict({"precision": {"dtype": nested}})


# --- checks against the machine and the launch ------------------------------------------------

CPU_ONLY = Environment(cuda_devices=0, processes=1, cpu_fp16=False)


@pytest.mark.parametrize(
    ("config", "env", "errors", "warnings"),
    [
        (TurboConfig(), CPU_ONLY, [], []),  # negative control: the defaults pass anywhere
        (TurboConfig(device="cuda"), CPU_ONLY, ["needs CUDA"], []),
        # Another accelerator is a name torch knows; whether it is here, the environment says.
        (TurboConfig(device="tpu"), CPU_ONLY, ["torch finds no tpu device here"], []),
        (
            TurboConfig(device="xpu:1"),
            Environment(cuda_devices=0, other_devices={"xpu": 1}, processes=1, cpu_fp16=False),
            ["xpu:0 to xpu:0"],
            [],
        ),
        (
            TurboConfig(device="xpu"),
            Environment(cuda_devices=0, other_devices={"xpu": 1}, processes=1, cpu_fp16=False),
            [],
            [],
        ),
        (
            TurboConfig(device="cuda:3"),
            Environment(cuda_devices=2, processes=1, cpu_fp16=False),
            ["cuda:0 to cuda:1"],
            [],
        ),
        (
            TurboConfig(device="cuda:1"),
            Environment(cuda_devices=2, processes=1, cpu_fp16=False),
            [],
            [],
        ),
        (TurboConfig().replace(precision__dtype="fp16"), CPU_ONLY, [], ["runs emulated"]),
        (
            TurboConfig().replace(precision__dtype="fp16"),
            Environment(cuda_devices=0, processes=1, cpu_fp16=True),
            [],
            [],
        ),
        (
            TurboConfig(device="cuda").replace(precision__dtype="fp16"),
            Environment(cuda_devices=1, processes=1, cpu_fp16=False),
            [],
            [],
        ),
        (
            TurboConfig().replace(compile__mode="reduce-overhead", checkpointing__mode="full"),
            CPU_ONLY,
            [],
            [],
        ),
        (
            TurboConfig().replace(distributed__strategy="fsdp"),
            CPU_ONLY,
            [],
            ["[distributed] strategy take(s) effect only under torchrun"],
        ),
        (
            TurboConfig().replace(distributed__strategy="fsdp"),
            Environment(cuda_devices=0, processes=2, cpu_fp16=False),
            [],
            [],
        ),
    ],
)
def test_checks_against_the_environment(config, env, errors, warnings):
    found_errors, found_warnings = check_environment(config, env)
    assert len(found_errors) == len(errors) and len(found_warnings) == len(warnings)
    for expected, found in zip(errors + warnings, found_errors + found_warnings, strict=True):
        assert expected in found


def test_a_contradictory_config_reports_every_problem():
    config = TurboConfig(device="cuda:1").replace(
        precision__dtype="fp16", distributed__strategy="fsdp"
    )
    errors, warnings = check_environment(
        config, Environment(cuda_devices=1, processes=1, cpu_fp16=False)
    )
    assert len(errors) == 1 and "cuda:0 to cuda:0" in errors[0]
    assert len(warnings) == 1 and "only under torchrun" in warnings[0]
    errors, warnings = check_environment(config.replace(device="cpu"), CPU_ONLY)
    assert not errors and len(warnings) == 2


# --- property: any dict or TOML text is a valid config or a ConfigError -----------------------

_NAMES = {name: [f.name for f in dataclasses.fields(t)] for name, t in sections().items()}
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(-(2**80), 2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["fp16", "bf16", "full", "selective", "fsdp", "powersgd", "cuda:0", "cpu"]),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=12,
)
_sections = st.one_of(
    *(
        st.dictionaries(st.sampled_from(fields) | st.text(max_size=8), _values, max_size=4)
        for fields in _NAMES.values()
    )
)
_configs = st.dictionaries(
    st.sampled_from(["device", *_NAMES]) | st.text(max_size=8), _sections | _values, max_size=5
)


def _toml_or_text(data: dict) -> str:
    """``data`` as TOML, or as its repr where TOML cannot hold it (None, mixed arrays)."""
    try:
        return tomli_w.dumps(data)
    except (TypeError, ValueError):
        return repr(data)


@settings(max_examples=150, deadline=None, database=None)
@given(_configs)
def test_any_dict_is_a_valid_config_or_a_config_error(data):
    try:
        config = TurboConfig.from_dict(data)
    except ConfigError as err:
        assert err.problems and "\n" not in str(err)
    else:
        assert TurboConfig.from_toml(config.to_toml()) == config


@settings(max_examples=100, deadline=None, database=None)
@given(st.one_of(st.text(max_size=200), _configs.map(_toml_or_text)))
def test_any_toml_text_is_a_valid_config_or_a_config_error(text):
    try:
        config = TurboConfig.from_toml(text)
    except ConfigError as err:
        assert err.problems
    else:
        assert TurboConfig.from_toml(config.to_toml()) == config


def test_a_compile_cache_folder_is_relative_to_the_file_that_names_it(tmp_path):
    (tmp_path / "run").mkdir()
    path = tmp_path / "run" / "turbo.toml"
    TurboConfig().replace(compile__mode="default", compile__cache_dir="compile-cache").save(path)
    assert TurboConfig.load(path).compile.cache_dir == str(tmp_path / "run" / "compile-cache")
    absolute = str(tmp_path / "elsewhere")
    TurboConfig().replace(compile__cache_dir=absolute).save(path)
    assert TurboConfig.load(path).compile.cache_dir == absolute
