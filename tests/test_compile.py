"""torch.compile computes what eager computes, really compiles, and reports a failure.

Compiling costs seconds, so the models are tiny and each compile is shared by several checks.
"Really compiled" is read from dynamo's counters: frames it converted and graphs it captured
(``torch._dynamo.utils.counters``, what torch's own tests read).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from conftest import MLP
from torch import nn

from torchturbo import Turbo, TurboConfig
from torchturbo.techniques.compile import CompileError


def _loss(model, batch):
    return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])


def _train(model: nn.Module, mode: str, steps: int = 3) -> tuple[list[float], Turbo, dict]:
    """Losses of ``steps`` engine steps, the engine, and dynamo's counters over them."""
    from torch._dynamo.utils import counters

    counters.clear()
    turbo = Turbo(TurboConfig(device="cpu").replace(compile__mode=mode))
    fresh = copy.deepcopy(model)
    turbo.setup(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1))
    x, y = torch.randn(8, 32, generator=torch.Generator().manual_seed(0)), torch.arange(8) % 5
    losses = [float(turbo.step(_loss, (x, y)).loss) for _ in range(steps)]
    return losses, turbo, {k: dict(v) for k, v in counters.items()}


def _sequential() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 5))


@pytest.mark.slow
@pytest.mark.parametrize("make", [MLP, _sequential], ids=["custom module", "nn.Sequential"])
def test_compiled_training_step_matches_eager_and_really_compiled(make):
    model = make() if make is _sequential else make(width=32)
    eager, _, eager_counts = _train(model, "off")
    compiled, turbo, counts = _train(model, "default")
    assert turbo.applied["compile"] is None
    assert list(turbo.model.state_dict()) == list(model.state_dict())  # no _orig_mod. prefix
    # Dynamo converted the forward into a graph and compiled it (with its backward)...
    assert counts["frames"]["ok"] >= 1 and counts["stats"]["unique_graphs"] >= 1
    assert counts["aot_autograd"]["ok"] >= 1
    # ...and only once: the next steps reused it. Negative control: eager converts nothing.
    assert counts["frames"]["ok"] == counts["frames"]["total"] == 1
    assert "frames" not in eager_counts
    # Inductor fuses and reorders fp32 reductions: agreement to ~1e-5 relative.
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


class _GraphBreak(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return self.linear(x)


@pytest.mark.slow
def test_a_compile_failure_is_raised_and_reported():
    """fullgraph = true on a model with a graph break: a CompileError naming the failure, and
    the report says compile did not apply."""
    import torch._dynamo

    config = TurboConfig(device="cpu").replace(compile__mode="default", compile__fullgraph=True)
    turbo = Turbo(config)
    model = _GraphBreak()
    turbo.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert turbo.applied["compile"] is None  # compiling is lazy: nothing has failed yet
    with pytest.raises(CompileError, match="failed while compiling: Unsupported"):
        turbo.step(_loss, (torch.randn(4, 32), torch.arange(4)))
    assert turbo.applied["compile"].startswith("failed while compiling: Unsupported")


def test_the_compile_cache_folder_is_inductors_unless_the_user_set_one(tmp_path, monkeypatch):
    from torchturbo.base.compiler import CACHE_ENV, use_compile_cache

    monkeypatch.delenv(CACHE_ENV, raising=False)
    assert use_compile_cache("") is None and CACHE_ENV not in os.environ
    folder = use_compile_cache(str(tmp_path / "cache"))
    assert folder == os.environ[CACHE_ENV] == str((tmp_path / "cache").resolve())
    assert (tmp_path / "cache").is_dir()
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "mine"))
    assert use_compile_cache(str(tmp_path / "cache")) == str(tmp_path / "mine")


@pytest.mark.slow
def test_a_compiled_trials_memory_is_measured_and_counts_what_backward_keeps():
    """Peak memory of a compiled candidate is a figure, not n/a: the compiled graph's saved
    tensors reach the saved-tensor hooks."""
    from test_tune import tiny_recipe

    from torchturbo.trials.trial import fixed_batches, start_trial

    recipe = tiny_recipe()
    batches = fixed_batches(recipe, 2)
    figures = {}
    for mode in ("off", "default"):
        config = TurboConfig(device="cpu").replace(compile__mode=mode)
        trial, _ = start_trial(recipe, config, batches)
        try:
            trial.step()
            figures[mode] = (trial.activation_bytes(), trial.memory_footprint()[0])
        finally:
            trial.close()
    eager_saved, eager_total = figures["off"]
    compiled_saved, compiled_total = figures["default"]
    assert compiled_saved is not None and compiled_total is not None
    # Inductor fuses and recomputes cheap ops, so it may keep less than eager, never nothing.
    assert 0 < compiled_saved <= 1.5 * eager_saved
    assert compiled_total - compiled_saved == eager_total - eager_saved  # same weights + state


