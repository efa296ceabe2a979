"""TurboConfig: every knob torchturbo turns, one frozen section per concern, with TOML I/O.

Each section validates itself in ``__post_init__`` and raises :class:`ConfigError` naming the
field, the bad value and what is allowed. Field types are checked from the annotations, so a TOML
file with ``steps = "4"`` fails with a message, not deep inside the engine.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import tomli_w

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib


class ConfigError(ValueError):
    """An invalid configuration value; the message names the field and the allowed values."""


Precision = Literal["fp32", "tf32", "bf16", "fp16"]
CompileMode = Literal[
    "off", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"
]
CheckpointMode = Literal["off", "full", "selective"]
DistStrategy = Literal["ddp", "fsdp"]
CommHookName = Literal["none", "fp16", "bf16", "powersgd", "powersgd_fp16", "powersgd_bf16"]
ParamDtype = Literal["fp32", "bf16", "fp16"]
OptimizerImplementation = Literal["as_built", "foreach", "fused"]
PipelineSchedule = Literal["gpipe", "1f1b"]


def _check_types(section: Any) -> None:
    """Check every field of a section against its annotation (Literal, bool, int, float, ...)."""
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        expected = hints[f.name]
        if not _matches(value, expected):
            raise ConfigError(
                f"[{section.SECTION}] {f.name} = {value!r} is invalid: "
                f"expected {_describe(expected)}"
            )


def _matches(value: Any, expected: Any) -> bool:
    origin = get_origin(expected)
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in get_args(expected))
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in get_args(expected))
    if origin is tuple:
        (item_type, _ellipsis) = get_args(expected)
        return isinstance(value, tuple) and all(_matches(v, item_type) for v in value)
    if expected is type(None):
        return value is None
    if expected is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, expected)


def _describe(expected: Any) -> str:
    origin = get_origin(expected)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(expected))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(expected))
    if origin is tuple:
        return f"a list of {_describe(get_args(expected)[0])}"
    if expected is type(None):
        return "nothing (omit the key)"
    return expected.__name__


@dataclass(frozen=True, kw_only=True)
class PrecisionConfig:
    """Numeric precision of forward and backward."""

    SECTION: typing.ClassVar[str] = "precision"
    #: fp32: plain float32. tf32: float32 storage, TensorFloat-32 matmuls/convs (CUDA Ampere+;
    #: on CPU it sets float32 matmul precision to "high"). bf16/fp16: autocast to that dtype.
    dtype: Precision = "fp32"
    #: GradScaler for fp16 (required there: fp16 gradients underflow without it). None = as needed.
    grad_scaler: bool | None = None
    #: float8 training: nn.Linear layers become torchao Float8Linear (fp8 matmuls, dynamic
    #: scaling), on top of ``dtype``. Needs CUDA compute capability >= 8.9 and torchao
    #: (techniques/float8.py); elsewhere it is not applied and the reason is reported.
    float8: bool = False

    def __post_init__(self) -> None:
        _check_types(self)
        if self.dtype == "fp16" and self.grad_scaler is False:
            raise ConfigError(
                "[precision] dtype = 'fp16' with grad_scaler = false is invalid: fp16 gradients "
                "underflow without loss scaling; remove grad_scaler or use dtype = 'bf16'"
            )
        if self.dtype != "fp16" and self.grad_scaler:
            raise ConfigError(
                f"[precision] grad_scaler = true with dtype = {self.dtype!r} is invalid: only fp16 "
                "needs a GradScaler (bf16 has fp32's exponent range); remove grad_scaler"
            )

    @property
    def uses_scaler(self) -> bool:
        return self.dtype == "fp16"


@dataclass(frozen=True, kw_only=True)
class MemoryFormatConfig:
    """Tensor layout of 4-D activations and weights."""

    SECTION: typing.ClassVar[str] = "memory_format"
    #: NHWC layout for convolution models: faster convs with bf16/fp16 on CPU (oneDNN) and
    #: TensorCores. A model without 4-D convolutions is left alone, with the reason recorded.
    channels_last: bool = False

    def __post_init__(self) -> None:
        _check_types(self)


@dataclass(frozen=True, kw_only=True)
class BackendConfig:
    """Backend switches that are global to the process."""

    SECTION: typing.ClassVar[str] = "backend"
    #: cuDNN autotuning per input shape. Helps fixed shapes; hurts when shapes vary every step.
    cudnn_benchmark: bool = False

    def __post_init__(self) -> None:
        _check_types(self)


@dataclass(frozen=True, kw_only=True)
class CompileConfig:
    """torch.compile of the model."""

    SECTION: typing.ClassVar[str] = "compile"
    #: "off", or a torch.compile mode.
    mode: CompileMode = "off"
    #: Fail instead of falling back to eager on graph breaks.
    fullgraph: bool = False
    #: Dynamic shapes: None lets torch decide (it marks dims dynamic after a recompile).
    dynamic: bool | None = None

    def __post_init__(self) -> None:
        _check_types(self)


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Activation checkpointing: trade recomputation in backward for activation memory."""

    SECTION: typing.ClassVar[str] = "checkpointing"
    #: off; full: every block (see techniques/checkpointing.py for what a block is); selective:
    #: blocks chosen by module_types / name_pattern, thinned by every_n.
    mode: CheckpointMode = "off"
    #: Class names of modules to checkpoint, e.g. ["TransformerEncoderLayer"] (selective only).
    module_types: tuple[str, ...] = ()
    #: fnmatch pattern on qualified module names, e.g. "encoder.layers.*" (selective only).
    name_pattern: str = ""
    #: Checkpoint every n-th of the chosen blocks (1 = all of them).
    every_n: int = 1

    def __post_init__(self) -> None:
        _check_types(self)
        if self.every_n < 1:
            raise ConfigError(
                f"[checkpointing] every_n = {self.every_n} is invalid: expected an int >= 1"
            )
        chooses_nothing = not (self.module_types or self.name_pattern) and self.every_n == 1
        if self.mode == "selective" and chooses_nothing:
            raise ConfigError(
                "[checkpointing] mode = 'selective' needs module_types, name_pattern or "
                "every_n > 1 to choose blocks; use mode = 'full' to checkpoint all blocks"
            )
        if self.mode != "selective" and (self.module_types or self.name_pattern):
            raise ConfigError(
                f"[checkpointing] module_types/name_pattern are only used with mode = "
                f"'selective', but mode = {self.mode!r}"
            )


