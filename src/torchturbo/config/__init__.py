"""The config: ``TurboConfig`` and its sections, validated, read from and written to TOML.

- ``validation.py``: :class:`ConfigError`, field ranges (:func:`between`) and
  :func:`validate_section`, which every section runs;
- ``sections.py``: every section, one frozen dataclass per concern (a technique's own too);
- ``turbo.py``: :class:`TurboConfig`, :func:`sections`, presets;
- ``io.py``: reading a config file; ``environment.py``: checks against the machine and launch;
- ``fields.py``, ``options.py``, ``resolve.py``, ``schema.py``: the fields as data, each one a
  ``--section.field`` option, the precedence of the layers, the JSON Schema.
"""

from torchturbo.config.environment import Environment, check_environment
from torchturbo.config.io import read_table
from torchturbo.config.sections import (
    AccumulationConfig,
    BackendConfig,
    CheckpointConfig,
    CheckpointMode,
    ClippingConfig,
    CommHookName,
    CompileConfig,
    CompileMode,
    DataConfig,
    DistributedConfig,
    DistStrategy,
    MemoryFormatConfig,
    OptimizerConfig,
    OptimizerImplementation,
    ParamDtype,
    PipelineSchedule,
    Precision,
    PrecisionConfig,
    ReliabilityConfig,
)
from torchturbo.config.turbo import PRESETS, TurboConfig, sections
from torchturbo.config.validation import (
    INT64_MAX,
    MAX_CUDA_INDEX,
    Bounds,
    ConfigError,
    between,
    device_problem,
    validate_section,
)

__all__ = [
    "INT64_MAX",
    "MAX_CUDA_INDEX",
    "PRESETS",
    "AccumulationConfig",
    "BackendConfig",
    "Bounds",
    "CheckpointConfig",
    "CheckpointMode",
    "ClippingConfig",
    "CommHookName",
    "CompileConfig",
    "CompileMode",
    "ConfigError",
    "DataConfig",
    "DistStrategy",
    "DistributedConfig",
    "Environment",
    "MemoryFormatConfig",
    "OptimizerConfig",
    "OptimizerImplementation",
    "ParamDtype",
    "PipelineSchedule",
    "Precision",
    "PrecisionConfig",
    "ReliabilityConfig",
    "TurboConfig",
    "between",
    "check_environment",
    "device_problem",
    "read_table",
    "sections",
    "validate_section",
]
