"""What benchmarks/faults.py and its row modules share: a fault's row, a process read as it
runs, the train command, and the uninterrupted references a resume is compared with.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchturbo.resume.files import list_checkpoints, read_checkpoint

ROOT = Path(__file__).resolve().parents[1]
MARKED = f"{ROOT / 'tests' / 'recipes' / 'marked.py'}:recipe"
STEPS, SAVE_EVERY = 24, 5
TIMEOUT_S = 300
ENV = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "MARKED_STEP_S": "0.05"}
PY = [sys.executable]
TORCHTURBO = [*PY, "-m", "torchturbo"]
TORCHRUN = [*PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
LAUNCH = [*TORCHTURBO, "launch", "--standalone", "--nproc-per-node", "2"]


@dataclass
class Row:
    fault: str
    exit: int | None
    kept: int | None
    trained: int | None
    identical: bool | None
    line: str
    how: str = "real"


class Proc:
    """A process in its own session whose output (stdout and stderr) is read as it comes."""

    def __init__(self, argv: list[Any], env: dict[str, str] | None = None, **popen: Any) -> None:
        self.process = subprocess.Popen(
            [str(a) for a in argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=ENV | (env or {}),
            start_new_session=True,
            **popen,
        )
        self.lines: list[str] = []
        self.changed = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with self.changed:
                self.lines.append(line)
                self.changed.notify_all()
        self.process.stdout.close()
        with self.changed:
            self.changed.notify_all()

    def wait_for(self, pattern: str) -> re.Match[str]:
        regex = re.compile(pattern)

        def found() -> re.Match[str] | None:
            return next((m for line in self.lines if (m := regex.search(line))), None)

        with self.changed:
            self.changed.wait_for(lambda: found() or not self.reader.is_alive(), timeout=TIMEOUT_S)
            match = found()
        if match is None:
            self.kill()
            raise RuntimeError(f"no line matched {pattern!r}:\n{self.output[-3000:]}")
        return match

    def finish(self) -> int:
        status = self.process.wait(timeout=TIMEOUT_S)
        self.reader.join(timeout=TIMEOUT_S)
        return status

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    @property
    def output(self) -> str:
        with self.changed:
            return "".join(self.lines)

    def last_line(self, pattern: str = r"error:|stopped|launch:") -> str:
        lines = [line.strip() for line in self.output.splitlines() if re.search(pattern, line)]
        return lines[-1] if lines else ""


def train(ckpt: Path, *more: Any, steps: int = STEPS, recipe: str = MARKED) -> list[Any]:
    return ["train", recipe, "--device", "cpu", "--steps", steps, "--checkpoint-dir", ckpt, *more]


def run(argv: list[Any], **kwargs: Any) -> Proc:
    proc = Proc(argv, **kwargs)
    proc.finish()
    return proc


def newest(ckpt: Path) -> int | None:
    found = list_checkpoints(ckpt)
    return int(found[0].name.rpartition("-")[2]) if found else None


def state(ckpt: Path) -> dict[str, Any]:
    files = read_checkpoint(list_checkpoints(ckpt)[0])
    return {"model": files["model.pt"], "optimizer": files["optimizer.pt"]}


def equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def micro_steps(proc: Proc) -> int:
    """Micro-steps the run got to (rank 0's), from its markers: one batch per optimizer step."""
    return len(re.findall(r"micro-step \d+ rank 0 ", proc.output))


class Bench:
    """The uninterrupted references and the work directory the faults share."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self._references: dict[str, Any] = {}
        self.unshare = shutil.which("unshare") is not None and os.geteuid() == 0 and _can_mount()

    def dir(self, name: str) -> Path:
        path = self.work / name
        shutil.rmtree(path, ignore_errors=True)
        return path

    def reference(self, ranks: int) -> dict[str, Any]:
        key = f"ranks{ranks}"
        if key not in self._references:
            ckpt = self.dir(f"reference-{ranks}")
            starter = TORCHTURBO if ranks == 1 else [*TORCHRUN, "-m", "torchturbo"]
            proc = run([*starter, *train(ckpt)])
            assert proc.process.returncode == 0, proc.output[-3000:]
            self._references[key] = state(ckpt)
        return self._references[key]

    def resumed_identical(
        self, ckpt: Path, ranks: int = 1, launcher: list[Any] | None = None
    ) -> bool:
        starter = launcher or (TORCHTURBO if ranks == 1 else [*TORCHRUN, "-m", "torchturbo"])
        proc = run([*starter, *train(ckpt, "--resume")])
        if proc.process.returncode != 0:
            raise RuntimeError(f"the resume failed:\n{proc.output[-3000:]}")
        return equal(state(ckpt), self.reference(ranks))


def _can_mount() -> bool:
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
        capture_output=True,
    )
    return probe.returncode == 0


def at_random() -> int:
    """A step to strike at, drawn anew each run (the faults are not tuned to one moment)."""
    return random.Random().randint(3, STEPS - 6)


def in_tmpfs(bench: Bench, options: str, argv: list[Any], keep: Path | None = None) -> Proc:
    """``argv`` with its --checkpoint-dir on a fresh tmpfs mounted with ``options``, in a
    private mount namespace; what it wrote is copied to ``keep`` before the mount goes."""
    mount = bench.dir("mount")
    mount.mkdir(parents=True)
    command = " ".join(f"'{a}'" for a in argv)
    copy = f"; cp -a '{mount}/ckpt' '{keep}'" if keep is not None else ""
    script = (
        f"mount -t tmpfs -o {options} tmpfs '{mount}' && {{ {command}; rc=$?{copy}; exit $rc; }}"
    )
    return run(["unshare", "-m", "sh", "-c", script])
