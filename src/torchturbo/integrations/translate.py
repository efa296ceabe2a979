"""A TurboConfig as Hugging Face ``TrainingArguments`` keywords and Lightning ``Trainer`` keywords.

Pure data, no third-party import: the tuner writes these settings into files next to turbo.toml on
machines without either library, and the integration modules turn them into live objects.

Every field of every section is accounted for, in one of three ways: carried as a keyword of the
trainer; applied by torchturbo's callback (``TurboCallback``, ``TurboLightningCallback``) or
``TurboTrainer`` where the trainer has no argument for it (channels_last, DDP comm hooks,
token-budget bucketing); or listed in ``notes`` with why it does not carry over. A field at a
value that changes nothing in a run (no clipping, no memory budget, one process's defaults) needs
no note. Each technique translates its own fields (``Technique.translations``, gathered by
``techniques/registry.translate``); this module adds the sections that are the engine's
(device, accumulation, clipping, the loader, reliability, distributed).
``tests/test_integrations_transformers.py`` checks the accounting field by field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from torchturbo.config import CommHookName, DistributedConfig, TurboConfig
from torchturbo.techniques import registry
from torchturbo.techniques.framework.spec import TrainerArguments

#: Where each trainer's callbacks live, for the notes.
HF_CALLBACK = "torchturbo.integrations.transformers.TurboCallback"
HF_TRAINER = "torchturbo.integrations.transformers.TurboTrainer"
LIGHTNING_CALLBACK = "torchturbo.integrations.lightning.TurboLightningCallback"

_DEFAULT_DISTRIBUTED = DistributedConfig()


@dataclass(frozen=True)
class Translation:
    """Keywords for another trainer, and what each setting that is not among them becomes.

    ``notes`` maps ``"[section] field"`` to one sentence: applied by torchturbo's callback or
    trainer class instead, or not carried over and why.
    """

    kwargs: dict[str, Any]
    notes: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class DDPSpec:
    """Lightning's DDP strategy as data: ``integrations.lightning`` builds the ``DDPStrategy``."""

    bucket_cap_mb: float
    gradient_as_bucket_view: bool
    static_graph: bool
    #: torchturbo's comm hook name (``distributed.ddp.COMM_HOOKS``), with PowerSGD's settings.
    comm_hook: CommHookName
    powersgd_rank: int
    powersgd_warmup: int


def _key(section: str, name: str) -> str:
    return f"[{section}] {name}"


def _installed_hf_fields() -> frozenset[str] | None:
    try:
        from transformers import TrainingArguments
    except ImportError:
        return None
    return frozenset(f.name for f in dataclasses.fields(TrainingArguments))


def hf_arguments(config: TurboConfig, fields: Collection[str] | None = None) -> Translation:
    """``TrainingArguments`` keywords realising ``config``, and notes for the rest.

    ``fields`` are the names ``TrainingArguments`` accepts (default: the installed version's,
    else transformers 5's): 5.x spells length grouping ``train_sampling_strategy`` and
    checkpointing ``activation_checkpointing``, 4.x ``group_by_length`` and
    ``gradient_checkpointing``. Each technique translates itself (``Technique.translations``);
    this function adds the engine's own sections.
    """
    accepts = _installed_hf_fields() if fields is None else frozenset(fields)
    arguments = TrainerArguments("transformers", accepts, HF_CALLBACK, HF_TRAINER)
    kwargs, notes = arguments.kwargs, arguments.notes
    _hf_device(config, kwargs, notes)
    registry.translate(config, arguments)
    if config.accumulation.steps * config.accumulation.micro_batches > 1:
        # One means "as the recipe's batches come": the user's own accumulation stays theirs.
        kwargs["gradient_accumulation_steps"] = (
            config.accumulation.steps * config.accumulation.micro_batches
        )
    _micro_batches(config, notes, "per_device_train_batch_size")
    _clipping(config, kwargs, notes, "max_grad_norm", "Trainer clips at 1.0 unless told")
    _hf_data(config, kwargs, notes)
    _reliability(config, notes, "save_total_limit", f"{HF_TRAINER} (PreemptionCallback)")
    _in_run(
        config,
        notes,
        f"{HF_TRAINER}, which starts where the facts point; the Trainer's autocast is fixed for "
        "the run, so the start is not measured on its steps",
    )
    _hf_distributed(config, kwargs, notes)
    return Translation(kwargs, notes)


def _micro_batches(config: TurboConfig, notes: dict[str, str], batch_size: str) -> None:
    """A trainer cuts no batch into pieces: a smaller batch with more accumulation is the same
    global batch, which the accumulation keyword above already multiplies."""
    pieces = config.accumulation.micro_batches
    if pieces > 1:
        notes[_key("accumulation", "micro_batches")] = (
            f"divide {batch_size} by {pieces} (the accumulation above is multiplied by it): "
            "the same global batch in micro-batches that fit"
        )


