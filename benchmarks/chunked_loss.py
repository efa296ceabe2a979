"""Peak memory and step time of an LM head's loss: the plain head against the chunked loss.

One step is the head alone, where the two differ: hidden states ``[tokens x hidden]`` through a
``[vocab x hidden]`` head to the mean cross-entropy, then the backward into the hidden states and
the weight (the body below the head is the same in both and left out). Per vocabulary:

* peak memory: what the step adds on top of what is alive before it, measured by
  ``torchturbo.measure.memory.track_peak_memory``: on CPU the resident set's high-water mark
  (``VmHWM``, reset before each step), on CUDA the allocator's peak. Not the bytes saved for
  backward (``activation_bytes``): the plain head's largest moment is in its backward (the
  logits' gradient beside the saved softmax), which no saved-tensor count sees. Variants
  alternate, ``--repeats`` times each; medians and ranges;
* step time, interleaved (``measure_interleaved``; the peak steps before it are the warm-up),
  as a ratio;
* the loss and the gradients of both, compared in the same run (float32, relative 1e-5).

Liger-Kernel's fused linear cross-entropy is measured beside them where it is installed and
CUDA is present; elsewhere its row says why it was skipped.

    python benchmarks/chunked_loss.py --json benchmarks/results/chunked_loss-cpu.json
"""

from __future__ import annotations

import argparse
import gc
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from torchturbo.measure.memory import track_peak_memory
from torchturbo.measure.timing import measure_interleaved
from torchturbo.techniques.tools.linear_cross_entropy import CHUNK_TOKENS, linear_cross_entropy

MIB = 2**20
#: Relative difference allowed between the plain and the chunked loss and gradients (float32
#: sums in another order).
TOLERANCE = 1e-5

Step = Callable[[], list[torch.Tensor]]


def _inputs(
    tokens: int, hidden: int, vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    states = torch.randn(tokens, hidden, generator=generator).to(device).requires_grad_()
    weight = (torch.randn(vocab, hidden, generator=generator) / hidden**0.5).to(device)
    labels = torch.randint(vocab, (tokens,), generator=generator).to(device)
    labels[::10] = -100  # padding, as a batch of documents has
    return states, weight.requires_grad_(), labels


def _step(loss_fn: Callable[[], torch.Tensor], *leaves: torch.Tensor) -> Step:
    """Forward and backward; returns the loss and the leaves' gradients."""

    def step() -> list[torch.Tensor]:
        for leaf in leaves:
            leaf.grad = None
        loss = loss_fn()
        loss.backward()
        return [loss.detach(), *(leaf.grad for leaf in leaves if leaf.grad is not None)]

    return step


def _variants(
    states: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int
) -> tuple[dict[str, Step], str]:
    variants = {
        "plain head": _step(
            lambda: F.cross_entropy(F.linear(states, weight).float(), labels), states, weight
        ),
        "chunked loss": _step(
            lambda: linear_cross_entropy(states, weight, labels, chunk_tokens=chunk_tokens),
            states,
            weight,
        ),
    }
    liger, why = _liger()
    if liger is not None:
        variants["Liger-Kernel"] = _step(lambda: liger(weight, states, labels), states, weight)
    return variants, why


def _liger() -> tuple[Any, str]:
    """Liger-Kernel's fused linear cross-entropy, or why it is not measured."""
    if not torch.cuda.is_available():
        return None, "Liger-Kernel: skipped, its kernels need CUDA and this machine has none"
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None, "Liger-Kernel: skipped, not installed (pip install liger-kernel)"
    return LigerFusedLinearCrossEntropyLoss(), ""


def _peaks(variants: dict[str, Step], device: torch.device, repeats: int) -> dict[str, Any]:
    """Each variant's peak growth over ``repeats`` alternating steps, and its first results."""
    growth: dict[str, list[int]] = {name: [] for name in variants}
    results: dict[str, list[torch.Tensor]] = {}
    for _ in range(repeats):
        for name, step in variants.items():
            gc.collect()
            with track_peak_memory(device) as peak:
                out = step()
            growth[name].append(peak.peak_bytes - peak.baseline_bytes)
            results.setdefault(name, [t.detach().clone() for t in out])
            del out
    return {"growth": growth, "results": results, "kind": peak.kind}


def _difference(got: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    return max(
        float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12))
        for a, b in zip(got, expected, strict=True)
    )


def measure(args: argparse.Namespace, vocab: int, device: torch.device) -> dict[str, Any]:
    states, weight, labels = _inputs(args.tokens, args.hidden, vocab, device)
    variants, skipped = _variants(states, weight, labels, args.chunk_tokens)
    peaks = _peaks(variants, device, args.repeats)
    timings = measure_interleaved(
        variants, device=device, warmup=0, repeats=args.repeats, steps_per_repeat=1
    )
    plain = "plain head"
    row: dict[str, Any] = {"vocab": vocab, "peak_kind": peaks["kind"], "variants": {}}
    base_peak = statistics.median(peaks["growth"][plain])
    base_time = timings[plain].median
    for name in variants:
        growth = peaks["growth"][name]
        row["variants"][name] = {
            "peak_growth_bytes": statistics.median(growth),
            "peak_growth_range": [min(growth), max(growth)],
            "peak_ratio": statistics.median(growth) / base_peak,
            "step_s": timings[name].median,
            "step_s_range": [min(timings[name].samples), max(timings[name].samples)],
            "time_ratio": timings[name].median / base_time,
            "difference": _difference(peaks["results"][name], peaks["results"][plain]),
        }
    row["skipped"] = skipped
    return row


def _print(row: dict[str, Any], tokens: int) -> None:
    logits = tokens * row["vocab"] * 4 / MIB
    print(f"vocab {row['vocab']}: float32 logits {logits:.0f} MiB ({row['peak_kind']})")
    for name, v in row["variants"].items():
        low, high = (b / MIB for b in v["peak_growth_range"])
        print(
            f"  {name:13} peak +{v['peak_growth_bytes'] / MIB:6.0f} MiB ({low:.0f}-{high:.0f})"
            f"  {v['peak_ratio']:5.2f}x   step {v['step_s'] * 1e3:7.0f} ms"
            f"  {v['time_ratio']:5.2f}x   difference {v['difference']:.1e}"
        )
    if row["skipped"]:
        print(f"  {row['skipped']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per step (1024)")
    parser.add_argument("--hidden", type=int, default=128, help="hidden size (128)")
    parser.add_argument("--chunk-tokens", type=int, default=CHUNK_TOKENS)
    parser.add_argument("--repeats", type=int, default=3, help="measured steps each (3)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    device = torch.device(args.device)
    rows = []
    for vocab in args.vocab:
        rows.append(measure(args, vocab, device))
        _print(rows[-1], args.tokens)
    failed = [
        (row["vocab"], name)
        for row in rows
        for name, v in row["variants"].items()
        if v["difference"] > TOLERANCE
    ]
    for vocab, name in failed:
        print(f"FAILED: {name} at vocab {vocab} differs from the plain head by > {TOLERANCE:g}")
    if args.json:
        from torchturbo.output.results_file import write_results

        settings = {k: v for k, v in vars(args).items() if k != "json"}
        write_results(args.json, {"settings": settings, "torch": torch.__version__, "rows": rows})
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
