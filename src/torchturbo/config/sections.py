"""The config's core sections: one frozen, self-validating dataclass per concern.

Every section of turbo.toml is declared here, the core ones and those a single technique reads
(``[chunked_loss]``, ``[activation_compression]``), so the config knows its whole shape without
importing a technique. A field's documentation is the ``#:`` comment above it (``config show``,
``config schema`` and ``--help`` read it).
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from dataclasses import dataclass
from typing import Literal

if sys.version_info >= (3, 11):
    pass
else:  # pragma: no cover - exercised only on Python 3.10
    pass

from torchturbo.config.validation import between, validate_section

Precision = Literal["fp32", "tf32", "bf16", "fp16"]
CompileMode = Literal[
    "off", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"
]
CompileScope = Literal["model", "blocks"]
CheckpointMode = Literal["off", "full", "selective"]
DistStrategy = Literal["ddp", "fsdp"]
CommHookName = Literal["none", "fp16", "bf16", "powersgd", "powersgd_fp16", "powersgd_bf16"]
ParamDtype = Literal["fp32", "bf16", "fp16"]
OptimizerImplementation = Literal["as_built", "foreach", "fused"]
OptimizerState = Literal["as_built", "bf16", "8bit", "4bit", "fp8"]
PipelineSchedule = Literal["gpipe", "1f1b"]
#: The batch plans (``[data] batches``): each but rows is planned by the technique that
#: declares it (``Technique.plans``).
BatchPlanName = Literal["rows", "buckets", "packed"]
#: Keys of older files, and the line that names their new spelling, by value.
RENAMED = {
    ("data", "bucketing"): {True: "batches = 'buckets'", False: "batches = 'rows'"},
    ("data", "packing"): {True: "batches = 'packed'", False: "batches = 'rows'"},
}


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
    #: What is compiled. model: the whole model, one graph. blocks: regional compilation, each
    #: repeated block (a child of an nn.ModuleList of two or more modules of one class)
    #: compiled in place, the code compiled for the first reused by the others, and the rest
    #: of the model eager: the cold compile is about one block's, not every block's
    #: (techniques/regional_compile.py).
    scope: CompileScope = "model"
    #: Inductor's cache folder (compiled graphs and kernels), relative to the turbo.toml that
    #: names it; "" leaves torch's default. ``tune`` compiles into one beside turbo.toml, so
    #: that the first step of ``train`` loads what tuning compiled instead of compiling again.
    cache_dir: str = ""
    #: Fraction of the activations the compiled graph may keep for backward, recomputing the
    #: rest: 0 keeps only the graph's inputs (as checkpointing the whole model), 1 what the
    #: fastest partition keeps (torch's default). It is torch's
    #: _functorch.config.activation_memory_budget, set while Inductor partitions this model
    #: only. None (no key): torch's own setting.
    activation_memory_budget: float | None = between(
        None, 0, high=1, why="a fraction of the activations", absent="torch's default"
    )

    def __post_init__(self) -> None:
        validate_section(self, self._combinations)

    def _combinations(self) -> list[str]:
        if self.scope != "model" and self.mode == "off":
            return [
                f"[compile] scope = {self.scope!r} with mode = 'off' is invalid: nothing is "
                "compiled; set mode = 'default' or remove scope"
            ]
        if self.activation_memory_budget is not None and self.mode == "off":
            return [
                f"[compile] activation_memory_budget = {self.activation_memory_budget} with "
                "mode = 'off' is invalid: the budget is the compiler's (eager saves every "
                "activation); set mode = 'default' or remove activation_memory_budget"
            ]
        return []


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Activation checkpointing: trade recomputation in backward for activation memory."""

    SECTION: typing.ClassVar[str] = "checkpointing"
    #: off; full: every block (see techniques/checkpointing.py for what a block is); selective:
    #: blocks chosen by blocks, module_types / name_pattern, thinned by every_n.
    mode: CheckpointMode = "off"
    #: Qualified names of the modules to checkpoint, e.g. ["layers.0", "layers.3"] (selective
    #: only; what the tuner's memory planner writes). An unknown name is an error that lists
    #: the model's blocks.
    blocks: tuple[str, ...] = ()
    #: Class names of modules to checkpoint, e.g. ["TransformerEncoderLayer"] (selective only).
    module_types: tuple[str, ...] = ()
    #: fnmatch pattern on qualified module names, e.g. "encoder.layers.*" (selective only).
    name_pattern: str = ""
    #: Checkpoint every n-th of the chosen blocks (1 = all of them).
    every_n: int = between(1, 1)

    def __post_init__(self) -> None:
        validate_section(self, self._combinations)

    def _combinations(self) -> list[str]:
        by_name = self.blocks or self.module_types or self.name_pattern
        if self.mode == "selective" and not by_name and self.every_n == 1:
            return [
                "[checkpointing] mode = 'selective' needs blocks, module_types, name_pattern or "
                "every_n > 1 to choose blocks; use mode = 'full' to checkpoint all blocks"
            ]
        if self.mode != "selective" and by_name:
            return [
                f"[checkpointing] blocks/module_types/name_pattern are only used with mode = "
                f"'selective', but mode = {self.mode!r}"
            ]
        if self.blocks and (self.module_types or self.name_pattern or self.every_n > 1):
            return [
                "[checkpointing] blocks names the modules outright: leave module_types, "
                "name_pattern and every_n at their defaults beside it"
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
    #: Pieces each batch from the loader is cut into along dim 0, each its own forward and
    #: backward, accumulated as exactly as ``steps`` is: the batch, hence the global batch and
    #: the optimizer step, stay the same while a step holds the activations of one piece
    #: (ceil(batch / micro_batches) samples). ``tune --find-batch`` sets it to fit a budget.
    micro_batches: int = between(1, 1)

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
    #: How an Adam or AdamW keeps its two moments. as_built: as the optimizer does (float32).
    #: bf16: bfloat16, stochastically rounded (half the bytes). 8bit, 4bit, fp8: torchao's
    #: AdamW8bit, AdamW4bit, AdamWFp8 (block-quantised: about 1/4, 1/8, 1/4 of the bytes; their
    #: step is compiled, a one-time cost per parameter shape). The optimizer is rebuilt with
    #: the same groups and hyper-parameters; another class, or one rebuilt fused or foreach by
    #: ``implementation``, is left as it is, with the reason (techniques/optimizer_state.py).
    state: OptimizerState = "as_built"

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
    #: Which samples form each batch: rows, the host's own batches of batch_size rows; buckets,
    #: samples of similar length under a token budget (data/bucketing.py); packed, whole
    #: documents in one row per batch up to max_tokens, positions restarting per document
    #: (data/packing.py), for a model that keeps documents apart (checked first). buckets and
    #: packed need per-sample lengths.
    batches: BatchPlanName = "rows"
    #: Token budget per batch of buckets, padding included (per packed row); None = the
    #: smallest budget that keeps the recipe's batches per epoch, so that a batch holds the real
    #: tokens of the recipe's batch size on average (data/batch_plan.py).
    max_tokens: int | None = between(None, 1)
    #: Pad sequence lengths up to a multiple of this (8 suits tensor cores).
    pad_to_multiple: int = between(1, 1, high=65536, why="every sequence is padded to it")
    #: Batches of at most this many shapes, so that CUDA graphs (compile mode reduce-overhead)
    #: and shape-specialised compiled code are built once per shape, not per batch: buckets pad
    #: their length up a ladder of this many lengths and their rows to the token budget (empty
    #: rows), packed rows are all filled to max_tokens (one shape); labels on the padding are
    #: ignored (data/shapes.py). None: shapes follow the data. Needs batches buckets or packed.
    max_shapes: int | None = between(
        None, 1, high=1024, why="each shape is a graph to build", absent="shapes follow the data"
    )

    def __post_init__(self) -> None:
        validate_section(self, self._combinations)

    def batching(self) -> DataConfig:
        """This section with the DataLoader's fields at their defaults: what decides which
        samples form each batch and how they are collated, not how the batches are loaded."""
        return dataclasses.replace(
            self, **{name: getattr(DataConfig(), name) for name in LOADER_FIELDS}
        )

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
        if self.max_tokens is not None and self.batches == "rows":
            problems.append(
                f"[data] max_tokens = {self.max_tokens} is only used with batches = 'buckets' "
                "or 'packed' (a token budget per batch; rows have batch_size rows)"
            )
        if self.max_shapes is not None and self.batches == "rows":
            problems.append(
                f"[data] max_shapes = {self.max_shapes} is only used with batches = 'buckets' "
                "or 'packed' (the plans whose batches torchturbo pads)"
            )
        if self.max_tokens is not None and self.pad_to_multiple > self.max_tokens:
            problems.append(
                f"[data] pad_to_multiple = {self.pad_to_multiple} is invalid with max_tokens = "
                f"{self.max_tokens}: one padded sequence would not fit in a batch"
            )
        return problems


#: The [data] fields that configure the DataLoader rather than the batches it yields.
LOADER_FIELDS = (
    "num_workers",
    "pin_memory",
    "persistent_workers",
    "prefetch_factor",
    "non_blocking",
)


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
class TuneConfig:
    """Tuning inside the run (``engine/in_run.py``): the job itself is the measurement."""

    SECTION: typing.ClassVar[str] = "tune"
    #: Tune while training: before the first step, facts measured in seconds (the matrix-product
    #: rate of each precision here, the padding of the data's lengths) choose where the run
    #: starts (bf16 where it is measured fast, length buckets where lengths pad heavily); then
    #: each choice a step can switch is measured on the job's own steps, paired and judged by
    #: the tuner's rules, and kept only where it is faster at the same loss.
    in_run: bool = False
    #: The most of the job's steps the in-run measurement may spend on the slower side of its
    #: comparisons (those steps still train the model).
    measure_share: float = between(0.1, 0.01, high=0.5, why="half the job")

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


#: Tokens per chunk of the chunked loss by default: at a 128k vocabulary, 256 tokens of float32
#: logits take 128 MiB, and a product of 256 rows still runs at the matmul's full rate.
#: Liger-Kernel picks about this many for Llama-3-8B (tokens / ceil(vocab / hidden)).
CHUNK_TOKENS = 256


@dataclass(frozen=True, kw_only=True)
class ChunkedLossConfig:
    """A causal LM's cross-entropy computed in chunks of tokens, never holding all the logits."""

    SECTION: typing.ClassVar[str] = "chunked_loss"
    #: Compute a Hugging Face causal LM's loss in chunks (when labels are passed in training).
    enabled: bool = False
    #: Tokens per chunk: fewer hold less (a chunk's logits are tokens x vocab x 4 bytes), too
    #: few run the head's matrix product below its full rate.
    chunk_tokens: int = between(CHUNK_TOKENS, 1)

    def __post_init__(self) -> None:
        validate_section(self)


@dataclass(frozen=True, kw_only=True)
class LigerKernelConfig:
    """Liger-Kernel's Triton kernels in a Hugging Face causal LM (CUDA, liger-kernel)."""

    SECTION: typing.ClassVar[str] = "liger_kernel"
    #: Apply Liger-Kernel's patches for the model's type (RMSNorm, RoPE, SwiGLU, fused linear
    #: cross-entropy), as TrainingArguments(use_liger_kernel=True) does
    #: (techniques/liger.py). Where CUDA or the package is missing it is not applied, and why
    #: is reported.
    enabled: bool = False

    def __post_init__(self) -> None:
        validate_section(self)


@dataclass(frozen=True, kw_only=True)
class ActivationCompressionConfig:
    """Activations saved for backward, stored at half precision."""

    SECTION: typing.ClassVar[str] = "activation_compression"
    #: Store float32 activations saved for backward in this dtype ("off": as they are). Halves
    #: activation memory, costs a cast each way; the gradients differ by its rounding.
    dtype: Literal["off", "bf16", "fp16"] = "off"
    #: Saved tensors smaller than this many bytes are stored as they are: their casts would
    #: cost more than they save.
    min_bytes: int = between(2**20, 0)

    def __post_init__(self) -> None:
        validate_section(self)
