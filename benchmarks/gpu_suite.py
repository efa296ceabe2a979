"""Every technique on one device in one script, within a time budget: the figures for docs/gpu.md.

Sections, most wanted first, each skipped with its reason when the budget cannot hold it:

- ``peaks``: per number format, native or emulated, the matmul peak measured here beside the
  datasheet's for a known GPU, and the peak MFU is stated against;
- ``triton_op``: the Triton kernel of ``torchturbo::bias_gelu`` on the device against the eager
  reference (values and gradients) and the kernels that ran;
- ``workloads``: each built-in workload's techniques side by side against fp32 eager
  (interleaved, ratios, MFU, memory), float8 and the fused optimizer step among them;
- ``tune_vision``, ``tune_text``: short ``tune`` runs with their confirmed ratios and every
  candidate's verdict (float8 is a candidate on text);
- ``extra:*``: the benchmarks with a device path of their own, each in its own process, whose
  JSON goes into the results: the custom op (Triton on CUDA), the fused optimizer, pinned vs
  pageable copies, DDP comm hooks over NCCL (with two GPUs or more), bucketing, augmentation,
  inference.

Made for a lent CUDA GPU (the default budget keeps an H200 run under 8 minutes, compiles
included; ``--only`` reruns chosen sections); ``--device cpu --quick`` is the dry run a test
executes so that the script cannot rot. Writes gpu_suite.json and gpu_suite.md to ``--out``.

    python benchmarks/gpu_suite.py --device cuda --out benchmarks/results/gpu
    python benchmarks/gpu_suite.py --device cuda --out OUT --only tune_text,extra:custom_kernels
    python benchmarks/gpu_suite.py --device cpu --quick --out /tmp/gpu-dry-run
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

from techniques import variants

from torchturbo.config import TurboConfig
from torchturbo.kernels import bias_gelu, bias_gelu_reference
from torchturbo.measure.datasheet import FORMATS, datasheet_peak_flops
from torchturbo.measure.machine import summary
from torchturbo.measure.native import emulated
from torchturbo.measure.peak import measured_format_peak, stated_peak
from torchturbo.output.results_file import write_results
from torchturbo.output.tables import format_mfu
from torchturbo.techniques.float8 import convertible_linears
from torchturbo.trials.variants import compare_configs
from torchturbo.tune.search.run import TuneOptions, tune
from torchturbo.workloads import get_workload

#: The dry run's workloads: every code path once, at the smallest inputs each one takes.
QUICK_SIZES = {
    "vision": {"image_size": 16},
    "segmentation": {"image_size": 16},
    "text": {"d_model": 64},
}
HERE = Path(__file__).parent
#: Workloads in the order they are measured: vision carries the headline (fast >= 3x on a GPU).
WORKLOADS = ("vision", "text", "segmentation")
#: Seconds of tuning per ``tune_*`` section (the tuner keeps to it; quick: the dry run's).
TUNE_S, QUICK_TUNE_S = 120, 20
#: Default budget: with start-up and the last section's overrun, an H200 run stays under 8 min.
BUDGET_S = 420


@dataclass(frozen=True)
class Extra:
    """A benchmark run in its own process: its arguments ({device} filled in), the extra
    arguments of a quick run, and the seconds it is expected to need on a GPU."""

    arguments: tuple[str, ...]
    quick: tuple[str, ...] = ("--quick",)
    seconds: float = 60


EXTRAS = {
    "custom_kernels": Extra((), seconds=90),  # CPU rows, and CUDA rows (Triton) where present
    "fused_optimizer": Extra(("--device", "{device}"), ("--quick", "--workloads", "text"), 60),
    "host_copies": Extra(("--device", "{device}"), seconds=20),
    "comm_hooks": Extra(("--device", "cuda", "--nproc", "{gpus}"), seconds=120),
    "bucketing": Extra(("--device", "{device}"), seconds=60),
    "augment": Extra(("--device", "{device}"), seconds=60),
    "inference": Extra(("--device", "{device}"), seconds=90),
}


@dataclass
class Run:
    """The suite's state: options, the clock, and the results gathered so far."""

    device: str
    quick: bool
    budget_s: float
    out: Path
    only: frozenset[str] = frozenset()
    #: Leave the compiled variants out (a short session's suite).
    no_compile: bool = False
    started: float = field(default_factory=time.perf_counter)
    results: dict[str, Any] = field(default_factory=dict)

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.started)

    def say(self, message: str) -> None:
        elapsed = time.perf_counter() - self.started
        print(f"[{elapsed:5.0f} s] {message}", file=sys.stderr, flush=True)


