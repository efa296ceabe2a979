"""The 15 judgments: each turns the doctor's findings into a state, evidence and, where a quick
measurement gave one, an estimated gain. One function per item, registered in ``CHECKS`` in the
article's order; ``judge`` runs them all."""

from __future__ import annotations

from collections.abc import Callable

import psutil
import torch
import torch.distributed as dist

from torchturbo.data.augment import BatchAugment
from torchturbo.doctor.diagnosis import CHECKLIST, Item, State
from torchturbo.doctor.findings import (
    COMM_SHARE,
    MEMMAP_RAM_SHARE,
    MEMORY_PRESSURE,
    PADDING_GAP,
    Findings,
)
from torchturbo.doctor.gains import deciding
from torchturbo.doctor.model_facts import SIGNIFICANT_FLOP_SHARE, Misaligned
from torchturbo.measure.device_busy import regime_words
from torchturbo.output.tables import format_bytes

Verdict = tuple[State, str, str | None]

_PEAK_KINDS = {
    "cuda_allocator": "CUDA allocator peak",
    "cpu_rss_hwm": "process resident-set high-water mark: all of the process, not tensors alone",
    "cpu_rss_sampled": "process resident set, sampled every ms",
}


def judge(findings: Findings) -> list[Item]:
    """All 15 items, in the article's order."""
    items = []
    for group, names in CHECKLIST.items():
        for name in names:
            state, evidence, gain = CHECKS[name](findings)
            items.append(Item(group, name, state, evidence, gain))
    return items


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _count(n: int) -> str:
    return f"{n / 1e6:.2f} M" if n >= 1e5 else f"{n / 1e3:.1f} K" if n >= 1e3 else str(n)


def _times(ratio: float) -> str:
    return f"{ratio:.0f}x" if ratio >= 10 else f"{ratio:.2f}x"


def _pct(share: float) -> str:
    return "<0.1%" if share < 0.001 else f"{share:.1%}"