def test_the_tuners_compile_cache_leaves_the_environment_as_it_found_it(tmp_path, monkeypatch):
    from torchturbo.base.compiler import CACHE_ENV, compile_cache

    monkeypatch.delenv(CACHE_ENV, raising=False)
    with compile_cache(str(tmp_path / "c")) as folder:
        assert os.environ[CACHE_ENV] == folder
    assert CACHE_ENV not in os.environ
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "mine"))
    with compile_cache(str(tmp_path / "c")) as folder:
        assert folder == str(tmp_path / "mine")
    assert os.environ[CACHE_ENV] == str(tmp_path / "mine")


def test_inductors_own_default_in_the_environment_is_not_taken_for_the_users(tmp_path, monkeypatch):
    """Importing torchao makes inductor write its default folder into the variable: a cache
    folder must still replace it (the first step after tune compiled cold without this)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from torchturbo.base.compiler import CACHE_ENV, use_compile_cache

    monkeypatch.setenv(CACHE_ENV, default_cache_dir())
    assert use_compile_cache(str(tmp_path / "cache")) == str((tmp_path / "cache").resolve())


# A fresh process: inductor remembers its probe of the CPU for the process's life.
_PROBE = """
import sys, torch
from torchturbo.base.compiler import use_compile_cache
from torchturbo.techniques.compile import probe_cpu_machine_wide
use_compile_cache(sys.argv[1])
if sys.argv[2] == "machine-wide":
    probe_cpu_machine_wide(torch.device("cpu"))
from torch._inductor.cpu_vec_isa import pick_vec_isa
print(pick_vec_isa())
"""


def _probe_sources(folder) -> int:
    """Sources of inductor's vector-ISA probe (its test kernel's name) under ``folder``."""
    return sum("__avx_chk_kernel" in p.read_text() for p in folder.rglob("*.cpp"))


@pytest.mark.slow
@pytest.mark.skipif(os.uname().machine not in ("x86_64", "AMD64"), reason="an x86 probe")
def test_the_cpu_probe_is_kept_machine_wide_not_in_each_jobs_cache_folder(tmp_path):
    import subprocess
    import sys

    runs = {}
    for way in ("machine-wide", "inductors-own"):  # no spaces: inductor splits paths
        tmp = tmp_path / way / "tmp"  # inductor's default folder lives under TMPDIR
        tmp.mkdir(parents=True)
        job = tmp_path / way / "job"
        env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
        env["TMPDIR"] = str(tmp)
        command = [sys.executable, "-c", _PROBE, str(job), way]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        runs[way] = (done.stdout.strip(), _probe_sources(job), _probe_sources(tmp))
    isa, in_job, in_machine = runs["machine-wide"]
    assert in_job == 0 and in_machine > 0
    # Negative control: left to inductor, the job's new folder gets the probe (every new job
    # compiles it again), and the same instruction set is picked either way.
    control_isa, control_in_job, _ = runs["inductors-own"]
    assert control_in_job > 0 and control_isa == isa


def test_the_cpu_probe_stays_in_the_jobs_folder_where_inductors_own_cannot_be_made(
    tmp_path, monkeypatch
):
    """A probe that cannot write fails, and inductor then compiles every kernel without vector
    instructions: where its machine-wide folder cannot be made, the job's folder serves."""
    import torch._inductor.cpu_vec_isa as vec_isa
    import torch._inductor.runtime.cache_dir_utils as cache_dir_utils

    from torchturbo.base.compiler import CACHE_ENV, use_compile_cache
    from torchturbo.techniques.compile import probe_cpu_machine_wide

    seen: list[str] = []
    monkeypatch.setattr(vec_isa, "pick_vec_isa", lambda: seen.append(os.environ[CACHE_ENV]))
    monkeypatch.delenv(CACHE_ENV, raising=False)
    job = use_compile_cache(str(tmp_path / "job"))
    machine = tmp_path / "machine"
    monkeypatch.setattr(cache_dir_utils, "default_cache_dir", lambda: str(machine))
    probe_cpu_machine_wide(torch.device("cpu"))
    assert seen == [str(machine)] and os.environ[CACHE_ENV] == job

    (tmp_path / "a-file").write_text("")
    blocked = tmp_path / "a-file" / "inductor"
    monkeypatch.setattr(cache_dir_utils, "default_cache_dir", lambda: str(blocked))
    probe_cpu_machine_wide(torch.device("cpu"))
    assert seen == [str(machine)] and os.environ[CACHE_ENV] == job  # not called this time
    probe_cpu_machine_wide(torch.device("meta"))  # off the CPU: nothing to probe
    assert len(seen) == 1
