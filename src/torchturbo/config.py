"""TurboConfig: every knob torchturbo turns, one frozen section per concern, with TOML I/O.

Each section validates itself in ``__post_init__`` and raises :class:`ConfigError` naming the
field, the bad value and what is allowed, for every bad field at once. Field types are checked
from the annotations, so a TOML file with ``steps = "4"`` fails with a message, not deep inside
the engine; numbers are checked against the range declared beside the field (``between``):
never NaN, never infinite unless the field says so, never beyond what the code can use.
Checks that depend on the machine or the launch (fp16 on a CPU, a CUDA index, one process with
a ``[distributed]`` section) are :func:`check_environment`'s, run when a command loads a config.
The command line's ``--section.field`` options, ``config show`` and ``config schema`` are
generated from these dataclasses (:mod:`torchturbo.config_fields`) and validated here too.

Why hand-written (dataclasses and a small validation core, not pydantic or attrs): the sections
must stay plain frozen standard-library dataclasses that pickle to every rank and that users
build with ``dataclasses.replace``; a validation library would be a dependency of several MB
for the ~150 lines below, and would still need this file's rules written out (ranges with the
reason for a limit, checks of how fields combine, typo suggestions) and its own messages,
which span lines and name types the way Python does, turned into the one line per problem a
CLI prints. TOML is read by ``tomllib`` (standard library) and written by ``tomli-w``.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import math
import os
import re
import reprlib
import stat
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
    """Invalid configuration values; the message names each field, its value and what is allowed.

    ``problems`` holds one sentence per problem: a file with several is reported whole, in one
    line, rather than one problem per run.
    """

    def __init__(self, *problems: str, where: str = "") -> None:
        self.problems = problems
        self.where = where
        count = f"{len(problems)} problems: " if len(problems) > 1 else ""
        super().__init__(f"{where}: " * bool(where) + count + "; ".join(problems))


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

#: Every int field fits torch's int64 (counters and sizes become int64 tensors and C++ ints).
INT64_MAX = 2**63 - 1
#: torch's device index is an int8: "cuda:128" silently becomes cuda:-128.
MAX_CUDA_INDEX = 127
_DEVICE = re.compile(r"auto|cpu|cuda(?::(?P<index>0|[1-9][0-9]{0,2}))?")
#: A config file is a few hundred bytes; a larger one is the wrong file.
MAX_FILE_BYTES = 1 << 20


def _quote(value: Any) -> str:
    """``repr(value)`` cut short: a TOML value may be a huge or deeply nested table."""
    short = reprlib.Repr()  # keyword arguments only from Python 3.12
    short.maxlevel, short.maxstring, short.maxother = 2, 40, 40
    short.maxlist = short.maxtuple = short.maxdict = 4
    return short.repr(value)


@dataclass(frozen=True)
class Bounds:
    """The range a numeric field allows; ``why`` explains an upper limit in the error.

    Int fields are also capped at :data:`INT64_MAX`; floats must be finite unless
    ``inf_allowed``.
    """

    low: float
    high: float = math.inf
    low_exclusive: bool = False
    #: +inf is a meaningful value (clipping's norm_type: the max-norm).
    inf_allowed: bool = False
    why: str = ""
    #: What leaving the key out means, for fields that may be None ("no clipping").
    absent: str = ""

    def problem(self, value: float, *, integer: bool) -> str | None:
        """What is wrong with ``value`` (of an int field when ``integer``), or None."""
        if value == math.inf and self.inf_allowed:
            return None
        high = min(self.high, INT64_MAX) if integer else self.high
        too_low = value <= self.low if self.low_exclusive else value < self.low
        if not math.isfinite(value) or too_low or value > high:
            return f"expected {self._allowed(integer, above=value > high)}"
        return None

    def _allowed(self, integer: bool, *, above: bool) -> str:
        kind = "an int" if integer else "a finite number"
        allowed = f"{kind} {'>' if self.low_exclusive else '>='} {self.low}"
        if self.inf_allowed:
            allowed += ", or inf"
        elif self.high < math.inf:
            allowed += f" and <= {self.high}" + f" ({self.why})" * bool(self.why)
        elif integer and above:  # the int64 cap is news only to a value beyond it
            allowed += " and <= 2**63 - 1 (torch's int64)"
        return allowed + f", or no key for {self.absent}" * bool(self.absent)


def between(default: Any, low: float, **bounds: Any) -> Any:
    """A dataclass field whose numeric value must lie within :class:`Bounds` ``(low, **bounds)``."""
    return field(default=default, metadata={"bounds": Bounds(low, **bounds)})


def validate_section(section: Any, *combinations: typing.Callable[[], list[str]]) -> None:
    """Raise one :class:`ConfigError` for every bad field of ``section``.

    ``combinations`` check how fields go together; they run only once every field has the
    right type and range, so that they compare well-formed values.
    """
    problems = _field_problems(section)
    if not problems:
        problems = [problem for check in combinations for problem in check()]
    if problems:
        raise ConfigError(*problems)


def _field_problems(section: Any) -> list[str]:
    """Type and range problems of every field, from the annotations and ``between`` bounds."""
    hints = typing.get_type_hints(type(section))
    problems = []
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        expected = hints[f.name]
        bounds = f.metadata.get("bounds")
        if not _matches(value, expected):
            wrong = f"expected {_describe(expected)}"
        elif bounds is not None and isinstance(value, (int, float)):
            wrong = bounds.problem(value, integer=not _matches(0.5, expected))
        elif isinstance(value, float) and not math.isfinite(value):
            wrong = "expected a finite number"
        else:
            wrong = None
        if wrong:
            problems.append(f"[{section.SECTION}] {f.name} = {_quote(value)} is invalid: {wrong}")
    return problems


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
        validate_section(self, self._combinations)

    def _combinations(self) -> list[str]:
        if self.dtype == "fp16" and self.grad_scaler is False:
            return [
                "[precision] dtype = 'fp16' with grad_scaler = false is invalid: fp16 gradients "
                "underflow without loss scaling; remove grad_scaler or use dtype = 'bf16'"
            ]
        if self.dtype != "fp16" and self.grad_scaler:
            return [
                f"[precision] grad_scaler = true with dtype = {self.dtype!r} is invalid: only fp16 "
                "needs a GradScaler (bf16 has fp32's exponent range); remove grad_scaler"
            ]
        return []

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
        validate_section(self)


@dataclass(frozen=True, kw_only=True)
class BackendConfig:
    """Backend switches that are global to the process."""

    SECTION: typing.ClassVar[str] = "backend"
    #: cuDNN autotuning per input shape. Helps fixed shapes; hurts when shapes vary every step.
    cudnn_benchmark: bool = False

    def __post_init__(self) -> None:
        validate_section(self)


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
    #: Inductor's cache folder (compiled graphs and kernels), relative to the turbo.toml that
    #: names it; "" leaves torch's default. ``tune`` compiles into one beside turbo.toml, so
    #: that the first step of ``train`` loads what tuning compiled instead of compiling again.
    cache_dir: str = ""

    def __post_init__(self) -> None:
        validate_section(self)


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
    every_n: int = between(1, 1)

    def __post_init__(self) -> None:
        validate_section(self, self._combinations)

    def _combinations(self) -> list[str]:
        chooses_nothing = not (self.module_types or self.name_pattern) and self.every_n == 1
        if self.mode == "selective" and chooses_nothing:
            return [
                "[checkpointing] mode = 'selective' needs module_types, name_pattern or "
                "every_n > 1 to choose blocks; use mode = 'full' to checkpoint all blocks"
            ]
        if self.mode != "selective" and (self.module_types or self.name_pattern):
            return [
                f"[checkpointing] module_types/name_pattern are only used with mode = "
                f"'selective', but mode = {self.mode!r}"
            ]
        return []


@dataclass(frozen=True, kw_only=True)
class AccumulationConfig:
    """Gradient accumulation over micro-batches."""

    SECTION: typing.ClassVar[str] = "accumulation"
    #: Micro-batches per optimizer step. Gradients are normalized by the total sample or token
    #: count of the window, so micro-batches of different sizes give the full-batch gradient.
    #: A window also closes at the end of an epoch: ``torchturbo train`` refuses more steps than
    #: an epoch has batches, which would make every window the epoch.
    steps: int = between(1, 1)

    def __post_init__(self) -> None:
        validate_section(self)


@dataclass(frozen=True, kw_only=True)
class ClippingConfig:
    """Gradient norm clipping (applied to unscaled gradients)."""

    SECTION: typing.ClassVar[str] = "clipping"
    #: Clip the total gradient norm to this value; None (no key) = no clipping.
    max_norm: float | None = between(None, 0, low_exclusive=True, absent="no clipping")
    #: The p of the p-norm: p >= 1 (a norm), or inf for the largest absolute value.
    norm_type: float = between(2.0, 1, inf_allowed=True)

    def __post_init__(self) -> None:
        validate_section(self)


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
        validate_section(self)


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """DataLoader settings (used when Turbo.setup builds the loader from a dataset)."""

    SECTION: typing.ClassVar[str] = "data"
    #: Loader worker processes (0 = load in the training process).
    num_workers: int = between(0, 0, high=1024, why="each worker is a process")
    #: Page-locked host memory for faster, asynchronous host-to-device copies (CUDA only).
    pin_memory: bool = False
    #: Keep workers alive between epochs. Needs num_workers > 0.
    persistent_workers: bool = False
    #: Batches prefetched per worker. Needs num_workers > 0; None = torch's default (2).
    prefetch_factor: int | None = between(
        None, 1, high=1024, why="each prefetched batch is held in memory"
    )
    #: Host-to-device copies with non_blocking=True (asynchronous only from pinned memory).
    non_blocking: bool = True
    #: Length-bucketed batches (data/bucketing.py); needs per-sample lengths from the recipe.
    bucketing: bool = False
    #: Token budget per bucketed batch, padding included; None = the recipe's batch size times
    #: its mean length, so that bucketing changes padding, not the amount of work per step.
    max_tokens: int | None = between(None, 1)
    #: Pad sequence lengths up to a multiple of this (8 suits tensor cores).
    pad_to_multiple: int = between(1, 1, high=65536, why="every sequence is padded to it")

    def __post_init__(self) -> None:
        validate_section(self, self._combinations)

    def _combinations(self) -> list[str]:
        problems = []
        if self.num_workers == 0 and self.persistent_workers:
            problems.append(
                "[data] persistent_workers = true needs num_workers > 0 (there are no workers "
                "to keep alive); set num_workers or remove persistent_workers"
            )
        if self.num_workers == 0 and self.prefetch_factor is not None:
            problems.append(
                f"[data] prefetch_factor = {self.prefetch_factor} needs num_workers > 0 "
                "(the main process does not prefetch); set num_workers or remove prefetch_factor"
            )
        if self.max_tokens is not None and not self.bucketing:
            problems.append(
                f"[data] max_tokens = {self.max_tokens} is only used with bucketing = true"
            )
        if self.max_tokens is not None and self.pad_to_multiple > self.max_tokens:
            problems.append(
                f"[data] pad_to_multiple = {self.pad_to_multiple} is invalid with max_tokens = "
                f"{self.max_tokens}: one padded sequence would not fit in a batch"
            )
        return problems


@dataclass(frozen=True, kw_only=True)
class ReliabilityConfig:
    """Checkpoints, automatic micro-batching on out-of-memory, and the non-finite guard."""

    SECTION: typing.ClassVar[str] = "reliability"
    #: Checkpoints kept by Turbo.save; older ones are deleted once a new one is complete.
    keep_last: int = between(3, 1)
    #: Halve the micro-batch and retry the step when it runs out of memory (CUDA OOM, or the
    #: budget below). False: the out-of-memory error propagates.
    auto_microbatch: bool = True
    #: Activation budget in bytes: the tensors a micro-batch keeps for backward (parameters
    #: excluded). Exceeding it counts as out of memory, on any device. None = no budget.
    memory_budget_bytes: int | None = between(None, 1, absent="no budget")
    #: Stop after this many consecutive optimizer steps whose loss, inputs or applied gradients
    #: are non-finite (fp16 overflow that the GradScaler skips does not count). 0 = never.
    nonfinite_patience: int = between(3, 0)
    #: Seconds a run stopped by SIGTERM/SIGUSR1/SIGUSR2/Ctrl-C may take to finish the step
    #: under way and save it; past them it stops at once, keeping the previous checkpoint.
    #: Set it below the scheduler's kill delay (SLURM KillWait, Kubernetes
    #: terminationGracePeriodSeconds, torchrun's 30 s). 0 = no limit.
    stop_grace_s: float = between(0.0, 0, high=86_400, why="a day")

    def __post_init__(self) -> None:
        validate_section(self)


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
    powersgd_rank: int = between(4, 1)
    #: Plain all-reduce for this many steps before PowerSGD starts (torch needs >= 2: it starts
    #: error feedback from plain all-reduce steps).
    powersgd_warmup: int = between(10, 2)
    #: DDP bucket size in MiB: larger buckets, fewer and larger all-reduces.
    bucket_cap_mb: float = between(
        25.0, 0, low_exclusive=True, high=2**20, why="1 TiB, more than any device holds"
    )
    #: Gradients are views into DDP's buckets: saves one copy and the memory of the gradients.
    gradient_as_bucket_view: bool = False
    #: The set of used parameters never changes between steps: DDP may skip re-checking it.
    static_graph: bool = False
    #: FSDP mixed precision: dtype of the unsharded parameters in forward/backward.
    fsdp_param_dtype: ParamDtype = "fp32"
    #: FSDP mixed precision: dtype in which gradients are reduce-scattered.
    fsdp_reduce_dtype: ParamDtype = "fp32"
    #: Pipeline parallelism (distributed/pipeline.py): the schedule of the stages.
    pipeline_schedule: PipelineSchedule = "1f1b"
    #: Pipeline parallelism: micro-batches each batch is split into.
    pipeline_microbatches: int = between(4, 1)

    def __post_init__(self) -> None:
        validate_section(self, self._combinations)

    def _combinations(self) -> list[str]:
        if self.strategy == "fsdp" and self.comm_hook != "none":
            return [
                f"[distributed] comm_hook = {self.comm_hook!r} is a DDP hook and does not apply "
                "to strategy = 'fsdp'; use fsdp_reduce_dtype to reduce in lower precision"
            ]
        return []


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
    #: The sections techniques declare themselves (``Technique.section_type``), as (name,
    #: section) pairs; one left out is at its defaults. Read one with :meth:`section`.
    declared: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        problems = [] if (problem := device_problem(self.device)) is None else [problem]
        for name, section_type in _CORE_SECTIONS.items():
            if not isinstance(getattr(self, name), section_type):
                problems.append(f"[{name}] must be a {section_type.__name__}")
        for name, value in self.declared:  # looked up only when a config has one
            declared_type = _declared_sections().get(name)
            if declared_type is None:
                problems.append(f"[{name}] is no config section; allowed: {list(sections())}")
            elif not isinstance(value, declared_type):
                problems.append(f"[{name}] must be a {declared_type.__name__}")
        if problems:
            raise ConfigError(*problems)

    def section(self, name: str) -> Any:
        """The section called ``name``: a core one (``config.precision``) or one a technique
        declared, at its defaults when this config does not set it."""
        if name in _CORE_SECTIONS:
            return getattr(self, name)
        value = dict(self.declared).get(name)
        if value is not None:
            return value
        section_type = sections().get(name)
        if section_type is None:
            raise AttributeError(f"no config section {name!r}; sections: {list(sections())}")
        return section_type()

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
        return self._with_sections(updates)

    def _with_sections(self, updates: dict[str, Any]) -> TurboConfig:
        """A copy with ``updates`` (core fields, core or declared sections by name) set."""
        declared = dict(self.declared)
        for name in [n for n in updates if n not in _CORE_SECTIONS and n != "device"]:
            declared[name] = updates.pop(name)
        # A declared section at its defaults is left out: configs that mean the same are equal.
        kept = tuple(sorted((n, v) for n, v in declared.items() if v != type(v)()))
        return dataclasses.replace(self, **updates, declared=kept)

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
                f"{_did_you_mean(unknown, {'device', *known})}; "
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
        return base._with_sections(kwargs)

    def to_toml(self) -> str:
        return tomli_w.dumps(self.to_dict())

    @classmethod
    def from_toml(cls, text: str, *, base: TurboConfig | None = None) -> TurboConfig:
        """Parse and validate TOML text; keys left out keep ``base``'s values."""
        return cls.from_dict(_parse_toml(text), base=base)

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


