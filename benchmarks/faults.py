"""Faults and operator mistakes, each met by fresh processes: how the run ends, what it keeps,
and whether its resume is the uninterrupted run, bit for bit.

    python benchmarks/faults.py --json benchmarks/results/faults.json

Every row trains ``tests/recipes/marked.py`` (a conv classifier with Adam whose micro-steps print
a marker, 50 ms each) through ``torchturbo train``, ``torchturbo launch`` or ``torchrun`` on 2
gloo ranks, or a Hugging Face / Lightning run (``benchmarks/faults_trainers.py``), and meets
one fault at a marker drawn at random. Columns:

- **exit**: the status of the process the fault hit (the launcher's under torchrun);
- **kept / trained**: the optimizer step of the newest checkpoint after the fault, and the
  steps trained when it struck (a refusal before the first step trains 0);
- **resume identical**: the resumed run's final weights and optimizer state equal an
  uninterrupted run's, tensor by tensor (``torch.equal``); n/a where nothing is to resume.

Real where this machine allows it: a read-only file system and a full disk are tmpfs mounts in
a private mount namespace (``unshare -m``, as root), and a directory without write permission
is written by root without ``CAP_DAC_OVERRIDE`` (``setpriv``). Without ``unshare`` the full disk
is simulated (a writer that fails with ENOSPC past a byte budget, raised inside ``torch.save``
as a disk would) and the read-only row is left out; the **how** column says which.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from fault_runs import (
    LAUNCH,
    PY,
    ROOT,
    SAVE_EVERY,
    TIMEOUT_S,
    TORCHRUN,
    TORCHTURBO,
    Bench,
    Proc,
    Row,
    at_random,
    equal,
    in_tmpfs,
    micro_steps,
    newest,
    run,
    state,
    train,
)
from faults_data import DATA_FAULTS
from faults_tune import TUNE_FAULTS

from torchturbo.resume.files import MANIFEST, list_checkpoints

BROKEN = ROOT / "tests" / "recipes" / "broken.py"
TRAINERS = ROOT / "benchmarks" / "faults_trainers.py"


# --- the faults --------------------------------------------------------------------------------


def signal_mid_run(bench: Bench, signum: int) -> Row:
    ckpt, at = bench.dir(f"signal-{signum}"), at_random()
    proc = Proc([*TORCHTURBO, *train(ckpt, "--save-every", SAVE_EVERY)])
    proc.wait_for(rf"micro-step {at} ")
    os.kill(proc.process.pid, signum)
    status = proc.finish()
    name, kept = signal.Signals(signum).name, newest(ckpt)
    return Row(
        f"{name} to train at step {at}",
        status,
        kept,
        at,
        bench.resumed_identical(ckpt),
        proc.last_line(r"stopped") or f"(killed: the checkpoint of step {kept} is kept)",
    )


def second_run(bench: Bench) -> Row:
    """The second launched while the first trains (its steps slowed to outlast the second's
    start), on the same directory; the first must end as if alone."""
    ckpt = bench.dir("second-run")
    slow = {"MARKED_STEP_S": "1.0"}
    first = Proc([*TORCHTURBO, *train(ckpt, "--save-every", SAVE_EVERY)], env=slow)
    first.wait_for(r"micro-step 3 ")
    second = run([*TORCHTURBO, *train(ckpt, "--save-every", SAVE_EVERY)])
    still_training = first.process.poll() is None
    first_status = first.finish()
    identical = still_training and first_status == 0 and equal(state(ckpt), bench.reference(1))
    return Row(
        "a second train on the same --checkpoint-dir",
        second.process.returncode,
        newest(ckpt),
        micro_steps(second),
        identical,
        second.last_line(),
    )


def read_only(bench: Bench) -> Row | None:
    if not bench.unshare:
        return None
    mount = bench.work / "mount"
    proc = in_tmpfs(bench, "size=1m,ro", [*TORCHTURBO, *train(mount / "ckpt")])
    return Row(
        "--checkpoint-dir on a read-only file system",
        proc.process.returncode,
        None,
        micro_steps(proc),
        None,
        proc.last_line(),
    )


def under_a_file(bench: Bench) -> Row:
    base = bench.dir("under-a-file")
    base.mkdir()
    (base / "notes.txt").write_text("")
    proc = run([*TORCHTURBO, *train(base / "notes.txt" / "ckpt")])
    return Row(
        "--checkpoint-dir under a file",
        proc.process.returncode,
        None,
        micro_steps(proc),
        None,
        proc.last_line(),
    )


def no_permission(bench: Bench) -> Row:
    ckpt = bench.dir("read-only-dir")
    ckpt.mkdir(mode=0o555)
    ckpt.chmod(0o555)
    prefix: list[Any] = []
    how = "real"
    if os.geteuid() == 0 and shutil.which("setpriv"):  # root writes a mode 555 directory anyway
        dropped = "-dac_override,-dac_read_search"
        prefix = ["setpriv", f"--bounding-set={dropped}", f"--inh-caps={dropped}", "--"]
        how = "real (root without CAP_DAC_OVERRIDE)"
    proc = run([*prefix, *TORCHTURBO, *train(ckpt)])
    return Row(
        "--checkpoint-dir without write permission",
        proc.process.returncode,
        None,
        micro_steps(proc),
        None,
        proc.last_line(),
        how,
    )


def full_disk(bench: Bench) -> Row:
    """Room for the first checkpoint (step 5) and not the second (step 10)."""
    one = bench.dir("one-checkpoint")
    assert run([*TORCHTURBO, *train(one, steps=SAVE_EVERY)]).process.returncode == 0
    size = sum(p.stat().st_size for p in list_checkpoints(one)[0].iterdir())
    blocks = sum(-(-p.stat().st_size // 4096) for p in list_checkpoints(one)[0].iterdir())
    kept = bench.dir("full-disk-kept")
    if bench.unshare:
        mount = bench.work / "mount"
        room = (blocks + 4) * 4096  # one checkpoint's pages and the directories', not two
        argv = [*TORCHTURBO, *train(mount / "ckpt", "--save-every", SAVE_EVERY)]
        proc = in_tmpfs(bench, f"size={room}", argv, keep=kept)
        how = f"real (a {room // 1024} KiB tmpfs)"
    else:
        budget = size + size // 2
        wrapper = (
            "import errno, os, runpy, sys\n"
            "from torchturbo.resume import files\n"
            f"room = [{budget}]\n"
            "class Full:\n"
            "    def __init__(self, h): self.h = h\n"
            "    def write(self, data):\n"
            "        n = memoryview(data).nbytes\n"
            "        if n > room[0]: raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))\n"
            "        room[0] -= n\n"
            "        return self.h.write(data)\n"
            "    def __getattr__(self, name): return getattr(self.h, name)\n"
            "    def __enter__(self): return self\n"
            "    def __exit__(self, *e): self.h.close()\n"
            "files.open = lambda path, mode: Full(open(path, mode))\n"
            "sys.argv = ['torchturbo', *sys.argv[1:]]\n"
            "runpy.run_module('torchturbo', run_name='__main__')\n"
        )
        proc = run([*PY, "-c", wrapper, *train(kept, "--save-every", SAVE_EVERY)])
        how = f"simulated (ENOSPC past {budget // 1024} KiB written)"
    return Row(
        "a full disk during the second save",
        proc.process.returncode,
        newest(kept),
        micro_steps(proc),
        bench.resumed_identical(kept) if newest(kept) else None,
        proc.last_line(),
        how,
    )


def empty_samples(bench: Bench) -> Row:
    proc = run([*TORCHTURBO, *train(bench.dir("empty"), recipe=f"{BROKEN}:empty_texts")])
    return Row(
        "a text dataset whose samples are all of length 0",
        proc.process.returncode,
        None,
        0,
        None,
        proc.last_line(),
    )


def nan_inputs(bench: Bench) -> Row:
    proc = run([*TORCHTURBO, *train(bench.dir("nan"), recipe=f"{BROKEN}:nan_inputs", steps=6)])
    return Row("NaN inputs", proc.process.returncode, None, None, None, proc.last_line())


def damaged_newest(bench: Bench, damage: str) -> Row:
    ckpt = bench.dir(f"damaged-{damage.split()[0]}")
    made = run([*TORCHTURBO, *train(ckpt, "--save-every", SAVE_EVERY, steps=2 * SAVE_EVERY)])
    assert made.process.returncode == 0, made.output[-3000:]
    newest_dir = list_checkpoints(ckpt)[0]
    if damage == "manifest":
        manifest = json.loads((newest_dir / MANIFEST).read_text())
        del manifest["files"]["model.pt"]
        (newest_dir / MANIFEST).write_text(json.dumps(manifest))
    else:
        target = newest_dir / "model.pt"
        target.write_bytes(target.read_bytes()[:100])
    proc = run([*TORCHTURBO, *train(ckpt, "--resume")])
    resumed = re.search(r"resumed from \S+ckpt-(\d+)", proc.output)
    identical = proc.process.returncode == 0 and equal(state(ckpt), bench.reference(1))
    fault = (
        "a manifest missing its model.pt entry"
        if damage == "manifest"
        else "a truncated model.pt in the newest checkpoint"
    )
    return Row(
        fault,
        proc.process.returncode,
        int(resumed[1]) if resumed else None,
        2 * SAVE_EVERY,
        identical,
        proc.last_line(r"warning:"),
    )


def another_world(bench: Bench) -> Row:
    ckpt = bench.dir("world")
    assert run([*TORCHTURBO, *train(ckpt, steps=3)]).process.returncode == 0
    proc = run([*TORCHRUN, "-m", "torchturbo", *train(ckpt, "--resume", steps=8)])
    carried = proc.last_line(r"carried over")
    return Row(
        "resumed on 2 ranks from 1 mid-epoch",
        proc.process.returncode,
        3,
        3,
        None,
        carried,
    )


def launcher_signal(bench: Bench, signum: int, launcher: list[Any], name: str) -> Row:
    ckpt, at = bench.dir(f"launch-{signum}-{len(launcher)}"), at_random()
    proc = Proc([*launcher, *train(ckpt, "--save-every", SAVE_EVERY)], env={"MARKED_STEP_S": "0.1"})
    workers = [int(proc.wait_for(rf"micro-step {at} rank {r} pid (\d+)")[1]) for r in (0, 1)]
    os.kill(proc.process.pid, signum)
    status = proc.process.wait(timeout=TIMEOUT_S)
    for pid in workers:  # orphaned workers end on their own
        for _ in range(TIMEOUT_S * 10):
            if not _alive(pid):
                break
            time.sleep(0.1)
    proc.reader.join(timeout=TIMEOUT_S)
    resume_with = launcher if launcher[:3] == LAUNCH[:3] else [*TORCHRUN, "-m", "torchturbo"]
    kept = newest(ckpt)
    return Row(
        name,
        status,
        kept,
        at,
        bench.resumed_identical(ckpt, ranks=2, launcher=resume_with) if kept else None,
        proc.last_line(r"launch:|stopped after"),
    )


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def trainer_signal(bench: Bench, trainer: str) -> Row | None:
    try:
        __import__("transformers" if trainer == "hf" else "lightning")
    except ImportError:
        return None
    out = bench.dir(f"trainer-{trainer}")
    full = run([*PY, TRAINERS, trainer, "--out", out / "full"])
    assert full.process.returncode == 0, full.output[-3000:]
    at = random.Random().randint(3, 8)
    proc = Proc([*PY, TRAINERS, trainer, "--out", out / "run"])
    proc.wait_for(rf"^step {at}$")
    os.kill(proc.process.pid, signal.SIGTERM)
    status = proc.finish()
    saved = re.search(r"stopped after optimizer step (\d+)", proc.output)
    resumed = run([*PY, TRAINERS, trainer, "--out", out / "run", "--resume"])
    identical = resumed.process.returncode == 0 and equal(
        torch.load(out / "full" / "final.pt"), torch.load(out / "run" / "final.pt")
    )
    label = (
        "TurboTrainer (Hugging Face)" if trainer == "hf" else "Lightning (TurboLightningCallback)"
    )
    return Row(
        f"SIGTERM to {label} at step {at}",
        status,
        int(saved[1]) if saved else None,
        at,
        identical,
        proc.last_line(r"stopped after"),
    )


def packing(bench: Bench) -> Row:
    argv = ["train", "--workload", "text", "--device", "cpu", "--steps", "2"]
    argv += ["--data.batches", "packed"]
    proc = run([*TORCHTURBO, *argv])
    return Row(
        "train --workload text --data.batches packed",
        proc.process.returncode,
        None,
        None,
        None,
        proc.last_line(r"error:") or "(trained: no isolation check refused it)",
    )


FAULTS: dict[str, Callable[[Bench], Row | None]] = {
    "sigterm": lambda b: signal_mid_run(b, signal.SIGTERM),
    "sigkill": lambda b: signal_mid_run(b, signal.SIGKILL),
    "second-run": second_run,
    "read-only": read_only,
    "under-a-file": under_a_file,
    "no-permission": no_permission,
    "full-disk": full_disk,
    "empty-samples": empty_samples,
    "nan-inputs": nan_inputs,
    "manifest": lambda b: damaged_newest(b, "manifest"),
    "truncated": lambda b: damaged_newest(b, "truncated"),
    "world-size": another_world,
    "launch-sigusr1": lambda b: launcher_signal(
        b, signal.SIGUSR1, [*LAUNCH, "-m", "torchturbo"], "SIGUSR1 to torchturbo launch (2 ranks)"
    ),
    "launch-sigkill": lambda b: launcher_signal(
        b, signal.SIGKILL, [*LAUNCH, "-m", "torchturbo"], "SIGKILL to torchturbo launch (2 ranks)"
    ),
    "torchrun-sigusr1": lambda b: launcher_signal(
        b, signal.SIGUSR1, [*TORCHRUN, "-m", "torchturbo"], "SIGUSR1 to torchrun's agent (2 ranks)"
    ),
    "hf": lambda b: trainer_signal(b, "hf"),
    "lightning": lambda b: trainer_signal(b, "lightning"),
    "packing": packing,
    **TUNE_FAULTS,
    **DATA_FAULTS,
}


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return str(value)


def print_table(rows: list[Row]) -> None:
    print(f"{'fault':<56} {'exit':>5} {'kept/trained':>13}  {'resume identical':<16} how")
    for row in rows:
        kept = f"{_cell(row.kept)}/{_cell(row.trained)}"
        identical = "n/a" if row.identical is None else _cell(row.identical)
        print(f"{row.fault:<56} {_cell(row.exit):>5} {kept:>13}  {identical:<16} {row.how}")
    print()
    for row in rows:
        print(f"{row.fault}: {row.line}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help=f"comma-separated faults of {', '.join(FAULTS)}")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    chosen = args.only.split(",") if args.only else list(FAULTS)
    unknown = sorted(set(chosen) - FAULTS.keys())
    if unknown:
        parser.error(f"unknown faults {unknown}; choose from {', '.join(FAULTS)}")
    begin = time.perf_counter()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as work:
        bench = Bench(Path(work))
        for name in chosen:
            row = FAULTS[name](bench)
            if row is not None:
                rows.append(row)
                print(f"{row.fault}: exit {row.exit}, kept {row.kept}", flush=True)
    print()
    print_table(rows)
    seconds = time.perf_counter() - begin
    print(f"\n{len(rows)} faults in {seconds:.0f} s")
    if args.json:
        from torchturbo.output.results_file import write_results

        write_results(
            args.json,
            {"rows": [asdict(row) for row in rows], "seconds": seconds, "torch": torch.__version__},
        )
    return 0 if all(row.identical is not False for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