def peaks(run: Run) -> dict[str, Any]:
    """Per format: why it is emulated (None: native), measured and datasheet TFLOP/s, and the
    peak MFU is stated against. Emulated formats are not measured (they run on fp32 units)."""
    device = torch.device(run.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    table = {}
    for fmt in FORMATS:
        why = emulated(device, fmt)
        measured = None if why else measured_format_peak(device, fmt)
        sheet = datasheet_peak_flops(name, fmt) if name else None
        table[fmt] = {
            "emulated": why,
            "measured_tflops": None if measured is None else measured / 1e12,
            "datasheet_tflops": None if sheet is None else sheet / 1e12,
            "measured_over_datasheet": measured / sheet if measured and sheet else None,
            "stated": stated_peak(device, fmt).describe(),
        }
    return table


def triton_op(run: Run) -> dict[str, Any]:
    """The op on the device against the reference, fp32 and bf16, forward and backward."""
    if not run.device.startswith("cuda"):
        return {"not_applicable": "the Triton kernel is CUDA's; CPU tests run it interpreted"}
    checks = {}
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(4096, 1024, device=run.device, dtype=dtype, requires_grad=True)
        bias = torch.randn(1024, device=run.device, dtype=dtype, requires_grad=True)
        grad = torch.randn_like(x)
        with torch.profiler.profile(acc_events=True) as profile:  # torch 2.11 warns without
            out = bias_gelu(x, bias)
            out.backward(grad)
            torch.cuda.synchronize()
        got = (out.detach(), x.grad, bias.grad)
        x.grad = bias.grad = None
        bias_gelu_reference(x, bias).backward(grad)
        expected = (bias_gelu_reference(x, bias).detach(), x.grad, bias.grad)
        names = {event.name for event in profile.events()}
        checks[str(dtype)] = {
            "max_abs_diff": [
                float((a.float() - b.float()).abs().max())
                for a, b in zip(got, expected, strict=True)
            ],
            "triton_kernels_ran": sorted(n for n in names if n.startswith("_") and "kernel" in n),
            "eager_gelu_ran": any(n.startswith("aten::gelu") for n in names),
        }
    return checks


def suite_workload(name: str, run: Run) -> Any:
    """The built-in workload ``name`` sized for the device (on a GPU its ``gpu`` size: the small
    sizes only measure launch overhead there), or the dry run's tiny one."""
    if not run.quick:
        return get_workload(name, "auto", device=run.device)
    return get_workload(name, batch_size=4, num_samples=32, **QUICK_SIZES[name])


def suite_variants(recipe: Any, run: Run) -> dict[str, TurboConfig]:
    """The techniques benchmark's variants, plus the fused optimizer step and, where the model
    has Linear layers float8 can convert, float8 on top of bf16."""
    device, quick = run.device, run.quick
    configs = variants(device, with_compile=not (quick or run.no_compile))
    if quick:  # the dry run needs every code path once, not every plain config
        configs = {name: configs[name] for name in ("baseline", "fast (bf16+channels_last)")}
    base = configs["baseline"]
    configs["optimizer:fused"] = base.replace(optimizer__implementation="fused")
    if convertible_linears(recipe.model()):
        configs["float8+bf16"] = base.replace(precision__dtype="bf16", precision__float8=True)
        if not (quick or run.no_compile):
            configs["float8+bf16+compile"] = configs["float8+bf16"].replace(compile__mode="default")
    return configs


def workloads(run: Run) -> dict[str, Any]:
    measured: dict[str, Any] = {}
    for name in WORKLOADS:
        if run.left() < 45 and not run.quick:
            measured[name] = {"skipped": f"{run.left():.0f} s left of the budget"}
            continue
        recipe = suite_workload(name, run)
        rows = compare_configs(
            recipe,
            suite_variants(recipe, run),
            baseline="baseline",
            warmup=1 if run.quick else 3,
            repeats=2 if run.quick else 7,
            steps_per_repeat=1 if run.quick else 5,
        )
        measured[name] = [row.to_dict() | {"workload": recipe.name} for row in rows]
        run.say(f"workload {name} done")
    return measured


def tune_section(workload: str) -> Callable[[Run], dict[str, Any]]:
    def section(run: Run) -> dict[str, Any]:
        options = TuneOptions(
            time_budget_s=QUICK_TUNE_S if run.quick else TUNE_S, device=run.device
        )
        recipe = suite_workload(workload, run)
        tuned = tune(recipe, options)[1].to_dict()
        return {
            "confirmed_ratio": tuned["confirmed_ratio"],
            "confirmation": tuned["confirmation"]["state"],
            "adopted": tuned["adopted"],
            "unit": tuned["unit"],
            "elapsed_s": tuned["elapsed_s"],
            "candidates": [
                {key: row.get(key) for key in ("stage", "name", "verdict", "reason", "ratio")}
                for row in tuned["candidates"]
            ],
        }

    return section


def extra_section(name: str, extra: Extra) -> Callable[[Run], dict[str, Any]]:
    def section(run: Run) -> dict[str, Any]:
        gpus = torch.cuda.device_count() if run.device.startswith("cuda") else 0
        if name == "comm_hooks" and gpus < 2:
            return {"not_applicable": f"DDP comm hooks over NCCL need 2 GPUs or more; {gpus} here"}
        # Its JSON goes into gpu_suite.json; the file itself would only add to what a device
        # session has to bring back (at most 8 files there).
        with tempfile.TemporaryDirectory() as scratch:
            path = Path(scratch) / f"{name}.json"
            command = [sys.executable, str(HERE / f"{name}.py"), "--json", str(path)]
            command += [a.format(device=run.device, gpus=min(gpus, 8)) for a in extra.arguments]
            command += list(extra.quick) if run.quick else []
            timeout = max(30.0, run.left()) if not run.quick else 300.0
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"stopped after {timeout:.0f} s") from None
            if done.returncode != 0:
                raise RuntimeError(done.stderr[-2000:])
            return json.loads(path.read_text())

    return section