def _hf_device(config: TurboConfig, kwargs: dict[str, Any], notes: dict[str, str]) -> None:
    if config.device == "cpu":
        kwargs["use_cpu"] = True
    elif ":" in config.device:
        notes["device"] = (
            f"{config.device!r} is not carried: Trainer uses the GPU of LOCAL_RANK; select one "
            "with CUDA_VISIBLE_DEVICES"
        )


def _clipping(
    config: TurboConfig, kwargs: dict[str, Any], notes: dict[str, str], name: str, default: str
) -> None:
    clipping = config.clipping
    if clipping.max_norm is None:
        notes[_key("clipping", "max_norm")] = (
            f"unset: {name} is left to you ({default}; the tuner measured without clipping)"
        )
    else:
        kwargs[name] = clipping.max_norm
    if clipping.norm_type != 2.0:
        notes[_key("clipping", "norm_type")] = (
            f"{clipping.norm_type} not carried: the trainer clips the 2-norm"
        )


def _hf_data(config: TurboConfig, kwargs: dict[str, Any], notes: dict[str, str]) -> None:
    data = config.data
    kwargs["dataloader_num_workers"] = data.num_workers
    kwargs["dataloader_pin_memory"] = data.pin_memory
    kwargs["dataloader_persistent_workers"] = data.persistent_workers
    if data.prefetch_factor is not None:
        kwargs["dataloader_prefetch_factor"] = data.prefetch_factor
    if data.pin_memory and data.non_blocking:
        kwargs["accelerator_config"] = {"non_blocking": True}
    if data.pad_to_multiple > 1:
        notes[_key("data", "pad_to_multiple")] = (
            f"pass pad_to_multiple_of={data.pad_to_multiple} to your data collator"
        )
    if data.max_shapes is not None:
        notes[_key("data", "max_shapes")] = (
            f"{data.max_shapes}: applied by TurboTrainer, which pads its planned batches to a "
            "few shapes; a plain Trainer's batches take the shapes of the data"
        )


def _in_run(config: TurboConfig, notes: dict[str, str], host: str) -> None:
    """``[tune]``: tuning inside the run is the host's class's own doing."""
    tune = config.tune
    if tune.in_run:
        notes[_key("tune", "in_run")] = f"applied by {host}"
    if tune.measure_share != type(tune)().measure_share:
        notes[_key("tune", "measure_share")] = f"applied by {host}"


def _reliability(
    config: TurboConfig, notes: dict[str, str], keep_option: str, stopper: str
) -> None:
    reliability = config.reliability
    if reliability.keep_last != 3:
        notes[_key("reliability", "keep_last")] = (
            f"{reliability.keep_last} not carried: set the trainer's {keep_option} yourself"
        )
    if reliability.auto_microbatch:
        notes[_key("reliability", "auto_microbatch")] = (
            "not carried: the trainer has no retry of a step in smaller pieces on out-of-memory"
        )
    if reliability.memory_budget_bytes is not None:
        notes[_key("reliability", "memory_budget_bytes")] = (
            "not carried: the trainer has no activation budget; lower the batch size or "
            "accumulate instead"
        )
    if reliability.nonfinite_patience:
        notes[_key("reliability", "nonfinite_patience")] = (
            "not carried: the trainer does not stop on non-finite losses"
        )
    if reliability.stop_grace_s:
        notes[_key("reliability", "stop_grace_s")] = (
            f"applied by {stopper}: on a stop signal it saves the step under way as the "
            f"trainer's own checkpoint, and stops at once {reliability.stop_grace_s:g} s after "
            "the signal"
        )


def _hf_distributed(config: TurboConfig, kwargs: dict[str, Any], notes: dict[str, str]) -> None:
    dist = config.distributed
    if dist.strategy == "fsdp":
        notes[_key("distributed", "strategy")] = (
            "'fsdp' not carried: Trainer's FSDP (fsdp='full_shard', fsdp_config="
            "{'fsdp_version': 2}) is configured through accelerate; torchturbo has not verified "
            "it matches"
        )
    kwargs["ddp_bucket_cap_mb"] = max(1, round(dist.bucket_cap_mb))
    if kwargs["ddp_bucket_cap_mb"] != dist.bucket_cap_mb:
        notes[_key("distributed", "bucket_cap_mb")] = (
            f"{dist.bucket_cap_mb} rounded to {kwargs['ddp_bucket_cap_mb']}: Trainer takes "
            "whole MiB"
        )
    if dist.static_graph:
        kwargs["ddp_static_graph"] = True
    if dist.comm_hook != "none":
        powersgd = (
            f" (rank {dist.powersgd_rank} after {dist.powersgd_warmup} plain steps)"
            if dist.comm_hook.startswith("powersgd")
            else ""
        )
        notes[_key("distributed", "comm_hook")] = (
            f"{dist.comm_hook!r}{powersgd} applied by {HF_TRAINER} (through accelerate)"
        )
    if dist.gradient_as_bucket_view:
        notes[_key("distributed", "gradient_as_bucket_view")] = (
            f"applied by {HF_TRAINER} (through accelerate)"
        )
    _distributed_leftovers(dist, notes)