@dataclass(frozen=True, kw_only=True)
class AccumulationConfig:
    """Gradient accumulation over micro-batches."""

    SECTION: typing.ClassVar[str] = "accumulation"
    #: Micro-batches per optimizer step. Gradients are normalized by the total sample or token
    #: count of the window, so micro-batches of different sizes give the full-batch gradient.
    steps: int = 1

    def __post_init__(self) -> None:
        _check_types(self)
        if self.steps < 1:
            raise ConfigError(f"[accumulation] steps = {self.steps} is invalid: expected >= 1")


@dataclass(frozen=True, kw_only=True)
class ClippingConfig:
    """Gradient norm clipping (applied to unscaled gradients)."""

    SECTION: typing.ClassVar[str] = "clipping"
    #: Clip the total gradient norm to this value; None = no clipping.
    max_norm: float | None = None
    #: The p of the p-norm.
    norm_type: float = 2.0

    def __post_init__(self) -> None:
        _check_types(self)
        if self.max_norm is not None and self.max_norm <= 0:
            raise ConfigError(
                f"[clipping] max_norm = {self.max_norm} is invalid: expected a positive number "
                "or no key at all for no clipping"
            )


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """How the optimizer step runs (techniques/optimizer.py)."""

    SECTION: typing.ClassVar[str] = "optimizer"
    #: as_built: the user's optimizer untouched. foreach: one multi-tensor kernel per operation
    #: across all parameters. fused: the whole update in one kernel. The optimizer is rebuilt
    #: with the flag (same state and hyper-parameters) where its class accepts it; where not,
    #: it is left as built and the reason reported.
    implementation: OptimizerImplementation = "as_built"

    def __post_init__(self) -> None:
        _check_types(self)


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """DataLoader settings (used when Turbo.setup builds the loader from a dataset)."""

    SECTION: typing.ClassVar[str] = "data"
    num_workers: int = 0
    #: Page-locked host memory for faster, asynchronous host-to-device copies (CUDA only).
    pin_memory: bool = False
    #: Keep workers alive between epochs. Needs num_workers > 0.
    persistent_workers: bool = False
    #: Batches prefetched per worker. Needs num_workers > 0; None = torch's default (2).
    prefetch_factor: int | None = None
    #: Host-to-device copies with non_blocking=True (asynchronous only from pinned memory).
    non_blocking: bool = True
    #: Length-bucketed batches (data/bucketing.py); needs per-sample lengths from the recipe.
    bucketing: bool = False
    #: Token budget per bucketed batch, padding included; None = the recipe's batch size times
    #: its mean length, so that bucketing changes padding, not the amount of work per step.
    max_tokens: int | None = None
    #: Pad sequence lengths up to a multiple of this (8 suits tensor cores).
    pad_to_multiple: int = 1

    def __post_init__(self) -> None:
        _check_types(self)
        if self.num_workers < 0:
            raise ConfigError(f"[data] num_workers = {self.num_workers} is invalid: expected >= 0")
        if self.num_workers == 0 and self.persistent_workers:
            raise ConfigError(
                "[data] persistent_workers = true needs num_workers > 0 (there are no workers "
                "to keep alive); set num_workers or remove persistent_workers"
            )
        if self.num_workers == 0 and self.prefetch_factor is not None:
            raise ConfigError(
                f"[data] prefetch_factor = {self.prefetch_factor} needs num_workers > 0 "
                "(the main process does not prefetch); set num_workers or remove prefetch_factor"
            )
        if self.max_tokens is not None and not self.bucketing:
            raise ConfigError(
                f"[data] max_tokens = {self.max_tokens} is only used with bucketing = true"
            )
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ConfigError(f"[data] max_tokens = {self.max_tokens} is invalid: expected >= 1")
        if self.pad_to_multiple < 1:
            raise ConfigError(
                f"[data] pad_to_multiple = {self.pad_to_multiple} is invalid: expected >= 1"
            )
        if self.prefetch_factor is not None and self.prefetch_factor < 1:
            raise ConfigError(
                f"[data] prefetch_factor = {self.prefetch_factor} is invalid: expected >= 1"
            )


