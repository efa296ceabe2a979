"""TurboConfig: every invalid field is a clear error; TOML round-trips exactly."""

from __future__ import annotations

import pytest

from torchturbo.config import (
    CheckpointConfig,
    ConfigError,
    DataConfig,
    PrecisionConfig,
    TurboConfig,
)

INVALID = [
    ('device = "tpu"', "device = 'tpu'"),
    ('[precision]\ndtype = "fp8"', "'fp32', 'tf32', 'bf16', 'fp16'"),
    ('[precision]\ndtype = "fp16"\ngrad_scaler = false', "underflow"),
    ('[precision]\ndtype = "bf16"\ngrad_scaler = true', "only fp16 needs a GradScaler"),
    ("[memory_format]\nchannels_last = 1", "channels_last = 1 is invalid: expected bool"),
    ('[backend]\ncudnn_benchmark = "yes"', "cudnn_benchmark"),
    ('[compile]\nmode = "fast"', "'reduce-overhead'"),
    ("[compile]\nfullgraph = 0", "fullgraph"),
    ('[checkpointing]\nmode = "some"', "'selective'"),
    ('[checkpointing]\nmode = "selective"', "needs module_types"),
    ('[checkpointing]\nmode = "full"\nname_pattern = "x"', "only used with mode = 'selective'"),
    ('[checkpointing]\nmode = "full"\nevery_n = 0', "every_n = 0"),
    ('[checkpointing]\nmode = "selective"\nmodule_types = [1]', "module_types"),
    ('[accumulation]\nsteps = "4"', "steps = '4' is invalid: expected int"),
    ("[accumulation]\nsteps = 0", "steps = 0"),
    ("[clipping]\nmax_norm = -1.0", "max_norm = -1.0"),
    ('[optimizer]\nimplementation = "apex"', "'as_built', 'foreach', 'fused'"),
    ("[precision]\nfloat8 = 1", "float8 = 1 is invalid: expected bool"),
    ("[data]\nnum_workers = -1", "num_workers = -1"),
    ("[data]\npersistent_workers = true", "needs num_workers > 0"),
    ("[data]\nprefetch_factor = 2", "needs num_workers > 0"),
    ("[data]\nnum_workers = 2\nprefetch_factor = 0", "prefetch_factor = 0"),
    ("[data]\nmax_tokens = 4096", "only used with bucketing = true"),
    ("[data]\nbucketing = true\nmax_tokens = 0", "max_tokens = 0"),
    ("[data]\npad_to_multiple = 0", "pad_to_multiple = 0"),
    ("[reliability]\nkeep_last = 0", "keep_last = 0"),
    ("[reliability]\nmemory_budget_bytes = 0", "memory_budget_bytes = 0"),
    ("[reliability]\nnonfinite_patience = -1", "nonfinite_patience = -1"),
    ('[reliability]\nauto_microbatch = "yes"', "auto_microbatch"),
    ('[distributed]\nstrategy = "zero"', "'ddp', 'fsdp'"),
    ('[distributed]\ncomm_hook = "int8"', "'powersgd_fp16'"),
    ("[distributed]\npowersgd_rank = 0", "powersgd_rank = 0"),
    ("[distributed]\npowersgd_warmup = 1", "powersgd_warmup = 1"),
    ("[distributed]\nbucket_cap_mb = 0", "bucket_cap_mb = 0"),
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
    sections = {"device", *TurboConfig().to_dict()}
    covered = {line.split("\n")[0].strip("[]").split(" ")[0] for line, _ in INVALID}
    assert sections <= covered


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
    with pytest.raises(ConfigError, match="needs module_types"):
        TurboConfig().replace(checkpointing__mode="selective")
