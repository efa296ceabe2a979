"""TurboConfig: every knob torchturbo turns, its sections, presets and TOML round trip.

Checks that depend on the machine or the launch (fp16 on a CPU, a CUDA index, one process with a
``[distributed]`` section) are ``environment.check_environment``'s, run when a command loads a
config. The command line's ``--section.field`` options, ``config show`` and ``config schema`` are
generated from the sections (``fields.py``) and validated here too.
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

if sys.version_info >= (3, 11):
    pass
else:  # pragma: no cover - exercised only on Python 3.10
    pass

from torchturbo.config.io import parse_toml, read_table
from torchturbo.config.sections import (
    RENAMED,
    AccumulationConfig,
    ActivationCompressionConfig,
    BackendConfig,
    CheckpointConfig,
    ChunkedLossConfig,
    ClippingConfig,
    CompileConfig,
    DataConfig,
    DistributedConfig,
    LigerKernelConfig,
    MemoryFormatConfig,
    OptimizerConfig,
    PrecisionConfig,
    ReliabilityConfig,
    TuneConfig,
)
from torchturbo.config.validation import ConfigError, device_problem, did_you_mean, quote


@dataclass(frozen=True, kw_only=True)
class TurboConfig:
    """The whole configuration. Build it in code, from a preset, or from a TOML file."""

    #: "auto" (CUDA when available, else CPU), "cpu", "cuda" or "cuda:N"; another accelerator
    #: as torch names it ("mps", "xpu:N") where torch finds one.
    device: str = "auto"
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    memory_format: MemoryFormatConfig = field(default_factory=MemoryFormatConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    checkpointing: CheckpointConfig = field(default_factory=CheckpointConfig)
    accumulation: AccumulationConfig = field(default_factory=AccumulationConfig)
    clipping: ClippingConfig = field(default_factory=ClippingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reliability: ReliabilityConfig = field(default_factory=ReliabilityConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    chunked_loss: ChunkedLossConfig = field(default_factory=ChunkedLossConfig)
    activation_compression: ActivationCompressionConfig = field(
        default_factory=ActivationCompressionConfig
    )
    liger_kernel: LigerKernelConfig = field(default_factory=LigerKernelConfig)
    tune: TuneConfig = field(default_factory=TuneConfig)

    def __post_init__(self) -> None:
        problems = [] if (problem := device_problem(self.device)) is None else [problem]
        for name, section_type in _CORE_SECTIONS.items():
            if not isinstance(getattr(self, name), section_type):
                problems.append(f"[{name}] must be a {section_type.__name__}")
        if problems:
            raise ConfigError(*problems)

    def section(self, name: str) -> Any:
        """The section called ``name`` (``config.section("precision")`` is ``config.precision``),
        for code that reads a section by the name a technique declares."""
        if name not in _CORE_SECTIONS:
            raise AttributeError(f"no config section {name!r}; sections: {list(sections())}")
        return getattr(self, name)

    def replace(self, **sections: Any) -> TurboConfig:
        """A copy with whole sections or ``section__field`` values replaced.

        The fields of one section are replaced together, so that options which are only valid
        in combination (``mode = "selective"`` with ``every_n = 2``) validate as a whole.
        """
        updates: dict[str, Any] = {}
        fields: dict[str, dict[str, Any]] = {}
        for key, value in sections.items():
            if "__" in key:
                section_name, field_name = key.split("__", 1)
                fields.setdefault(section_name, {})[field_name] = value
            else:
                updates[key] = value
        for section_name, values in fields.items():
            base = updates.get(section_name, self.section(section_name))
            updates[section_name] = dataclasses.replace(base, **values)
        return dataclasses.replace(self, **updates)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict, TOML-ready: None values are omitted, tuples become lists."""
        out: dict[str, Any] = {"device": self.device}
        for name in sections():
            section = self.section(name)
            out[name] = {
                f.name: list(v) if isinstance(v, tuple) else v
                for f in dataclasses.fields(section)
                if (v := getattr(section, f.name)) is not None
            }
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, base: TurboConfig | None = None) -> TurboConfig:
        """Build and validate from a dict as read from TOML; every problem is reported at once.

        Keys left out keep ``base``'s values (the defaults without one): a file over a preset.
        Unknown sections and keys are errors (with the closest valid name when there is one).
        """
        base = cls() if base is None else base
        if not isinstance(data, dict):
            raise ConfigError(f"a config must be a table of sections, got {type(data).__name__}")
        problems = []
        known = sections()
        unknown = {str(key) for key in data} - set(known) - {"device"}
        if unknown:
            problems.append(
                f"unknown config section(s) {sorted(unknown)}"
                f"{did_you_mean(unknown, {'device', *known})}; "
                f"allowed: {['device', *known]}"
            )
        if "device" in data and (problem := device_problem(data["device"])) is not None:
            problems.append(problem)
        kwargs: dict[str, Any] = {"device": data.get("device", base.device)}
        for name in known:
            if name in data:
                try:
                    kwargs[name] = _section_from_dict(base.section(name), name, data[name])
                except ConfigError as err:
                    problems.extend(err.problems)
        if problems:
            raise ConfigError(*problems)
        return dataclasses.replace(base, **kwargs)

    def to_toml(self) -> str:
        return tomli_w.dumps(self.to_dict())

    @classmethod
    def from_toml(cls, text: str, *, base: TurboConfig | None = None) -> TurboConfig:
        """Parse and validate TOML text; keys left out keep ``base``'s values."""
        return cls.from_dict(parse_toml(text), base=base)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_toml())

    @classmethod
    def load(cls, path: str | Path, *, base: TurboConfig | None = None) -> TurboConfig:
        """Read a TOML file; every problem, of the file or of its values, names the file.
        Keys the file leaves out keep ``base``'s values (the defaults without one)."""
        path = Path(path)
        data = read_table(path)
        try:
            config = cls.from_dict(data, base=base)
        except ConfigError as err:
            raise ConfigError(*err.problems, where=str(path)) from err
        cache = config.compile.cache_dir
        if cache and not Path(cache).is_absolute():
            # Relative to the file: the cache tune wrote beside it, wherever it is run from.
            config = config.replace(compile__cache_dir=str(path.parent / cache))
        return config

    @classmethod
    def preset(cls, name: str) -> TurboConfig:
        """Named starting points: ``baseline`` (fp32 eager) and ``fast`` (bf16 + channels_last)."""
        try:
            return PRESETS[name]
        except KeyError:
            raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None