@dataclass(frozen=True, kw_only=True)
class ReliabilityConfig:
    """Checkpoints, automatic micro-batching on out-of-memory, and the non-finite guard."""

    SECTION: typing.ClassVar[str] = "reliability"
    #: Checkpoints kept by Turbo.save; older ones are deleted once a new one is complete.
    keep_last: int = 3
    #: Halve the micro-batch and retry the step when it runs out of memory (CUDA OOM, or the
    #: budget below). False: the out-of-memory error propagates.
    auto_microbatch: bool = True
    #: Activation budget in bytes: the tensors a micro-batch keeps for backward (parameters
    #: excluded). Exceeding it counts as out of memory, on any device. None = no budget.
    memory_budget_bytes: int | None = None
    #: Raise after this many consecutive optimizer steps with a non-finite loss or gradient
    #: (fp16 overflow that the GradScaler skips does not count). 0 = never.
    nonfinite_patience: int = 3

    def __post_init__(self) -> None:
        _check_types(self)
        if self.keep_last < 1:
            raise ConfigError(
                f"[reliability] keep_last = {self.keep_last} is invalid: expected an int >= 1"
            )
        if self.memory_budget_bytes is not None and self.memory_budget_bytes < 1:
            raise ConfigError(
                f"[reliability] memory_budget_bytes = {self.memory_budget_bytes} is invalid: "
                "expected a positive int, or no key at all for no budget"
            )
        if self.nonfinite_patience < 0:
            raise ConfigError(
                f"[reliability] nonfinite_patience = {self.nonfinite_patience} is invalid: "
                "expected an int >= 0 (0 turns the guard off)"
            )


@dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """Multi-process training under torchrun (see torchturbo/distributed/). Ignored with one
    process."""

    SECTION: typing.ClassVar[str] = "distributed"
    #: ddp: a replica per process, gradients all-reduced; fsdp: parameters, gradients and
    #: optimizer state sharded across processes (FSDP2 ``fully_shard``).
    strategy: DistStrategy = "ddp"
    #: DDP gradient communication: none (fp32 all-reduce), fp16/bf16 (compressed casts; bf16
    #: needs NCCL), powersgd (low-rank), powersgd_fp16/powersgd_bf16 (low-rank, then cast).
    comm_hook: CommHookName = "none"
    #: PowerSGD matrix rank: bytes sent per (n x m) gradient are about rank x (n + m).
    powersgd_rank: int = 4
    #: Plain all-reduce for this many steps before PowerSGD starts (torch needs >= 2).
    powersgd_warmup: int = 10
    #: DDP bucket size in MiB: larger buckets, fewer and larger all-reduces.
    bucket_cap_mb: float = 25.0
    #: Gradients are views into DDP's buckets: saves one copy and the memory of the gradients.
    gradient_as_bucket_view: bool = False
    #: The set of used parameters never changes between steps: DDP may skip re-checking it.
    static_graph: bool = False
    #: FSDP mixed precision: dtype of the unsharded parameters in forward/backward.
    fsdp_param_dtype: ParamDtype = "fp32"
    #: FSDP mixed precision: dtype in which gradients are reduce-scattered.
    fsdp_reduce_dtype: ParamDtype = "fp32"
    #: Pipeline parallelism (distributed/pipeline.py): schedule and micro-batches per batch.
    pipeline_schedule: PipelineSchedule = "1f1b"
    pipeline_microbatches: int = 4

    def __post_init__(self) -> None:
        _check_types(self)
        for name in ("powersgd_rank", "pipeline_microbatches"):
            if getattr(self, name) < 1:
                raise ConfigError(
                    f"[distributed] {name} = {getattr(self, name)} is invalid: expected >= 1"
                )
        if self.powersgd_warmup < 2:
            raise ConfigError(
                f"[distributed] powersgd_warmup = {self.powersgd_warmup} is invalid: expected "
                ">= 2 (torch's PowerSGD needs plain all-reduce steps to start error feedback)"
            )
        if self.bucket_cap_mb <= 0:
            raise ConfigError(
                f"[distributed] bucket_cap_mb = {self.bucket_cap_mb} is invalid: expected > 0"
            )
        if self.strategy == "fsdp" and self.comm_hook != "none":
            raise ConfigError(
                f"[distributed] comm_hook = {self.comm_hook!r} is a DDP hook and does not apply "
                "to strategy = 'fsdp'; use fsdp_reduce_dtype to reduce in lower precision"
            )