def read_table(path: str | Path) -> dict[str, Any]:
    """The table a TOML config file holds, not yet validated; every problem names the file."""
    path = Path(path)
    text = _read_config_file(path)
    try:
        return _parse_toml(text)
    except ConfigError as err:
        raise ConfigError(*err.problems, where=str(path)) from err


def _parse_toml(text: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config is not valid TOML: {err}") from err
    except RecursionError:  # tomllib recurses once per level of nested arrays and tables
        raise ConfigError("config nests arrays or tables too deeply to read") from None


def _did_you_mean(unknown: set[str], allowed: set[str]) -> str:
    """' (did you mean 'dtype'?)' for the closest valid names of typo'd keys, else ''."""
    guesses = [
        f"{key!r} -> {match[0]!r}"
        for key in sorted(unknown)
        if (match := difflib.get_close_matches(key, sorted(allowed), n=1))
    ]
    return f" (did you mean {', '.join(guesses)}?)" if guesses else ""


def device_problem(device: Any, *, name: str = "device = ") -> str | None:
    """Why ``device`` is not a device name torchturbo can use, or None. ``name`` is how the
    message introduces the value."""
    match = _DEVICE.fullmatch(device) if isinstance(device, str) else None
    if match is not None and int(match["index"] or 0) <= MAX_CUDA_INDEX:
        return None
    return (
        f"{name}{_quote(device)} is invalid: expected 'auto', 'cpu', 'cuda' or 'cuda:N' "
        f"with N from 0 to {MAX_CUDA_INDEX}"
    )


def _section_from_dict(base: Any, name: str, values: Any) -> Any:
    """Section ``name`` with the keys of ``values`` replaced in ``base``, validated."""
    if not isinstance(values, dict):
        raise ConfigError(f"[{name}] must be a table, got {_quote(values)}")
    allowed = {f.name for f in dataclasses.fields(base)}
    unknown = {str(key) for key in values} - allowed
    if unknown:
        raise ConfigError(
            f"[{name}] unknown key(s) {sorted(unknown)}{_did_you_mean(unknown, allowed)}; "
            f"allowed: {sorted(allowed)}"
        )
    converted = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    return dataclasses.replace(base, **converted)


def _read_config_file(path: Path) -> str:
    """The text of a config file; an error that names the file says why it cannot be read."""
    try:
        status = path.stat()
        kind = _not_a_file(status.st_mode)
        if kind is None and status.st_size > MAX_FILE_BYTES:
            kind = f"{status.st_size:,} bytes, not a config file (at most {MAX_FILE_BYTES:,})"
        data = b"" if kind else path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except OSError as err:
        raise ConfigError(f"cannot read config file {str(path)!r}: {err.strerror}") from None
    if kind:
        raise ConfigError(f"config file {str(path)!r} is {kind}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"config file {str(path)!r} is not UTF-8 text (byte {data[err.start]:#04x} at offset "
            f"{err.start}): a config is a TOML file such as the turbo.toml that tune writes"
        ) from None


def _not_a_file(mode: int) -> str | None:
    """What a path is when it is not a file that can be read as text (pipes can), else None."""
    kinds = {
        stat.S_ISDIR: "a directory",
        stat.S_ISCHR: "a character device",
        stat.S_ISBLK: "a block device",
        stat.S_ISSOCK: "a socket",
    }
    return next((f"{kind}, not a file" for test, kind in kinds.items() if test(mode)), None)


_CORE_SECTIONS: dict[str, type] = {
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


def sections() -> dict[str, type]:
    """Every config section by name: the core ones above, then those that registered
    techniques declare (``Technique.section_type``), in the order of the file."""
    return {**_CORE_SECTIONS, **_declared_sections()}


@functools.cache
def _declared_sections() -> dict[str, type]:
    # The technique registry imports this module (its techniques read their sections), so the
    # sections it declares are looked up by name at first use, as a plugin registry is.
    registry = importlib.import_module("torchturbo.techniques.registry")
    declared: dict[str, type] = registry.declared_sections()
    clashes = sorted(set(declared) & set(_CORE_SECTIONS))
    if clashes:
        raise RuntimeError(f"techniques declare sections the config already has: {clashes}")
    return declared


PRESETS: dict[str, TurboConfig] = {
    "baseline": TurboConfig(),
    "fast": TurboConfig(
        precision=PrecisionConfig(dtype="bf16"),
        memory_format=MemoryFormatConfig(channels_last=True),
    ),
}


@dataclass(frozen=True, kw_only=True)
class Environment:
    """What the machine and the launch offer: the facts :func:`check_environment` reads."""

    cuda_devices: int
    #: Processes of the run: torchrun's WORLD_SIZE, 1 without torchrun.
    processes: int
    #: The CPU has native fp16 arithmetic (AVX512-FP16 or AMX-FP16).
    cpu_fp16: bool

    @classmethod
    def current(cls) -> Environment:
        import torch

        from torchturbo.measure.system import cpu_flags

        world_size = os.environ.get("WORLD_SIZE", "1")
        return cls(
            cuda_devices=torch.cuda.device_count() if torch.cuda.is_available() else 0,
            processes=int(world_size) if world_size.isdigit() else 1,
            cpu_fp16=bool(cpu_flags() & {"avx512_fp16", "amx_fp16"}),
        )


def check_environment(config: TurboConfig, env: Environment) -> tuple[list[str], list[str]]:
    """(errors, warnings) that ``config`` meets on this machine and launch, before any step runs.

    Errors are combinations that cannot run; warnings are settings that run but do not do what
    their name promises here. Each is one sentence naming the fields.
    """
    errors, warnings = [], []
    index = _DEVICE.fullmatch(config.device)["index"]  # type: ignore[index]  # validated
    if config.device.startswith("cuda") and env.cuda_devices == 0:
        errors.append(f"device = {config.device!r} needs CUDA; this machine has no CUDA device")
    elif index is not None and int(index) >= env.cuda_devices:
        errors.append(
            f"device = {config.device!r} is not on this machine: it has {env.cuda_devices} "
            f"CUDA device(s), cuda:0 to cuda:{env.cuda_devices - 1}"
        )
    on_cpu = config.device == "cpu" or (config.device == "auto" and env.cuda_devices == 0)
    if config.precision.dtype == "fp16" and on_cpu and not env.cpu_fp16:
        warnings.append(
            "[precision] dtype = 'fp16' on this CPU runs emulated (no avx512_fp16 or amx_fp16), "
            "slower than fp32, and needs loss scaling; dtype = 'bf16' needs none"
        )
    if env.processes == 1 and config.distributed != DistributedConfig():
        changed = [
            f.name
            for f in dataclasses.fields(DistributedConfig)
            if getattr(config.distributed, f.name) != f.default
        ]
        warnings.append(
            f"[distributed] {', '.join(changed)} take(s) effect only under torchrun "
            "(torchrun --nproc-per-node N -m torchturbo ...); this is one process"
        )
    return errors, warnings