#: Section name -> (function, seconds it is expected to need on a GPU), in running order.
SECTIONS: dict[str, tuple[Callable[[Run], Any], float]] = {
    "peaks": (peaks, 15),
    "triton_op": (triton_op, 15),
    "workloads": (workloads, 150),
    "tune_vision": (tune_section("vision"), TUNE_S + 30),
    "tune_text": (tune_section("text"), TUNE_S + 30),
    **{
        f"extra:{name}": (extra_section(name, extra), extra.seconds)
        for name, extra in EXTRAS.items()
    },
}


def run_sections(run: Run) -> None:
    status = run.results.setdefault("sections", {})
    for name, (section, seconds) in SECTIONS.items():
        if run.only and name not in run.only:
            status[name] = {"state": "not selected"}
            continue
        if not run.quick and run.left() < seconds:
            status[name] = {
                "state": "skipped",
                "reason": f"needs ~{seconds:.0f} s, {max(0, run.left()):.0f} s left of the "
                f"{run.budget_s:.0f} s budget: rerun with --only {name}",
            }
            run.say(f"{name}: skipped")
            continue
        run.say(f"{name}: starting")
        begin = time.perf_counter()
        try:
            result = run.results[name] = section(run)
            why = result.get("not_applicable") if isinstance(result, dict) else None
            state = {"state": "not applicable", "reason": why} if why else {"state": "ok"}
        except Exception as error:  # one broken section must not cost the others' figures
            state = {"state": "failed", "reason": f"{type(error).__name__}: {error}"[-2000:]}
        status[name] = {**state, "seconds": time.perf_counter() - begin}
        run.say(f"{name}: {status[name]['state']} in {status[name]['seconds']:.0f} s")