@dataclass(frozen=True, kw_only=True)
class TurboConfig:
    """The whole configuration. Build it in code, from a preset, or from a TOML file."""

    #: "auto" (CUDA when available, else CPU), "cpu", "cuda" or "cuda:N".
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

    def __post_init__(self) -> None:
        if not isinstance(self.device, str) or not (
            self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")
        ):
            raise ConfigError(
                f"device = {self.device!r} is invalid: expected 'auto', 'cpu', 'cuda' or 'cuda:N'"
            )
        for name, section_type in _SECTIONS.items():
            if not isinstance(getattr(self, name), section_type):
                raise ConfigError(f"[{name}] must be a {section_type.__name__}")

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
            base = updates.get(section_name, getattr(self, section_name))
            updates[section_name] = dataclasses.replace(base, **values)
        return dataclasses.replace(self, **updates)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict, TOML-ready: None values are omitted, tuples become lists."""
        out: dict[str, Any] = {"device": self.device}
        for name in _SECTIONS:
            section = getattr(self, name)
            out[name] = {
                f.name: list(v) if isinstance(v, tuple) else v
                for f in dataclasses.fields(section)
                if (v := getattr(section, f.name)) is not None
            }
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TurboConfig:
        """Build and validate from a dict as read from TOML; unknown keys are errors."""
        if not isinstance(data, dict):
            raise ConfigError(f"a config must be a table of sections, got {type(data).__name__}")
        unknown = set(data) - set(_SECTIONS) - {"device"}
        if unknown:
            raise ConfigError(
                f"unknown config section(s) {sorted(unknown)}"
                f"{_did_you_mean(unknown, {'device', *_SECTIONS})}; "
                f"allowed: {['device', *_SECTIONS]}"
            )
        kwargs: dict[str, Any] = {}
        if "device" in data:
            kwargs["device"] = data["device"]
        for name, section_type in _SECTIONS.items():
            if name in data:
                kwargs[name] = _section_from_dict(section_type, name, data[name])
        return cls(**kwargs)

    def to_toml(self) -> str:
        return tomli_w.dumps(self.to_dict())

    @classmethod
    def from_toml(cls, text: str) -> TurboConfig:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"config is not valid TOML: {err}") from err
        return cls.from_dict(data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_toml())

    @classmethod
    def load(cls, path: str | Path) -> TurboConfig:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            return cls.from_toml(path.read_text())
        except ConfigError as err:
            raise ConfigError(f"{path}: {err}") from err

    @classmethod
    def preset(cls, name: str) -> TurboConfig:
        """Named starting points: ``baseline`` (fp32 eager) and ``fast`` (bf16 + channels_last)."""
        try:
            return PRESETS[name]
        except KeyError:
            raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None


def _did_you_mean(unknown: set[str], allowed: set[str]) -> str:
    """' (did you mean 'dtype'?)' for the closest valid names of typo'd keys, else ''."""
    guesses = [
        f"{key!r} -> {match[0]!r}"
        for key in sorted(unknown)
        if (match := difflib.get_close_matches(key, sorted(allowed), n=1))
    ]
    return f" (did you mean {', '.join(guesses)}?)" if guesses else ""


def _section_from_dict(section_type: type, name: str, values: Any) -> Any:
    if not isinstance(values, dict):
        raise ConfigError(f"[{name}] must be a table, got {values!r}")
    allowed = {f.name for f in dataclasses.fields(section_type)}
    unknown = set(values) - allowed
    if unknown:
        raise ConfigError(
            f"[{name}] unknown key(s) {sorted(unknown)}{_did_you_mean(unknown, allowed)}; "
            f"allowed: {sorted(allowed)}"
        )
    converted = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    return section_type(**converted)


_SECTIONS: dict[str, type] = {
    "precision": PrecisionConfig,
    "memory_format": MemoryFormatConfig,
    "backend": BackendConfig,
    "compile": CompileConfig,
    "checkpointing": CheckpointConfig,
    "accumulation": AccumulationConfig,
    "clipping": ClippingConfig,
    "optimizer": OptimizerConfig,
    "data": DataConfig,
    "reliability": ReliabilityConfig,
    "distributed": DistributedConfig,
}

PRESETS: dict[str, TurboConfig] = {
    "baseline": TurboConfig(),
    "fast": TurboConfig(
        precision=PrecisionConfig(dtype="bf16"),
        memory_format=MemoryFormatConfig(channels_last=True),
    ),
}
