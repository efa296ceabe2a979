"""Peak resident memory and time of ``Turbo.save`` and ``Turbo.load`` against the state's size.

Each measurement runs in a fresh process (``--child``) that builds an MLP with ``--mib`` MiB of
fp32 parameters, trains one Adam step (so the optimizer holds two more copies: the state is
about 3x the parameters), then resets the kernel's high-water mark of its resident set
(``/proc/self/clear_refs``, Linux) and saves, or loads the checkpoint saved before into a fresh
model. The growth is the high-water mark after the operation less the resident set before it:
what the operation held on top of the live state. Saves and loads alternate (save, load, save,
load...) so that a busy machine slows both alike; medians and spreads are reported.

    python benchmarks/checkpoint_memory.py --mib 128 \
        --json benchmarks/results/checkpoint_memory.json

Run it from the commit to measure: the figures of a previous implementation come from running
this same script on that commit (``PYTHONPATH=<its src>``).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

MIB = 2**20


def _status_kib(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    assert match is not None, f"/proc/self/status has no {field}"
    return int(match[1])


def _engine(mib: int) -> tuple[Any, nn.Module]:
    from torchturbo import Turbo, TurboConfig

    width = 1024  # 4 MiB per fp32 Linear weight
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(max(1, mib // 4))])
    turbo = Turbo(TurboConfig(device="cpu"))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, _, _ = turbo.setup(model, optimizer)
    batch = torch.randn(2, width)
    turbo.step(lambda m, b: m(b).square().mean(), batch)  # Adam's state exists from here on
    return turbo, model


def _state_bytes(turbo: Any) -> int:
    state = turbo.state_dict()
    tensors = list(state["model"].values())
    for per_param in state["optimizer"]["state"].values():
        tensors += [t for t in per_param.values() if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def child(operation: str, directory: str, mib: int) -> dict[str, Any]:
    turbo, _ = _engine(mib)
    state = _state_bytes(turbo)
    torch.set_num_threads(1)
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark is the RSS from now
    before = _status_kib("VmRSS") * 1024
    begin = time.perf_counter()
    if operation == "save":
        turbo.save(directory)
    else:
        turbo.load(directory)
    seconds = time.perf_counter() - begin
    peak = _status_kib("VmHWM") * 1024
    return {"state_bytes": state, "growth_bytes": peak - before, "seconds": seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=128, help="MiB of parameters (default 128)")
    parser.add_argument("--repeats", type=int, default=3, help="saves and loads each (default 3)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--child", choices=("save", "load"), help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.dir, args.mib)))
        return 0
    runs: dict[str, list[dict[str, Any]]] = {"save": [], "load": []}
    with tempfile.TemporaryDirectory(dir=".") as directory:
        for _ in range(args.repeats):
            for operation in ("save", "load"):
                command = [sys.executable, __file__, "--child", operation, "--dir", directory]
                done = subprocess.run(
                    [*command, "--mib", str(args.mib)], capture_output=True, text=True, check=True
                )
                runs[operation].append(json.loads(done.stdout.splitlines()[-1]))
    state = runs["save"][0]["state_bytes"]
    result: dict[str, Any] = {"state_bytes": state, "mib_parameters": args.mib}
    for operation, measured in runs.items():
        growth = [r["growth_bytes"] / state for r in measured]
        seconds = [r["seconds"] for r in measured]
        result[operation] = {
            "growth_over_state": statistics.median(growth),
            "growth_over_state_range": [min(growth), max(growth)],
            "seconds": statistics.median(seconds),
            "seconds_range": [min(seconds), max(seconds)],
            "runs": measured,
        }
        print(
            f"{operation}: peak growth {statistics.median(growth):.2f}x the state "
            f"({state / MIB:.0f} MiB; {min(growth):.2f}-{max(growth):.2f}x), "
            f"{statistics.median(seconds):.2f} s ({min(seconds):.2f}-{max(seconds):.2f})"
        )
    result["torch"] = torch.__version__
    if args.json:
        from torchturbo.output.results_file import write_results

        write_results(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