def _distributed_leftovers(dist: DistributedConfig, notes: dict[str, str]) -> None:
    """Notes for the FSDP dtypes and pipeline settings, which neither trainer takes."""
    for name in ("fsdp_param_dtype", "fsdp_reduce_dtype", "pipeline_schedule"):
        if getattr(dist, name) != getattr(_DEFAULT_DISTRIBUTED, name):
            notes[_key("distributed", name)] = f"{getattr(dist, name)!r} not carried"
    if dist.pipeline_microbatches != _DEFAULT_DISTRIBUTED.pipeline_microbatches:
        notes[_key("distributed", "pipeline_microbatches")] = "not carried"


def lightning_arguments(config: TurboConfig) -> Translation:
    """Lightning ``Trainer`` keywords realising ``config``; ``strategy`` is a :class:`DDPSpec`
    when the [distributed] section asks for anything but DDP's defaults."""
    arguments = TrainerArguments("lightning", None, LIGHTNING_CALLBACK, LIGHTNING_CALLBACK)
    kwargs, notes = arguments.kwargs, arguments.notes
    if config.device == "cpu":
        kwargs["accelerator"] = "cpu"
    elif config.device.startswith("cuda"):
        kwargs["accelerator"] = "gpu"
        if ":" in config.device:
            kwargs["devices"] = [int(config.device.split(":", 1)[1])]
    registry.translate(config, arguments)
    if config.accumulation.steps * config.accumulation.micro_batches > 1:
        kwargs["accumulate_grad_batches"] = (
            config.accumulation.steps * config.accumulation.micro_batches
        )
        notes[_key("accumulation", "steps")] = (
            "Lightning averages the micro-batches' mean losses: exact for equal batches; for "
            "batches of different token counts normalize by the window's count in training_step"
        )
    _micro_batches(config, notes, "your DataLoader's batch_size")
    if config.clipping.max_norm is not None:
        kwargs["gradient_clip_algorithm"] = "norm"
    _clipping(config, kwargs, notes, "gradient_clip_val", "Lightning does not clip unless told")
    _lightning_data(config, notes)
    _reliability(config, notes, "ModelCheckpoint(save_top_k=...)", LIGHTNING_CALLBACK)
    _in_run(
        config,
        notes,
        f"{LIGHTNING_CALLBACK}, which starts where the facts point and measures the precision "
        "on the job's steps by swapping the precision plugin",
    )
    _lightning_distributed(config, kwargs, notes)
    return Translation(kwargs, notes)


def _lightning_data(config: TurboConfig, notes: dict[str, str]) -> None:
    """Lightning takes the user's DataLoaders as they are: loader settings become notes."""
    data = config.data
    loader = {
        "num_workers": data.num_workers,
        "pin_memory": data.pin_memory,
        "persistent_workers": data.persistent_workers,
        "prefetch_factor": data.prefetch_factor,
    }
    default = {f.name: f.default for f in dataclasses.fields(data) if f.name in loader}
    for name, value in loader.items():
        if value != default[name]:
            notes[_key("data", name)] = f"build your DataLoader with {name}={value!r}"
    if data.pad_to_multiple > 1:
        notes[_key("data", "pad_to_multiple")] = (
            f"pad to a multiple of {data.pad_to_multiple} in your collate function"
        )
    if data.max_shapes is not None:
        notes[_key("data", "max_shapes")] = (
            f"{data.max_shapes}: applied by TurboLightningCallback, whose rebuilt train "
            "DataLoader pads its batches to a few shapes"
        )
    if data.pin_memory and not data.non_blocking:
        notes[_key("data", "non_blocking")] = "not carried: Lightning copies non-blocking"


def _lightning_distributed(
    config: TurboConfig, kwargs: dict[str, Any], notes: dict[str, str]
) -> None:
    dist = config.distributed
    if dist.strategy == "fsdp":
        notes[_key("distributed", "strategy")] = (
            "'fsdp' not carried: Lightning's FSDPStrategy is FSDP1 and its ModelParallelStrategy "
            "(FSDP2) needs your configure_model"
        )
    elif dist != _DEFAULT_DISTRIBUTED:
        if dist.comm_hook != "none":
            notes[_key("distributed", "comm_hook")] = (
                f"{dist.comm_hook!r} carried by the DDPStrategy on CUDA; on CPU Lightning skips "
                f"comm hooks and {LIGHTNING_CALLBACK} registers it"
            )
        kwargs["strategy"] = DDPSpec(
            bucket_cap_mb=dist.bucket_cap_mb,
            gradient_as_bucket_view=dist.gradient_as_bucket_view,
            static_graph=dist.static_graph,
            comm_hook=dist.comm_hook,
            powersgd_rank=dist.powersgd_rank,
            powersgd_warmup=dist.powersgd_warmup,
        )
    _distributed_leftovers(dist, notes)