def markdown(results: dict[str, Any]) -> str:
    lines = [
        f"Device: {results['system']['device']}, torch {results['torch']}, CUDA "
        f"{results['system']['cuda']}; {results['elapsed_s']:.0f} s in all "
        f"(budget {results['budget_s']:.0f} s).",
        "",
        "| section | state | seconds | note |",
        "| --- | --- | --- | --- |",
    ]
    for name, state in results["sections"].items():
        seconds = f"{state['seconds']:.0f}" if "seconds" in state else ""
        note = state.get("reason", "").strip().splitlines()[-1:] or [""]
        lines.append(f"| {name} | {state['state']} | {seconds} | {note[0][:120]} |")
    lines += _peaks_markdown(results.get("peaks"))
    lines += _workloads_markdown(results.get("workloads"))
    for name in ("tune_vision", "tune_text"):
        tuned = results.get(name)
        if tuned:
            adopted = ", ".join(tuned["adopted"]) or "nothing"
            lines += [
                "",
                f"`tune` on {name[5:]}: {tuned['confirmation']} {tuned['confirmed_ratio']:.2f}x "
                f"over fp32 eager ({tuned['unit']}) in {tuned['elapsed_s']:.0f} s, adopting "
                f"{adopted}.",
            ]
            lines += [
                f"- {row['name']}: {row['verdict']}: {row['reason']}"
                for row in tuned["candidates"]
                if row["stage"] in ("float8", "optimizer")
            ]
    return "\n".join(lines) + "\n"


def _peaks_markdown(table: dict[str, Any] | None) -> list[str]:
    if not table:
        return []
    lines = [
        "",
        "| format | native | measured TFLOP/s | datasheet TFLOP/s | MFU is against |",
        "| --- | --- | --- | --- | --- |",
    ]
    for fmt, row in table.items():
        measured, sheet = row["measured_tflops"], row["datasheet_tflops"]
        lines.append(
            f"| {fmt} | {'yes' if row['emulated'] is None else 'no: ' + row['emulated']} | "
            f"{'' if measured is None else f'{measured:.3g}'} | "
            f"{'' if sheet is None else f'{sheet:.4g}'} | {row['stated']} |"
        )
    return lines


def _workloads_markdown(measured: dict[str, Any] | None) -> list[str]:
    if not measured:
        return []
    lines = [
        "",
        "| workload | variant | ratio | step ms | MFU | step memory | activations |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for workload, rows in measured.items():
        if isinstance(rows, dict):  # skipped
            lines.append(f"| {workload} | skipped: {rows['skipped']} | | | | | |")
            continue
        for row in rows:
            memory, activations = row["peak_memory_bytes"], row["activation_bytes"]
            lines.append(
                f"| {workload} | {row['variant']} | {row['ratio']:.2f}x | "
                f"{row['step_ms_median']:.1f} | {format_mfu(row['mfu'])} | "
                f"{'n/a' if memory is None else f'{memory / 2**20:.0f} MiB'} | "
                f"{'n/a' if activations is None else f'{activations / 2**20:.0f} MiB'} |"
            )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, required=True, help="directory for JSON + markdown")
    parser.add_argument("--quick", action="store_true", help="dry run: tiny sizes, no compile")
    parser.add_argument(
        "--no-compile", action="store_true", help="leave out the compiled variants (minutes each)"
    )
    parser.add_argument(
        "--budget", type=float, default=BUDGET_S, help=f"seconds (default {BUDGET_S})"
    )
    parser.add_argument(
        "--only", default="", metavar="SECTION,...", help=f"run only these: {', '.join(SECTIONS)}"
    )
    args = parser.parse_args()
    only = frozenset(filter(None, args.only.split(",")))
    unknown = sorted(only - set(SECTIONS))
    if unknown:
        parser.error(
            f"--only {','.join(unknown)}: unknown section(s); choose from {', '.join(SECTIONS)}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    run = Run(args.device, args.quick, args.budget, args.out, only, args.no_compile)
    run.results.update(
        system=summary(), device=args.device, torch=torch.__version__, budget_s=args.budget
    )
    run_sections(run)
    run.results["elapsed_s"] = time.perf_counter() - run.started
    write_results(args.out / "gpu_suite.json", run.results)
    table = markdown(run.results)
    (args.out / "gpu_suite.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
