"""The whole GPU check in one call: the CUDA tests, an HF causal LM tuned on CUDA and its job
against the trainer's own GPU settings, a job that tunes inside itself, and the suite at GPU
sizes, within 8 minutes,
into at most 8 files.

    python3 benchmarks/gpu_session.py --out $OUT      # on the lent GPU (docs/gpu.md: the call)
    python3 benchmarks/gpu_session.py --plan          # the parts, their commands and limits

Parts run in order of what they prove, each in its own process, stopped at a limit sized from
its estimate (:data:`PARTS`: seconds on an H200, from the first run's figures and the budgets the
part passes on) and never beyond what is left of :data:`TOTAL_S`; a part that overruns is
recorded as such and the next one still runs (the first run lost two jobs to a fixed 60-s
timeout, and with them the comparison). The last part, the suite, gets what is left as its own
budget. Files written to ``--out``: session.json (each part's state, seconds and limit),
pytest_cuda.txt, tuner_scale.txt, tuner_scale.json, in_run.txt, in_run_results.json, gpu_suite.json
and gpu_suite.md. Hand-written: a few subprocesses with timeouts, no runner to take.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: The whole session, start-up of each part included: a lent GPU's 15 minutes hold it, a start
#: and one rerun of a part.
TOTAL_S = 480
#: A part may take this many times its estimate before it is stopped.
SLACK = 1.5
#: The suite's budget is what is left, less this for its start-up and its report.
SUITE_MARGIN_S = 25
#: With less than this left, a part is skipped: nothing starts and finishes in less.
MIN_PART_S = 10


@dataclass(frozen=True)
class Part:
    """One step of the session: its command (``{out}`` and ``{scratch}`` filled in), the
    seconds it is expected to take on an H200, the file its output goes to, and the files it
    writes into the scratch folder to keep (scratch name -> name in ``--out``)."""

    name: str
    command: tuple[str, ...]
    estimate_s: float
    log: str | None = None
    keep: dict[str, str] = field(default_factory=dict)
    #: It takes what is left of the session (its ``{budget}``), not its estimate's limit.
    rest: bool = False


PYTHON = sys.executable
#: The test files with CUDA tests (``tests/test_gpu_session.py`` keeps the list whole): only
#: these are collected, since the others import test extras the lent machine lacks.
CUDA_TESTS = (
    "tests/test_augment.py",
    "tests/test_device_busy.py",
    "tests/test_kernels_triton.py",
    "tests/test_measure.py",
    "tests/test_precision.py",
)
PARTS = (
    Part(
        "cuda_tests",
        (PYTHON, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", *CUDA_TESTS),
        estimate_s=50,
        log="pytest_cuda.txt",
    ),
    Part(
        "llm_jobs",
        (
            *(PYTHON, "benchmarks/tuner_scale.py", "--device", "cuda", "--model-size", "166m"),
            *("--batch-size", "16", "--setups", "decoder", "--steps", "100", "--skip-grid"),
            *("--tune-budget", "60s", "--out", "{scratch}/scale"),
            *("--json", "{out}/tuner_scale.json"),
        ),
        # tune: 60 s budget + ~40 s start-up and facts; jobs: the tuned one (~40 s) and four
        # of the trainer's (~20 s each, ~70 s with torch_compile) at 100 steps of ~50 ms.
        estimate_s=230,
        log="tuner_scale.txt",
    ),
    Part(
        "in_run",
        (
            *(PYTHON, "-m", "torchturbo", "train", "--workload", "text", "--size", "gpu"),
            *("--device", "cuda", "--steps", "600", "--tune.in_run"),
            *("--tuned-out", "{scratch}/in_run"),
        ),
        # facts ~15 s, start-up ~20 s, 600 steps of ~0.1 s with their measured windows.
        estimate_s=130,
        log="in_run.txt",
        keep={"in_run/results.json": "in_run_results.json"},
    ),
    Part(
        "suite",
        (
            *(PYTHON, "benchmarks/gpu_suite.py", "--device", "cuda", "--out", "{out}"),
            *("--only", "peaks,triton_op,workloads", "--no-compile", "--budget", "{budget}"),
        ),
        estimate_s=60,
        rest=True,
    ),
)


@dataclass
class Session:
    out: Path
    scratch: Path
    total_s: float = TOTAL_S
    started: float = field(default_factory=time.perf_counter)
    parts: dict[str, dict[str, Any]] = field(default_factory=dict)

    def left(self) -> float:
        return self.total_s - (time.perf_counter() - self.started)


def limit_for(part: Part, left: float) -> float:
    """The seconds ``part`` may run: its estimate with slack (or all of it, for the part that
    takes the rest), within what is left."""
    return max(0.0, left if part.rest else min(SLACK * part.estimate_s, left))


def command_of(part: Part, session: Session, limit: float) -> list[str]:
    budget = max(30, int(limit - SUITE_MARGIN_S))
    return [
        arg.format(out=session.out, scratch=session.scratch, budget=budget) for arg in part.command
    ]


def run_part(part: Part, session: Session) -> dict[str, Any]:
    """Run one part, its output to its log, and keep the files it was asked to keep."""
    if session.left() < MIN_PART_S:
        return {"state": "skipped", "reason": f"{session.left():.0f} s left of {session.total_s}"}
    limit = limit_for(part, session.left())
    command = command_of(part, session, limit)
    begin = time.perf_counter()
    log = open(session.out / part.log, "w") if part.log else subprocess.DEVNULL  # noqa: SIM115
    print(f"[{time.perf_counter() - session.started:5.0f} s] {part.name}: {' '.join(command)}")
    try:
        done = subprocess.run(
            command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=limit, check=False
        )
        state = "ok" if done.returncode == 0 else f"failed ({done.returncode})"
    except subprocess.TimeoutExpired:
        state = f"stopped at its limit of {limit:.0f} s"
    finally:
        if part.log:
            log.close()
    for source, target in part.keep.items():
        if (session.scratch / source).is_file():
            shutil.copyfile(session.scratch / source, session.out / target)
    return {"state": state, "seconds": time.perf_counter() - begin, "limit_s": limit}


def run(parts: Sequence[Part], session: Session) -> None:
    for part in parts:
        session.parts[part.name] = run_part(part, session)
        print(f"  {part.name}: {session.parts[part.name]}", flush=True)
        (session.out / "session.json").write_text(
            json.dumps({"total_s": session.total_s, "parts": session.parts}, indent=2)
        )


def files_written(parts: Sequence[Part]) -> list[str]:
    """Every file a session leaves in ``--out``."""
    names = ["session.json"]
    for part in parts:
        names += [part.log] if part.log else []
        names += list(part.keep.values())
    names += ["tuner_scale.json", "gpu_suite.json", "gpu_suite.md"]  # written by the parts
    return names


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="the folder the files go to ($OUT)")
    parser.add_argument("--plan", action="store_true", help="print the parts and limits only")
    parser.add_argument("--only", default="", help="run only these parts, comma-separated")
    args = parser.parse_args()
    chosen = [p for p in PARTS if not args.only or p.name in args.only.split(",")]
    if args.plan:
        for part in chosen:
            limit = limit_for(part, TOTAL_S)
            print(f"{part.name}: ~{part.estimate_s:.0f} s, stopped at {limit:.0f} s")
            print("  " + " ".join(part.command))
        print(f"files: {', '.join(files_written(chosen))}")
        return 0
    if args.out is None:
        parser.error("--out is required (or --plan)")
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        run(chosen, Session(args.out, Path(scratch)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