def _section_from_dict(base: Any, name: str, values: Any) -> Any:
    """Section ``name`` with the keys of ``values`` replaced in ``base``, validated."""
    if not isinstance(values, dict):
        raise ConfigError(f"[{name}] must be a table, got {quote(values)}")
    allowed = {f.name for f in dataclasses.fields(base)}
    renamed = [
        f"[{name}] {key} = {str(value).lower()} is now [{name}] {spelling}"
        for key, value in values.items()
        if isinstance(value, bool)
        and (spelling := RENAMED.get((name, str(key)), {}).get(value)) is not None
    ]
    if renamed:
        raise ConfigError(*renamed)
    unknown = {str(key) for key in values} - allowed
    if unknown:
        raise ConfigError(
            f"[{name}] unknown key(s) {sorted(unknown)}{did_you_mean(unknown, allowed)}; "
            f"allowed: {sorted(allowed)}"
        )
    converted = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    return dataclasses.replace(base, **converted)


#: The core sections, read from TurboConfig's own fields (each a section dataclass), in order.
_CORE_SECTIONS: dict[str, type] = {
    name: hint
    for name, hint in typing.get_type_hints(TurboConfig).items()
    if isinstance(hint, type) and dataclasses.is_dataclass(hint)
}


def sections() -> dict[str, type]:
    """Every config section by name, in the order of the file."""
    return dict(_CORE_SECTIONS)


PRESETS: dict[str, TurboConfig] = {
    "baseline": TurboConfig(),
    "fast": TurboConfig(
        precision=PrecisionConfig(dtype="bf16"),
        memory_format=MemoryFormatConfig(channels_last=True),
    ),
}
