"""A choice built off the critical path, for tuning inside the run (``engine/in_run.py``).

A compile's cold cost is paid before its first step. To keep it from the job, the job's model is
copied, the copy given the choice's transforms (``Technique.built_aside``), and one
gradient-free forward and one training step of the copy run in a background thread while the job
trains on. For a compile, dynamo keeps its graphs per code object and, with parameters as graph
inputs (torch's default since 2.5), the model's own compile then finds the copy's graphs: its
first compiled step costs a cache lookup instead of the cold compile (a 4-block MLP on a 2-core
EPYC: 17 s compiled aside while the job ran 96 eager steps, then 0.04 s for the model's first
compiled step and no new graph). Both the gradient-free forward (the in-run loss parity runs
one) and the training step are built, each under the run's step hooks (autocast is per thread
and dynamo guards on it).

What it costs: a copy of the model on its device while it builds (not built where the device's
free memory would not hold it), and the CPU the build takes from the job (little on a GPU
machine's spare cores, a share of the job's on a small CPU one). The copy's dropout draws come
from the process's generator, so a run that builds one does not repeat another's draws.
Written here: no library compiles a copy of a training model aside.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Build:
    """A choice being built aside: ``done`` is set when it ended, well (``error`` "") or not."""

    done: threading.Event = field(default_factory=threading.Event)
    #: Seconds the background build took; None until done.
    seconds: float | None = None
    error: str = ""


def build_aside(
    model: nn.Module, prepare: Callable[[nn.Module], str], warm: Callable[[nn.Module], None]
) -> Build:
    """Copy ``model``, give the copy the choice (``prepare(copy)``: its transforms applied, ""
    or why one did not apply) and run ``warm(copy)`` (a gradient-free forward and a training
    step of the copy, under the run's step hooks) in a background thread; the returned
    :class:`Build` says when it is done and how it went."""
    build = Build()
    short = _memory_short(model)
    if short:
        return _failed(build, short)
    try:
        aside = copy.deepcopy(model)
    except Exception as err:  # a module that cannot be copied: a parameter on a meta device...
        return _failed(build, f"the model could not be copied to build aside: {_first_line(err)}")
    refused = prepare(aside)
    if refused:
        return _failed(build, refused)

    def run() -> None:
        started = time.perf_counter()
        try:
            warm(aside)
        except Exception as err:  # the build's own (a compile's): the verdict's evidence
            build.error = f"building aside failed: {type(err).__name__}: {_first_line(err)}"
        finally:
            build.seconds = time.perf_counter() - started
            build.done.set()

    threading.Thread(target=run, name="torchturbo-build-aside", daemon=True).start()
    return build


#: A copy is built on an accelerator only where its free memory holds this many times the
#: model's parameters: the copy's own, its gradients, and room for one batch's activations,
#: so that the job's next steps do not run out of memory for it.
FREE_MEMORY_PER_PARAMETER_BYTE = 4


def _memory_short(model: nn.Module) -> str:
    """Why the device cannot hold a copy of ``model`` beside the job, or ""."""
    parameters = list(model.parameters())
    if not parameters or parameters[0].device.type != "cuda":
        return ""
    device = parameters[0].device
    free, _ = torch.cuda.mem_get_info(device)
    return copy_shortage(sum(p.numel() * p.element_size() for p in parameters), free, str(device))


def copy_shortage(parameter_bytes: int, free_bytes: int, device: str) -> str:
    """Why ``free_bytes`` on ``device`` cannot hold a copy of a model of ``parameter_bytes``
    beside the job (``FREE_MEMORY_PER_PARAMETER_BYTE``), or ""."""
    needed = FREE_MEMORY_PER_PARAMETER_BYTE * parameter_bytes
    if free_bytes >= needed:
        return ""
    return (
        f"not built aside: {device} has {free_bytes / 2**30:.1f} GiB free, a copy of the model "
        f"needs about {needed / 2**30:.1f} GiB beside the job"
    )


def _failed(build: Build, why: str) -> Build:
    build.error, build.seconds = why, 0.0
    build.done.set()
    return build


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or ["(no message)"])[0]