def _names(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


# ---- data flow ---------------------------------------------------------------------------------


def _dataloader(f: Findings) -> Verdict:
    lf, share = f.loader, f.input_share
    settings = (
        f"num_workers={lf.num_workers}, pin_memory={lf.pin_memory}, "
        f"persistent_workers={lf.persistent_workers}, prefetch_factor={lf.prefetch_factor}"
    )
    wait = (
        f"input wait {_ms(f.profile.breakdown['input_wait'])} of a {_ms(f.step_seconds)} step "
        f"({share:.0%})"
    )
    problems = []
    if f.loader_matters:
        if lf.num_workers == 0:
            problems.append("num_workers=0 loads in the main process, in series with compute")
        else:
            problems.append(f"{lf.num_workers} worker(s) do not keep up")
    if lf.num_workers and not lf.persistent_workers:
        problems.append("persistent_workers=False restarts the workers every epoch")
    if f.device.type == "cuda" and not lf.pin_memory:
        problems.append("pin_memory=False on CUDA: host-to-device copies cannot be asynchronous")
    if not problems:
        return "ok", f"{settings}; {wait}: the loader keeps up", None
    advice = "tune by measurement (torchturbo tune measures worker counts and their memory)"
    if f.dataset.num_samples is None:  # a stream: the tuner tries no worker setting on it
        advice = (
            "a stream must split itself among workers (torch.utils.data.get_worker_info), "
            "else each yields all of it: once yours does, set [data] num_workers yourself"
        )
    if f.device.type == "cpu" and f.loader_matters:
        advice += "; on a CPU device workers take cores from compute"
    gain = None
    if f.loader_matters:
        gain = f"up to {_times(1 / (1 - share))} if loading overlapped compute fully"
    return "recommended", f"{settings}; {wait}: {'; '.join(problems)}; {advice}", gain


def _preprocessing(f: Findings) -> Verdict:
    on_device = [k for k, v in f.recipe.extras.items() if isinstance(v, BatchAugment)]
    if on_device:
        where = f"recipe.extras[{on_device[0]!r}]"
        return "applied", f"BatchAugment in {where} augments batches on the device", None
    if f.dataset.transforms:
        attrs = ", ".join(f"{f.dataset.kind}.{a}" for a in f.dataset.transforms)
        return (
            "recommended",
            f"per-sample transforms ({attrs}) run in the loader on the CPU, one sample at a "
            f"time ({f.input_share:.0%} of the step is input wait); "
            "torchturbo.data.augment.BatchAugment crops, flips, jitters and normalizes whole "
            "uint8 batches on the device, random per sample",
            None,
        )
    return (
        "not applicable",
        f"no per-sample transform on the dataset ({f.dataset.kind}) and no augmentation in the "
        "recipe: there is no preprocessing to move",
        None,
    )


def _memmap(f: Findings) -> Verdict:
    ds = f.dataset
    if ds.memmapped:
        return "applied", f"{ds.kind}: samples are read from memory-mapped files", None
    if ds.nbytes is None:
        what = "streams its samples" if ds.num_samples is None else "holds no tensors to size"
        return "not applicable", f"{ds.kind} {what}: its size cannot be judged here", None
    total = psutil.virtual_memory().total
    size = f"{format_bytes(ds.nbytes)} ({ds.nbytes / total:.1%} of {format_bytes(total)} RAM)"
    where = "held in RAM" if ds.in_ram else "when decoded, estimated from the first sample"
    if ds.nbytes > MEMMAP_RAM_SHARE * total:
        return (
            "recommended",
            f"{ds.kind} of {ds.num_samples} samples: {size}, {where}; write it once with "
            "torchturbo.data.memmap.write_memmap and read it through the page cache "
            "(MemmapDataset): resident memory stays a few batches and workers share the pages",
            None,
        )
    return (
        "not applicable",
        f"{ds.kind} of {ds.num_samples} samples: {size}, {where}; it fits in memory, and "
        "memory-mapping pays for datasets near or beyond RAM",
        None,
    )


# ---- model -------------------------------------------------------------------------------------


def _mixed_precision(f: Findings) -> Verdict:
    dtype = f.config.precision.dtype
    params = ", ".join(f"{k} ({_count(n)})" for k, n in f.model.param_dtypes.items())
    if dtype in ("bf16", "fp16"):
        scaler = " with a GradScaler" if dtype == "fp16" else " (no scaler needed)"
        return "applied", f"autocast to {dtype}{scaler}; parameters: {params}", None
    low = [k for k in f.model.param_dtypes if k in ("bfloat16", "float16")]
    if low:
        return "applied", f"parameters are stored in low precision: {params}", None
    variant = f.precision_variant
    gain = None if variant is None or f.speedups is None else f.speedups.get(variant)
    if gain is None:
        why = f.comparison_error or f.precision_reason
        return "not applicable", f"precision is {dtype}; {why}", None
    measured = f"{variant} autocast measured {gain.describe()} in paired rounds"
    if gain.faster:
        return (
            "recommended",
            f"precision is {dtype}; {measured}; parameters: {params}. The tuner checks loss "
            "parity before keeping it",
            gain.describe(),
        )
    return "within noise", f"precision is {dtype}; {measured}: not faster beyond the noise", None


def _fusion(f: Findings) -> Verdict:
    pairs = f.model.conv_bn_pairs
    pair_text = ""
    if pairs:
        listed = _names([f"{c}→{n}" for c, n in pairs])
        pair_text = (
            f"{len(pairs)} Conv→BatchNorm pair(s) (by {f.model.pair_method}): {listed}; they "
            "fold into the conv for inference only (in training BatchNorm normalizes with batch "
            "statistics)"
        )
    elif "failed" in f.model.pair_method:
        pair_text = f"no Conv→BatchNorm pairs found ({f.model.pair_method})"
    mode = f.config.compile.mode
    if mode != "off":
        text = f"torch.compile (mode={mode!r}) fuses elementwise chains into generated kernels"
        return "applied", "; ".join(filter(None, [text, pair_text])), None
    compile_text = (
        "torch.compile (off) fuses norms, activations and residual adds in training too; its "
        "gain is not measured here (compiling outlasts a diagnosis): torchturbo tune measures it"
    )
    if f.fold is None or not pairs:
        return "not applicable", "; ".join(filter(None, [pair_text, compile_text])), None
    measured = f"folding measured {f.fold.describe()}"
    if f.fold.faster:
        return "recommended", "; ".join([pair_text, measured, compile_text]), f.fold.describe()
    return (
        "within noise",
        "; ".join([pair_text, f"{measured}: not faster beyond the noise", compile_text]),
        None,
    )


def _channels_last(f: Findings) -> Verdict:
    if not f.model.has_conv2d:
        return "not applicable", "no Conv2d in the model: channels_last changes 4-D tensors", None
    if f.config.memory_format.channels_last:
        reason = f.profile.applied.get("channels_last")
        if reason is None:
            return "applied", "model weights and 4-D float inputs are NHWC (channels_last)", None
        return "not applicable", f"channels_last is configured but was not applied: {reason}", None
    alone = None if f.speedups is None else f.speedups.get("channels_last")
    if alone is None:
        why = f.comparison_error or "the comparison did not run"
        return "not applicable", f"the model has Conv2d layers, but {why}", None
    gains = [alone]
    on_top = None if f.speedups is None else f.speedups.get(f"{f.precision_variant}+channels_last")
    if on_top is not None:
        gains.append(on_top)
    measured = "; ".join(f"measured {g.describe()}" for g in gains)
    text = f"the model has Conv2d layers; channels_last {measured} (paired rounds)"
    best = deciding(gains)
    if best.faster:
        return "recommended", text, best.describe()
    return "within noise", f"{text}: not faster beyond the noise", None


# ---- training ----------------------------------------------------------------------------------


def _memory_text(f: Findings) -> str:
    where = "device memory" if f.device.type == "cuda" else "RAM"
    return (
        f"peak {format_bytes(f.profile.peak.peak_bytes)}, {f.memory_share:.0%} of "
        f"{format_bytes(f.memory_capacity)} {where}"
    )


def _accumulation(f: Findings) -> Verdict:
    steps = f.config.accumulation.steps
    bn = (
        "; the model has BatchNorm, which normalizes each micro-batch on its own statistics"
        if f.model.has_batchnorm
        else ""
    )
    if steps > 1:
        return (
            "applied",
            f"{steps} micro-batches per optimizer step, gradients normalized by the window's "
            f"total {f.recipe.count_unit}{bn}",
            None,
        )
    if f.memory_share >= MEMORY_PRESSURE:
        return (
            "recommended",
            f"{_memory_text(f)}: halve batch_size ({f.recipe.batch_size}) and accumulate 2 "
            f"micro-batches to keep the effective batch in less memory{bn}",
            None,
        )
    return (
        "ok",
        f"the batch of {f.recipe.batch_size} fits ({_memory_text(f)}); accumulation makes no "
        f"step faster, it is for batches that do not fit{bn}",
        None,
    )


def _dynamic_batching(f: Findings) -> Verdict:
    if f.loader.bucketed:
        return "applied", "the loader batches by length (BucketBatchSampler)", None
    if f.padding is None:
        varying = f" although batch shapes vary ({_names(f.varying)})" if f.varying else ""
        return (
            "not applicable",
            f"the recipe gives no per-sample lengths{varying}: nothing to bucket by",
            None,
        )
    random, ordered = f.padding
    text = (
        f"random batches of {f.recipe.batch_size} would be {random:.0%} padding, length-bucketed "
        f"ones {ordered:.0%} (computed from recipe.lengths); the loader uses "
        f"{f.loader.batch_sampler}"
    )
    if random - ordered >= PADDING_GAP:
        gain = f"~{(1 - ordered) / (1 - random):.2f}x fewer padded tokens (computed, not timed)"
        return (
            "recommended",
            f"{text}; torchturbo.data.bucketing.BucketBatchSampler fills a token budget per batch",
            gain,
        )
    return "ok", f"{text}: lengths are too even for bucketing to pay", None


def _checkpointing(f: Findings) -> Verdict:
    if f.config.checkpointing.mode != "off":
        blocks = f.profile.checkpointed_blocks
        if blocks:
            text = f"{len(blocks)} block(s) recompute in backward: {_names(blocks)}"
            return "applied", text, None
        return "not applicable", "checkpointing is configured but selected no block", None
    if not f.model.blocks:
        return "not applicable", "no block (a child of Sequential/ModuleList) to checkpoint", None
    held = (
        f"a forward holds {format_bytes(f.model.activation_bytes)} of activations for backward "
        f"across {len(f.model.blocks)} block(s) ({_names(f.model.blocks)})"
    )
    if f.memory_share >= MEMORY_PRESSURE:
        return (
            "recommended",
            f"{_memory_text(f)}; {held}: checkpointing them trades about one extra forward per "
            "step for most of that memory",
            None,
        )
    return (
        "ok",
        f"{held}; memory is not the limit ({_memory_text(f)}), so recomputing would only cost time",
        None,
    )


# ---- hardware ----------------------------------------------------------------------------------


def _kernels(f: Findings) -> Verdict:
    benchmark = f.config.backend.cudnn_benchmark
    cuda = f.device.type == "cuda"
    if f.varying and benchmark:
        where = "" if cuda else " (no effect on this CPU device; the same config hurts on a GPU)"
        return (
            "recommended",
            f"input shapes vary across batches ({_names(f.varying)}) and backend.cudnn_benchmark "
            f"= true: cuDNN autotunes again for every new shape; set it to false{where}",
            None,
        )
    if cuda and f.model.has_conv2d and not f.varying and not benchmark:
        return (
            "recommended",
            "input shapes are fixed and the model has convolutions: backend.cudnn_benchmark = "
            "true lets cuDNN pick the fastest algorithm once per shape",
            None,
        )
    if f.config.compile.mode != "off":
        return "applied", "torch.compile generates the model's kernels (Inductor)", None
    if cuda and benchmark:
        return "applied", "cudnn_benchmark with fixed input shapes: cuDNN autotuned", None
    backend = "cuDNN autotuning does not apply on CPU" if not cuda else "cuDNN is set as it should"
    return (
        "not applicable",
        "whether a hand-written kernel (torch.library) pays is a judgement on the top operators "
        f"(see the profile), not something the doctor can measure; {backend}",
        None,
    )


def _alignment(f: Findings) -> Verdict:
    layers = f.model.misaligned
    significant = [m for m in layers if m.significant]

    def describe(m: Misaligned) -> str:
        share = "" if m.flop_share is None else f"; {_pct(m.flop_share)} of forward FLOPs"
        return f"{m.name} ({m.kind}: {', '.join(m.problems)}{share})"

    cpu = (
        " (TensorCores are a GPU feature: this judges the model for the GPU it may train on)"
        if f.device.type != "cuda"
        else ""
    )
    if significant:
        return (
            "recommended",
            f"{len(significant)} layer(s) off the alignment: "
            f"{_names([describe(m) for m in significant], 4)}; pad widths to multiples of 8 and "
            f"vocabularies to 64 (pad, never truncate inputs){cpu}",
            None,
        )
    if layers:
        return (
            "ok",
            f"only layers under {SIGNIFICANT_FLOP_SHARE:.0%} of the FLOPs are off the alignment: "
            f"{_names([describe(m) for m in layers])}; padding them would not pay",
            None,
        )
    return "ok", "every Linear, Conv and Embedding dimension is a multiple of 8 (vocab 64)", None


def _distributed(f: Findings) -> Verdict:
    if dist.is_available() and dist.is_initialized():
        return (
            "applied",
            f"{dist.get_world_size()} processes over {dist.get_backend()}",
            None,
        )
    if f.device.type == "cuda" and torch.cuda.device_count() > 1:
        count = torch.cuda.device_count()
        return (
            "recommended",
            f"{count} GPUs are visible and one process uses one: torchrun --nproc-per-node "
            f"{count} with DDP (or FSDP2 when the model does not fit one GPU)",
            None,
        )
    return (
        "not applicable",
        f"one process on one {f.device.type} device: there is nothing to distribute across",
        None,
    )


# ---- monitoring --------------------------------------------------------------------------------


def _profiler(f: Findings) -> Verdict:
    ops = ", ".join(f"{name} {share:.0%}" for name, _, share in f.profile.top_operators[:3])
    trace = f"; trace: {f.profile.trace_path}" if f.profile.trace_path else ""
    busy = f.profile.device_busy
    device = "" if busy is None else f"; {regime_words(busy, f.step_seconds)}"
    return (
        "applied",
        f"profiled here; top self time: {ops}; {f.bound}: input wait is {f.input_share:.0%} of "
        f"the step{device}{trace}",
        None,
    )


def _memory(f: Findings) -> Verdict:
    peak = f.profile.peak
    kind = _PEAK_KINDS.get(peak.kind, peak.kind)
    return (
        "applied",
        f"measured here: {_memory_text(f)} ({kind}); activations held for backward "
        f"{format_bytes(f.model.activation_bytes)}; parameters "
        f"{_count(f.model.num_params)}{_logits_text(f)}",
        None,
    )


def _logits_text(f: Findings) -> str:
    """The LM head's logits against the activations, where the model has such a head."""
    if f.logits_bytes is None:
        return ""
    share = f.logits_bytes / max(f.model.activation_bytes, f.logits_bytes)
    advice = " ([chunked_loss] enabled = true computes the loss without them)"
    if f.config.chunked_loss.enabled:
        advice = " (the loss is chunked: they are never all held)"
    return (
        f"; the LM head's float32 logits {format_bytes(f.logits_bytes)}, {share:.0%} of the "
        f"activations{advice}"
    )


def _communication(f: Findings) -> Verdict:
    if not (dist.is_available() and dist.is_initialized()):
        return "not applicable", "a single process communicates nothing", None
    sent, seconds = f.profile.comm_bytes_per_step, f.profile.comm_seconds_per_step
    if sent is not None and seconds is None:
        return (
            "applied",
            f"measured here: DDP all-reduced {format_bytes(round(sent))} per step "
            f"(comm_hook = {f.config.distributed.comm_hook!r}); its time is not measured on "
            "NCCL, whose futures complete when the work is queued: see the trace (--trace)",
            None,
        )
    if sent is None or seconds is None:
        return (
            "not applicable",
            f"strategy = {f.config.distributed.strategy!r}: torchturbo counts DDP's gradient "
            "traffic through its comm hook, which FSDP does not use",
            None,
        )
    share = seconds / f.step_seconds
    text = (
        f"measured here: DDP all-reduced {format_bytes(round(sent))} per step "
        f"(comm_hook = {f.config.distributed.comm_hook!r}), a reduction in flight {_ms(seconds)} "
        f"per step ({share:.0%} of the step, overlapping backward and waiting for the slowest rank)"
    )
    if share >= COMM_SHARE and f.config.distributed.comm_hook == "none":
        return (
            "recommended",
            f"{text}: try comm_hook = 'fp16' (half the bytes) or 'powersgd', or a larger "
            "bucket_cap_mb; `torchrun ... -m torchturbo tune` measures them",
            None,
        )
    return "ok", text, None


CHECKS: dict[str, Callable[[Findings], Verdict]] = {
    "DataLoader configuration": _dataloader,
    "preprocessing on the device": _preprocessing,
    "memory-mapped files": _memmap,
    "mixed precision": _mixed_precision,
    "operator fusion": _fusion,
    "channels_last": _channels_last,
    "gradient accumulation": _accumulation,
    "dynamic batching": _dynamic_batching,
    "activation checkpointing": _checkpointing,
    "custom kernels": _kernels,
    "TensorCore alignment": _alignment,
    "distributed strategy": _distributed,
    "profiler bottlenecks": _profiler,
    "memory analysis": _memory,
    "communication efficiency": _communication,
}
