"""A compile built off the critical path, for tuning inside the run (``engine/in_run.py``).

The job's model is copied, the copy compiled as the run compiles the model (``apply_compile``),
and one gradient-free forward and one training step of the copy run in a background thread while
the job trains on. Dynamo keeps its graphs per code object and, with parameters as graph inputs
(torch's default since 2.5), the model's own compile then finds the copy's graphs: its first
compiled step costs a cache lookup instead of the cold compile (a 4-block MLP on a 2-core EPYC:
17 s compiled aside while the job ran 96 eager steps, then 0.04 s for the model's first compiled
step and no new graph). Both the gradient-free forward (the in-run loss parity runs one) and the
training step are built, each under the run's step hooks (autocast is per thread and dynamo
guards on it).

What it costs: a copy of the model on its device while it builds, and the CPU the compile takes
from the job (little on a GPU machine's spare cores, a share of the job's on a small CPU one).
The copy's dropout draws come from the process's generator, so a run that builds one does not
repeat another's draws. Written here: no library compiles a copy of a training model aside.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from torchturbo.config import CompileConfig
from torchturbo.techniques.compile import apply_compile, first_line

#: Seconds a compile built aside takes per leaf module of the model: the text workload's
#: tagger (size large, 36 leaf modules) took 72 s on a 2-core EPYC while its job trained
#: (gradient-free forward, forward and backward, dynamic shapes, bf16 autocast). A prior for
#: whether the job's steps left can pay for a build; the build's own seconds are reported.
SECONDS_PER_LEAF = 2.0


def expected_build_seconds(leaf_modules: int) -> float:
    """The seconds a compile of a model with ``leaf_modules`` is expected to take aside."""
    return SECONDS_PER_LEAF * leaf_modules


@dataclass
class Build:
    """A compile being built aside: ``done`` is set when it ended, well (``error`` "") or not."""

    done: threading.Event = field(default_factory=threading.Event)
    #: Seconds the background build took; None until done.
    seconds: float | None = None
    error: str = ""


def build_aside(
    model: nn.Module, config: CompileConfig, warm: Callable[[nn.Module], None]
) -> Build:
    """Compile a copy of ``model`` with ``config`` and run ``warm(copy)`` (a gradient-free
    forward and a training step of the copy, under the run's step hooks) in a background thread;
    the returned :class:`Build` says when it is done and how it went."""
    build = Build()
    try:
        aside = copy.deepcopy(model)
    except Exception as err:  # a module that cannot be copied: a parameter on a meta device...
        return _failed(build, f"the model could not be copied to compile aside: {first_line(err)}")
    result = apply_compile(aside, config)
    if not result.applied:
        return _failed(build, result.reason or "torch.compile did not compile the copy")

    def run() -> None:
        started = time.perf_counter()
        try:
            warm(aside)
        except Exception as err:  # the compile's own error, reported as the verdict's evidence
            build.error = f"compiling aside failed: {type(err).__name__}: {first_line(err)}"
        finally:
            build.seconds = time.perf_counter() - started
            build.done.set()

    threading.Thread(target=run, name="torchturbo-compile-aside", daemon=True).start()
    return build


def _failed(build: Build, why: str) -> Build:
    build.error, build.seconds = why, 0.0
    build.done.set()
    return build
