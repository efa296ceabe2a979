"""Shared fixtures: tiny real models, deterministic seeds."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


#: The stop signals ``train`` handles, as a process started in a terminal finds them.
TERMINAL_STOP_SIGNALS = {
    signal.SIGINT: signal.default_int_handler,
    signal.SIGTERM: signal.SIG_DFL,
    signal.SIGUSR1: signal.SIG_DFL,
    signal.SIGUSR2: signal.SIG_DFL,
}


@contextlib.contextmanager
def terminal_stop_signals() -> Iterator[None]:
    """Within the block the stop signals are as in a terminal; after it, as they were found.

    A suite started in the background by a non-interactive shell (a CI script, ``make test &``)
    inherits SIGINT ignored; Python and ``train`` rightly leave an ignored signal ignored, so a
    test's Ctrl-C would do nothing and the TrainInterrupted its pytest.raises awaits would end
    the whole session later. Fails when the block leaves a handler of its own: restore it.
    """
    found = {
        signum: signal.signal(signum, handler) for signum, handler in TERMINAL_STOP_SIGNALS.items()
    }
    try:
        yield
    finally:
        left = {signum: signal.signal(signum, found[signum]) for signum in TERMINAL_STOP_SIGNALS}
    changed = [signal.Signals(s).name for s, h in left.items() if h != TERMINAL_STOP_SIGNALS[s]]
    assert not changed, f"the test left its own handler for {', '.join(changed)}: restore it"


@pytest.fixture(autouse=True)
def _stop_signals_as_in_a_terminal() -> Iterator[None]:
    with terminal_stop_signals():
        yield


class MLP(nn.Module):
    """Sequential blocks with dropout: checkpointing and accumulation tests use it."""

    def __init__(self, width: int = 16, depth: int = 3, dropout: float = 0.0, classes: int = 5):
        super().__init__()
        self.blocks = nn.Sequential(
            *[
                nn.Sequential(nn.Linear(width, width), nn.Dropout(dropout), nn.ReLU())
                for _ in range(depth)
            ]
        )
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


class ConvNet(nn.Module):
    """A small conv classifier for layout and precision tests."""

    def __init__(self, classes: int = 4):
        super().__init__()
        self.features = nn.Sequential(
            nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU()),
            nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU()),
        )
        self.head = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


def cpu_stage_context(recipe, *, facts=None, **overrides):
    """A tuner ``StageContext`` on CPU with neutral facts (``facts`` overrides some of them), to
    call one stage directly."""
    from torchturbo.config import TurboConfig
    from torchturbo.techniques.framework.facts import Facts
    from torchturbo.techniques.framework.proposal import StageContext

    neutral = dict(
        device="cpu",
        gemm_speedup={},
        emulated={},
        padding=None,
        has_convolutions=False,
        conv_share=0.0,
        leaf_modules=0,
        shapes_vary=False,
    )
    fields = dict(
        recipe=recipe,
        best=TurboConfig(device="cpu"),
        device=torch.device("cpu"),
        facts=Facts(**{**neutral, **(facts or {})}),
        best_memory_bytes=None,
        memory_budget=None,
    )
    return StageContext(**{**fields, **overrides})


def classification_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]):
    inputs, targets = batch
    return nn.functional.cross_entropy(model(inputs), targets)


def torchrun_two(args: list[str], timeout_s: float = 120) -> str:
    """Run ``python -m torch.distributed.run --nproc-per-node 2 *args`` on 2 local gloo
    processes; return the combined output. A hang or a non-zero exit fails the test.

    --standalone makes torchrun pick a free port itself, so parallel runs do not collide.
    """
    import os
    import signal
    import subprocess
    import sys

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", *args]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    # A new session so that on timeout the whole group (torchrun and its workers) is killed.
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"2-process run hung for {timeout_s}s:\n{output.decode()[-8000:]}")
    text = output.decode()
    assert process.returncode == 0, text[-8000:]
    return text


def run_two_ranks(script, out_dir, timeout_s: float = 120) -> tuple[list[dict], str]:
    """Run ``script out_dir`` under :func:`torchrun_two`; each rank writes ``rank{r}.json``
    into ``out_dir``. Returns those and the combined output."""
    import json

    text = torchrun_two([str(script), str(out_dir)], timeout_s)
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)], text


def edit_checkpoint_json(checkpoint: Path, name: str, edit) -> None:
    """Edit JSON file ``name`` of one checkpoint directory by hand (``edit(data)`` changes it in
    place) and update the manifest's checksum to match, as a user editing it carefully would."""
    import hashlib
    import json

    data = json.loads((checkpoint / name).read_text())
    edit(data)
    (checkpoint / name).write_text(json.dumps(data))
    if name != "manifest.json":
        manifest = json.loads((checkpoint / "manifest.json").read_text())
        manifest["files"][name] = hashlib.sha256((checkpoint / name).read_bytes()).hexdigest()
        (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def _windows_faster_with(monkeypatch, faster) -> None:
    """Every measured in-run window's seconds made proportional to its work, windows whose
    config ``faster(config)`` says taking half: the job's steps then decide at once. No
    compile is built aside (at these seconds a build would look worth it, and take the test's),
    and the batch plan stays as the facts chose it (``test_chunked_plan.py`` measures it)."""
    from torchturbo.engine import in_run
    from torchturbo.engine.in_run import InRunTuner
    from torchturbo.techniques import compile as compile_technique

    monkeypatch.setattr(compile_technique, "SECONDS_PER_LEAF", float("inf"))
    monkeypatch.setattr(in_run, "PLAN_MEASURED_BELOW", 0.0)

    real = InRunTuner.window_done

    def timed(self, side, seconds, work):
        scale = 0.5 if faster(self.config_of(side)) else 1.0
        return real(self, side, scale * work / 100, work)

    monkeypatch.setattr(InRunTuner, "window_done", timed)


def _gemm_rates(monkeypatch, bf16: float) -> None:
    """This machine's matrix products measured at ``bf16`` times fp32's in bf16 and fp16."""
    from torchturbo.techniques.framework import facts

    monkeypatch.setattr(facts, "gemm_speedups", lambda device: {"bf16": bf16, "fp16": bf16})
    monkeypatch.setattr(
        facts, "emulated_precisions", lambda device: {"fp16": "no fp16 units", "tf32": "no TF32"}
    )


@pytest.fixture
def fast_bf16(monkeypatch):
    """Tuning inside a run made deterministic: bf16 matrix products measured 4x fp32's (so the
    facts start runs on bf16), and bf16 windows taking half (so the job's steps adopt it)."""
    _gemm_rates(monkeypatch, 4.0)
    _windows_faster_with(monkeypatch, lambda config: config.precision.dtype == "bf16")


@pytest.fixture
def fast_chunked_loss(monkeypatch):
    """bf16 measured slow (nothing starts on it), windows with the chunked loss taking half."""
    _gemm_rates(monkeypatch, 0.5)
    _windows_faster_with(monkeypatch, lambda config: config.chunked_loss.enabled)
