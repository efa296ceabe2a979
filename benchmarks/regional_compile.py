"""Regional against whole-model compile on a decoder of identical blocks: one-time cost and step.

The model is a Hugging Face ``LlamaForCausalLM`` built from a config (``--layers`` identical
decoder layers, small widths, no download) on random tokens, trained with AdamW; the loss passes
``use_cache=False``, as training needs no KV cache (left on, each layer's cache entry gives its
block a graph of its own: docs/techniques/regional_compile.md). Three measurements:

* **cold compile**: for each of ``whole`` (``[compile] scope = "model"``) and ``regional``
  (``scope = "blocks"``), a fresh process with an empty cache folder and an empty TMPDIR (where
  inductor keeps its C++ precompiled header and its probe of the CPU) times the engine's setup
  and its first training step; the compile's share is that minus a later step. On a shared
  machine wall time follows the load, so the CPU seconds of the whole process (its compiler
  subprocesses included) are read too, less an eager process's doing the same steps: the
  compile's CPU seconds. ``--rounds`` rounds, the variants in a different order each round.
  ``--machine-warm``: a new model on a machine that has compiled before, the TMPDIR keeping
  inductor's precompiled C++ header and its probe of the CPU's vector instructions
  (``machine_tmp``).
* **the floor**: a fresh process on an empty cache folder compiles a one-op function (forward
  and backward): what any first torch.compile of a process costs whatever the model (importing
  inductor, its cache keys, the vector-ISA probe, the compile workers, two kernels), through
  torchturbo's cache folder and machine-wide probe as the models' compiles go. The summary
  also shows each variant's compile beyond it, the part the model's size decides.
* **warm cache**: a second fresh process on the folder and TMPDIR the cold one filled, as when
  ``train`` follows ``tune`` (``[compile] cache_dir``).
* **per step**: eager, whole and regional side by side in one process (``compare_configs``:
  warm-up, interleaved repeats, medians, spread, throughput ratios to eager).

    python benchmarks/regional_compile.py --rounds 2 --json benchmarks/results/regional_compile.json

``--tune-steps N`` then runs the tuner's compile stage on the same recipe for a job of N steps
(``TuneOptions.planned_steps``) and prints each candidate's verdict: the job objective's choice.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchturbo.base.compiler import use_compile_cache
from torchturbo.config import TurboConfig
from torchturbo.output.results_file import write_results
from torchturbo.recipe import Recipe
from torchturbo.techniques.compile import probe_cpu_machine_wide
from torchturbo.trials.trial import fixed_batches, start_trial
from torchturbo.trials.variants import compare_configs

SCOPES = {"whole": "model", "regional": "blocks"}
VARIANTS = ("eager", *SCOPES)
#: The one-op compile every variant's first compile includes (module docstring).
FLOOR = "floor"
#: Steps timed after the first in a cold or warm process (their median is "a later step").
LATER_STEPS = 5


def _llama(layers: int, hidden: int, vocab: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = (batch["labels"][:, 1:] != -100).sum()  # what the mean is over
    return model(**batch, use_cache=False).loss, tokens


def recipe(args: argparse.Namespace) -> Recipe:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(args.vocab, (64, args.tokens), generator=generator)
    samples = [{"input_ids": row, "labels": row} for row in ids]
    return Recipe(
        name=f"llama-{args.layers}-layers",
        model=lambda: _llama(args.layers, args.hidden, args.vocab),
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        loss_fn=_loss,
        dataset=samples,  # type: ignore[arg-type]
        batch_size=args.batch,
        count_unit="tokens",
    )


def wide_recipe() -> Recipe:
    """The 8-layer decoder at hidden 256 (vocabulary 4,096, batch 4 x 128 tokens) as a recipe
    for the CLI: ``torchturbo tune benchmarks/regional_compile.py:wide_recipe --only compile``
    (docs/techniques/regional_compile.md)."""
    wide = {"layers": 8, "hidden": 256, "vocab": 4096, "tokens": 128, "batch": 4}
    return recipe(argparse.Namespace(**wide))


def _config(variant: str, cache_dir: str = "") -> TurboConfig:
    base = TurboConfig(device="cpu")
    if variant == "eager":
        return base
    return base.replace(
        compile__mode="default", compile__scope=SCOPES[variant], compile__cache_dir=cache_dir
    )


def floor_child(cache: str) -> None:
    """A fresh process's first compile of a one-op function, forward and backward, as JSON:
    through torchturbo's cache folder and its machine-wide probe of the CPU, as the models'."""
    begin = time.perf_counter()
    use_compile_cache(cache)
    probe_cpu_machine_wide(torch.device("cpu"))
    x = torch.randn(64, 64, requires_grad=True)
    torch.compile(_one_op)(x).backward()
    first = time.perf_counter() - begin
    print(json.dumps({"first_s": first, "later_s": 0.0, "applied": {}}))


def child(args: argparse.Namespace) -> None:
    """One fresh process: the first step and ``LATER_STEPS`` more of one variant, as JSON."""
    torch.set_num_threads(args.threads)
    if args.child == FLOOR:
        floor_child(args.cache)
        return
    data = recipe(args)
    trial, first = start_trial(data, _config(args.child, args.cache), fixed_batches(data, 4))
    later = []
    for _ in range(LATER_STEPS):
        begin = time.perf_counter()
        trial.step()
        later.append(time.perf_counter() - begin)
    applied = {name: reason for name, reason in trial.turbo.applied.items()}
    trial.close()
    print(json.dumps({"first_s": first, "later_s": statistics.median(later), "applied": applied}))


def _fresh(
    args: argparse.Namespace, variant: str, folder: Path, tmp: Path | None = None
) -> dict[str, Any]:
    """``child`` in a new process whose only compile caches are ``folder``'s, and ``tmp``'s
    when given (a TMPDIR holding inductor's precompiled header: ``machine_tmp``)."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["TMPDIR"] = str(tmp or folder / "tmp")
    (folder / "tmp").mkdir(exist_ok=True)
    command = [sys.executable, __file__, "--child", variant, "--cache", str(folder / "cache")]
    command += _model_args(args)
    before = _children_cpu_s()
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{variant} failed ({done.returncode}): {done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    result["compile_s"] = result["first_s"] - result["later_s"]
    result["cpu_s"] = _children_cpu_s() - before
    result["load"] = os.getloadavg()[0]
    return result


def _median(values: Iterable[float]) -> float | None:
    """The median, None for none (``--cold-only`` has no warm runs)."""
    found = list(values)
    return statistics.median(found) if found else None


def _children_cpu_s() -> float:
    """CPU seconds of the processes this one has waited for (and theirs, once reaped)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _model_args(args: argparse.Namespace) -> list[str]:
    names = ("layers", "hidden", "vocab", "tokens", "batch", "threads")
    return [item for name in names for item in (f"--{name}", str(getattr(args, name)))]


def _one_op(t: torch.Tensor) -> torch.Tensor:
    return (t.sin() * 2).relu().sum()


def machine_tmp(folder: Path) -> Path:
    """A TMPDIR as on a machine that has compiled before: a throwaway run of the floor's
    process there fills inductor's default folder with what it learns once per machine and
    torch: its precompiled C++ header (about 10 s) and its probe of the CPU's vector
    instructions (about 8 s, kept there by ``probe_cpu_machine_wide``)."""
    tmp = folder / "machine-tmp"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["TMPDIR"] = str(tmp)
    warm_up = [sys.executable, __file__, "--child", FLOOR, "--cache", str(folder / "throwaway")]
    subprocess.run(warm_up, env=env, check=True, capture_output=True)
    return tmp


def one_time_costs(args: argparse.Namespace) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Cold and warm first steps of each compiled variant, and an eager process's (the CPU
    seconds' reference), ``args.rounds`` rounds. With ``--machine-warm`` a cold run's TMPDIR
    holds the precompiled header (``machine_tmp``), its cache folder still empty."""
    measured = (*VARIANTS, FLOOR)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        v: {"cold": [], "warm": []} for v in measured
    }
    with tempfile.TemporaryDirectory() as scratch:
        tmp = machine_tmp(Path(scratch)) if args.machine_warm else None
        for r in range(args.rounds):
            turn = r % len(measured)
            for variant in measured[turn:] + measured[:turn]:
                folder = Path(scratch) / f"round{r}-{variant}"
                folder.mkdir()
                # The warm run reads what the cold one filled (eager, floor: nothing to warm).
                cold_only = variant in ("eager", FLOOR) or args.cold_only
                ways = ("cold",) if cold_only else ("cold", "warm")
                for way in ways:
                    runs[variant][way].append(_fresh(args, variant, folder, tmp))
                    shown = {
                        k: round(v, 2) for k, v in runs[variant][way][-1].items() if k != "applied"
                    }
                    print(f"round {r + 1} {variant} {way}: {shown}", file=sys.stderr, flush=True)
    return runs


def tune_for(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The tuner's compile stage on this recipe, for a job of ``args.tune_steps`` steps."""
    from torchturbo.tune.search.run import TuneOptions, tune

    options = TuneOptions(
        time_budget_s=args.tune_budget,
        planned_steps=args.tune_steps,
        only=("compile",),
        device="cpu",
    )
    _, result = tune(
        recipe(args),
        options,
        on_progress=lambda s, c, left: print(
            f"{s}: {c} ({left:.0f} s left)", file=sys.stderr, flush=True
        ),
    )
    rows = []
    for outcome in result.candidates:
        rows.append(
            {
                "name": outcome.name,
                "verdict": outcome.verdict,
                "reason": outcome.reason,
                "one_time_s": outcome.one_time_s,
                "cold_one_time_s": outcome.cold_one_time_s,
                "break_even_steps": outcome.break_even_steps,
                "job_s": outcome.job_s,
                "reference_job_s": outcome.reference_job_s,
            }
        )
        print(f"{outcome.name}: {outcome.verdict}: {outcome.reason}")
    print(f"adopted: {list(result.adopted)}")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--rounds", type=int, default=2, help="cold/warm rounds per variant")
    parser.add_argument("--repeats", type=int, default=10, help="interleaved per-step rounds")
    parser.add_argument("--tune-steps", type=int, help="also tune the compile stage for this job")
    parser.add_argument("--tune-budget", type=float, default=900.0)
    parser.add_argument("--skip-one-time", action="store_true", help="per-step timing only")
    parser.add_argument("--skip-per-step", action="store_true", help="one-time costs only")
    parser.add_argument("--cold-only", action="store_true", help="no warm-cache runs")
    parser.add_argument(
        "--machine-warm",
        action="store_true",
        help="cold runs keep a TMPDIR holding inductor's precompiled header, as on a machine "
        "that compiled anything before (the model's cache folder still starts empty)",
    )
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--child", choices=sorted((*VARIANTS, FLOOR)), help=argparse.SUPPRESS)
    parser.add_argument("--cache", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return 0
    torch.set_num_threads(args.threads)
    record: dict[str, Any] = {
        "args": {k: v for k, v in vars(args).items() if k not in ("child", "cache", "json")},
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "load_before": os.getloadavg(),
    }
    if not args.skip_one_time:
        runs = one_time_costs(args)
        record["one_time"] = runs
        eager_cpu = statistics.median(r["cpu_s"] for r in runs["eager"]["cold"])
        summary = {
            v: {
                "cold_s": statistics.median(r["compile_s"] for r in runs[v]["cold"]),
                "warm_s": _median(r["compile_s"] for r in runs[v]["warm"]),
                "cold_cpu_s": statistics.median(r["cpu_s"] for r in runs[v]["cold"]) - eager_cpu,
                "warm_cpu_s": _median(r["cpu_s"] - eager_cpu for r in runs[v]["warm"]),
            }
            for v in SCOPES
        }
        floor = statistics.median(r["compile_s"] for r in runs[FLOOR]["cold"])
        for seconds in summary.values():
            seconds["cold_beyond_floor_s"] = seconds["cold_s"] - floor
        record["compile_median"] = summary
        record["floor_s"] = floor
        print(f"{'variant':<9} {'cold s':>7} {'cold CPU s':>10} {'warm s':>7} {'warm CPU s':>10}")
        for variant, seconds in summary.items():
            shown = {k: "n/a" if v is None else f"{v:.1f}" for k, v in seconds.items()}
            print(
                f"{variant:<9} {shown['cold_s']:>7} {shown['cold_cpu_s']:>10} "
                f"{shown['warm_s']:>7} {shown['warm_cpu_s']:>10}"
            )
        whole, regional = summary["whole"], summary["regional"]
        print(
            f"regional / whole, cold: {regional['cold_s'] / whole['cold_s']:.2f} wall, "
            f"{regional['cold_cpu_s'] / whole['cold_cpu_s']:.2f} CPU"
        )
        print(
            f"any first compile of a process (a one-op function): {floor:.1f} s; beyond it, "
            f"regional {regional['cold_beyond_floor_s']:.1f} s, whole "
            f"{whole['cold_beyond_floor_s']:.1f} s: "
            f"{regional['cold_beyond_floor_s'] / whole['cold_beyond_floor_s']:.2f}"
        )
    if args.tune_steps:
        record["tune"] = {"planned_steps": args.tune_steps, "candidates": tune_for(args)}
    if args.skip_per_step:
        _finish(args, record)
        return 0
    configs = {v: _config(v) for v in VARIANTS}
    rows = compare_configs(
        recipe(args),
        configs,
        baseline="eager",
        repeats=args.repeats,
        steps_per_repeat=2,
        on_progress=lambda message: print(message, file=sys.stderr, flush=True),
    )
    record["per_step"] = [row.to_dict() for row in rows]
    print(f"{'variant':<9} {'step ms':>8} {'spread':>7} {'x eager':>7} {'first s':>7} "
          f"{'loss last':>9}")  # fmt: skip
    for row in rows:
        print(
            f"{row.variant:<9} {row.step_ms_median:8.1f} {row.step_ms_spread:6.0%} "
            f"{row.ratio:7.3f} {row.first_step_s:7.1f} {row.loss_last:9.4f}"
        )
    _finish(args, record)
    return 0


def _finish(args: argparse.Namespace, record: dict[str, Any]) -> None:
    record["load_after"] = os.getloadavg()
    if args.json is not None:
        write_results(args.json, record)


if __name__ == "__main__":
    sys.exit(main())
