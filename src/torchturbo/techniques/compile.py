"""torch.compile of the training model.

``nn.Module.compile`` compiles in place, so the model keeps its identity, its parameter objects
(the optimizer's references stay valid) and its ``state_dict`` keys (no ``_orig_mod.`` prefix).
Compilation itself happens lazily, in the first steps: that is where it fails when it fails (a
graph break under ``fullgraph = true``, a backend without a C++ compiler), so the engine turns
such an error into :class:`CompileError` and a not-applied result with
:func:`compile_failure`. Measurement code reports compile time apart from step time.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torchturbo.base.compiler import CACHE_ENV, cache_set_here, compile_cache, use_compile_cache
from torchturbo.base.nested import map_tensors
from torchturbo.config import CompileConfig, TurboConfig
from torchturbo.techniques.framework.facts import Facts
from torchturbo.techniques.framework.levers import Expectation
from torchturbo.techniques.framework.proposal import (
    AsideCandidate,
    Candidate,
    StageContext,
    candidate,
)
from torchturbo.techniques.framework.result import TechniqueResult, applied, not_applied
from torchturbo.techniques.framework.spec import Lever, Stage, Technique, TrainerArguments


class CompileError(RuntimeError):
    """torch.compile failed on the model during a training step (the message says how)."""


def apply_compile(model: nn.Module, config: CompileConfig) -> TechniqueResult:
    """Compile the model in place; not applied when ``config.mode`` is "off" or torch refuses
    to compile here (an unsupported Python, for one)."""
    if config.mode == "off":
        return not_applied("compile", "[compile] mode = 'off'")
    cache = use_compile_cache(config.cache_dir)
    trace_checkpointed_side_effects()
    options = compile_options(config)
    budget = config.activation_memory_budget
    try:
        if type(model).forward.__module__.startswith("torch."):
            # A root whose forward is torch's own (an nn.Sequential) leaves dynamo no frame to
            # trace under Module.compile: both _call_impl and forward are in its skip files, so
            # nothing compiles and nothing says so (pytorch/pytorch#150915). A frame of ours
            # is traced and inlines the rest. TODO: drop once torch >= the release with
            # pytorch/pytorch#185722 is the minimum.
            eager = model.__dict__.get("forward")
            compiled = torch.compile(functools.partial(_run, model.forward), **options)
            model.forward = _replayable(compiled) if config.mode == "reduce-overhead" else compiled
            setattr(model, COMPILED_MARK, ("forward", model.forward, eager))
        else:
            model.compile(**options)
            compiled_call = model._compiled_call_impl  # Module.compile's (no public name)
            if config.mode == "reduce-overhead" and compiled_call is not None:
                model._compiled_call_impl = _replayable(compiled_call)
            setattr(model, COMPILED_MARK, ("_compiled_call_impl", model._compiled_call_impl, None))
    except RuntimeError as err:
        return not_applied("compile", f"torch.compile refused the model: {_first_line(err)}")
    details = () if budget is None else (f"activation memory budget {budget:g}",)
    return applied("compile", details + (() if cache is None else (f"cache {cache}",)))


#: On a model ``apply_compile`` compiled: (the attribute it set, its compiled value, its eager
#: value: None for ``Module._compiled_call_impl``, and for a ``forward`` the instance did not
#: have): what ``_toggle`` swaps.
COMPILED_MARK = "_torchturbo_compiled"


def _toggle(model: nn.Module, on: bool) -> bool:
    """Every module of ``model`` that ``apply_compile`` compiled, run compiled or (``on``
    False) eager from the next call on, the compiled code kept for when it is switched on
    again; whether any was. Tuning inside the run measures compile on the job's steps so."""
    compiled_modules = [m for m in model.modules() if hasattr(m, COMPILED_MARK)]
    for module in compiled_modules:
        attribute, compiled, eager = getattr(module, COMPILED_MARK)
        if not on and eager is None and attribute == "forward":
            module.__dict__.pop("forward", None)  # the class's forward again
        else:
            setattr(module, attribute, compiled if on else eager)
    return bool(compiled_modules)


def _replayable(call: Callable[..., Any]) -> Callable[..., Any]:
    """``call`` (a model compiled with CUDA graphs) made safe for a training loop that keeps its
    losses: each call begins a new step of the CUDA graph trees, and its scalar outputs (the
    loss) are copied out of the graph's memory, which the next replay overwrites (reading a loss
    kept from an earlier step would raise "accessing tensor output of CUDAGraphs that has been
    overwritten"). Larger outputs (logits) are consumed within the step."""

    @functools.wraps(call)
    def step(*args: Any, **kwargs: Any) -> Any:
        torch.compiler.cudagraph_mark_step_begin()
        return map_tensors(_own_scalar, call(*args, **kwargs))

    return step


def _own_scalar(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.clone() if tensor.dim() == 0 else tensor


def probe_cpu_machine_wide(device: torch.device) -> None:
    """Run inductor's probe of the CPU's vector instructions against its machine-wide folder.

    Inductor compiles and loads a test library per instruction set (AVX-512, its bf16 and VNNI
    extensions, AMX, AVX2) the first time a process compiles for the CPU, and keeps them in its
    cache folder. The folder of ours that ``[compile] cache_dir`` points it at is new for each
    job, so each new job paid the probe again: 8.4 s on a 2-core EPYC, the largest single part
    of a regional compile's cold 16 s, against 1.1 s with the libraries found. The answer is the
    machine's, so it is computed where inductor keeps its machine-wide files (its default
    folder, beside its precompiled headers); the process remembers it, and the job's folder
    never sees it. A folder the user chose is left alone, and so is the job's where inductor's
    own cannot be written (a failed probe would compile every kernel without vectors, quietly).
    Nothing to do off the CPU.
    """
    if device.type != "cpu" or not cache_set_here():
        return
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    machine_folder = default_cache_dir()
    try:
        os.makedirs(machine_folder, exist_ok=True)
    except OSError:
        return
    if not os.access(machine_folder, os.W_OK):
        return
    job_folder = os.environ[CACHE_ENV]
    os.environ[CACHE_ENV] = machine_folder
    try:
        pick_vec_isa()
    finally:
        os.environ[CACHE_ENV] = job_folder


def trace_checkpointed_side_effects() -> None:
    """Let dynamo compile a checkpointed block whose forward changes Python state outside it.

    Dynamo refuses such a region (a graph break at the checkpoint), and the block then runs
    eager, compiled in name only: transformers >= 5.25 with Hugging Face's ``kernels`` installed
    sets and resets a context variable in every attention forward (``use_kernelized_func``), so
    a checkpointed Llama compiled no graph at all. The flag makes dynamo apply the forward's
    side effects once, in the forward, and not again in the backward's recompute: the semantics
    compiled checkpointing already has for buffers (see ``checkpointing._checkpointed_forward``),
    and for a set-and-reset pair the same state either way. It is process-wide, read when dynamo
    traces; set only once something compiles. TODO: drop once dynamo traces this pattern itself.
    """
    from torch._dynamo import config as dynamo_config

    if hasattr(dynamo_config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        dynamo_config.skip_fwd_side_effects_in_bwd_under_checkpoint = True


def compile_options(config: CompileConfig) -> dict[str, Any]:
    """The keywords of ``torch.compile`` (and ``nn.Module.compile``) for ``config``: its mode,
    or the budgeted Inductor backend under an activation memory budget."""
    # "default" is torch.compile's name for passing no mode at all.
    mode = None if config.mode == "default" else config.mode
    options: dict[str, Any] = {"fullgraph": config.fullgraph, "dynamic": config.dynamic}
    budget = config.activation_memory_budget
    if budget is None:
        options["mode"] = mode
    else:
        options["backend"] = BudgetedInductor(mode, config.dynamic, budget)
    return options


class BudgetedInductor:
    """Inductor as ``torch.compile(mode=mode)`` runs it, partitioning each graph under an
    activation memory budget: ``torch._functorch.config.activation_memory_budget`` is patched
    for the backend call alone, which is where AOT autograd partitions the joint graph (the
    model's first call, and every recompile), so the process's value is never changed.

    Why a backend rather than the value set around the model's calls: dynamo reuses a graph it
    compiled for another model of the same class (its cache is the code object's) unless the
    backends differ, so a second model with another budget ran the first one's partition
    (seen on torch 2.13: one graph for budgets 1.0 and 0.0, both saving the same bytes).
    Backends compare equal when mode, dynamic and budget do: dynamo then reuses a graph only
    for the same budget. On disk, AOT autograd's cache key holds the functorch config (every
    release since the cache came, 2.4): another budget misses, the same one loads.
    torch 2.13's ``torch.autograd.graph.region_activation_memory_budget`` sets the value from
    inside traced code, but it is a prototype and newer than the torch 2.6 supported here.
    """

    def __init__(self, mode: str | None, dynamic: bool | None, budget: float) -> None:
        from torch._functorch import config as functorch_config

        if not hasattr(functorch_config, "activation_memory_budget"):
            raise CompileError(
                f"[compile] activation_memory_budget needs torch._functorch.config."
                f"activation_memory_budget (torch >= 2.4), which torch {torch.__version__} "
                "does not have: remove the key or upgrade torch"
            )
        self.budget = budget
        # torch.compile's own Inductor backend, built as torch.compile(mode=...) builds it.
        self.inductor = torch._TorchCompileInductorWrapper(mode, None, dynamic)

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        from torch._functorch import config as functorch_config

        with functorch_config.patch(activation_memory_budget=self.budget):
            return self.inductor(graph, example_inputs)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, BudgetedInductor)
            and self.budget == other.budget
            and self.inductor == other.inductor
        )

    def __hash__(self) -> int:
        return hash(self.budget)

    def reset(self) -> None:
        """What ``torch._dynamo.reset`` asks a backend to forget (CUDA graph trees)."""
        self.inductor.reset()


def _run(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return forward(*args, **kwargs)


def compile_failure(error: BaseException, technique: str = "compile") -> TechniqueResult | None:
    """The result (of ``technique``) to report when ``error`` was raised by torch.compile
    (dynamo or its backend) while the compiled model ran; None for any other error."""
    # Only a model that was compiled can raise these, and compiling imported their module: no
    # need to import torch._dynamo (a second of start-up) to ask.
    exceptions = sys.modules.get("torch._dynamo.exc")
    if exceptions is None or not isinstance(error, exceptions.TorchDynamoException):
        return None
    return not_applied(
        technique, f"failed while compiling: {type(error).__name__}: {_first_line(error)}"
    )


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "(no message)"


def compile_stage(ctx: StageContext) -> list[Candidate] | str:
    """Whole-model compile in each mode worth trying here, and regional compile (each repeated
    block compiled once, ``regional_compile.py``) where the model repeats a block: the job's
    objective weighs each one's one-time cost against its gain over the planned steps, so a
    short job may take the regional compile that a whole-model compile does not pay back."""
    modes = ["default"]
    if ctx.device.type == "cuda":
        # max-autotune-no-cudagraphs searches matmul/conv kernels. On CPU it does not apply,
        # and each compile costs minutes.
        modes += ["max-autotune-no-cudagraphs"]
    expectation = compile_gain(ctx.facts)
    # Varying batch shapes (text lengths) compile once with dynamic shapes: left to torch, a
    # new length recompiles (specialised, then dynamic), a one-time cost paid again in the job.
    dynamic = True if ctx.facts.shapes_vary else None
    found = [
        candidate(
            f"compile:{m}",
            ctx.best.replace(compile__mode=m, compile__dynamic=dynamic, compile__scope="model"),
            expectation,
        )
        for m in modes
    ]
    if ctx.device.type == "cuda":
        found.append(_cuda_graphs(ctx))
    regional = regional_compile_gain(ctx.facts)
    found.append(
        candidate(
            "compile:default:blocks",
            ctx.best.replace(
                compile__mode="default", compile__dynamic=dynamic, compile__scope="blocks"
            ),
            regional,
        )
    )
    return found


#: The shapes a bucket plan is padded to for CUDA graphs: each is recorded once (a capture and
#: a graph's memory each, milliseconds, where a compile per shape would take a minute: the
#: compile stays dynamic), and more shapes pad less (on the text workload's lengths a plan of 16
#: shapes computes 1.14x the real tokens' positions, of 8 shapes 1.28x: benchmarks/shapes.py).
CUDA_GRAPH_SHAPES = 16


def _cuda_graphs(ctx: StageContext) -> Candidate:
    """CUDA graphs (reduce-overhead): they remove launch overhead where the device idles, and
    are replayed only for a shape they recorded, so a plan of buckets or packed rows is padded to
    a few shapes (``[data] max_shapes``). One compile serves them all (dynamic shapes, a graph
    recorded per shape), except for packed rows, which take one shape and compile for it."""
    best = ctx.best
    if best.data.batches != "rows":  # a plan of ours: its batches can take a few shapes
        packed = best.data.batches == "packed"
        shapes = best.data.max_shapes or (1 if packed else CUDA_GRAPH_SHAPES)
        config = best.replace(
            compile__mode="reduce-overhead",
            compile__dynamic=shapes > 1,
            compile__scope="model",
            data__max_shapes=shapes,
        )
    else:
        dynamic = True if ctx.facts.shapes_vary else None
        config = best.replace(
            compile__mode="reduce-overhead", compile__dynamic=dynamic, compile__scope="model"
        )
    return candidate("compile:reduce-overhead", config, cuda_graphs_gain(ctx.facts))


def _transform(model: nn.Module, config: TurboConfig, device: torch.device) -> TechniqueResult:
    result = apply_compile(model, config.compile)
    if result.applied:
        probe_cpu_machine_wide(device)
    return result


def explain_compile_failure(
    error: BaseException, technique: str = "compile"
) -> tuple[TechniqueResult, Exception] | None:
    """``Technique.explain_failure`` for a compiling technique called ``technique``."""
    failure = compile_failure(error, technique)
    if failure is None or failure.reason is None:
        return None
    return failure, CompileError(
        f"torch.compile {failure.reason}; [compile] mode = 'off' runs eager"
    )


def _hf_arguments(config: TurboConfig, arguments: TrainerArguments) -> None:
    compile_ = config.compile
    arguments.kwargs["torch_compile"] = True
    if compile_.mode != "default":
        arguments.kwargs["torch_compile_mode"] = compile_.mode
    if compile_.fullgraph:
        arguments.note("compile", "fullgraph", "not carried: Trainer compiles with fullgraph=False")
    if compile_.dynamic is not None:
        arguments.note(
            "compile",
            "dynamic",
            f"{compile_.dynamic}: applied by {arguments.trainer_class} (accelerate's dynamo "
            "plugin); a plain Trainer lets torch decide dynamic shapes",
        )


def _cache_switch(
    config: TurboConfig, device: torch.device
) -> contextlib.AbstractContextManager[Any]:
    return compile_cache(config.compile.cache_dir)


def _cache_arguments(config: TurboConfig, arguments: TrainerArguments) -> None:
    holder = arguments.trainer_class if arguments.trainer == "transformers" else arguments.callback
    arguments.note(
        "compile",
        "cache_dir",
        f"{config.compile.cache_dir!r}: loaded by {holder} ({CACHE_ENV}); without it, set "
        "that variable to this folder",
    )


def _budget_requested(config: TurboConfig) -> bool:
    return config.compile.mode != "off" and config.compile.activation_memory_budget is not None


def _budget_arguments(config: TurboConfig, arguments: TrainerArguments) -> None:
    budget = config.compile.activation_memory_budget
    if arguments.trainer == "transformers":
        text = (
            f"{budget}: not carried: TrainingArguments has no such field; set "
            f"torch._functorch.config.activation_memory_budget = {budget} before training "
            "(the Trainer compiles in its first step)"
        )
    else:
        text = f"{budget}: applied by {arguments.callback}'s compile"
    arguments.note("compile", "activation_memory_budget", text)


#: Expected compile gains, from the built-in workloads on CPU (1.1-1.3x): less where shapes vary,
#: since every new shape recompiles or runs a dynamic-shape graph.
COMPILE_GAIN = 1.15


COMPILE_GAIN_VARYING_SHAPES = 1.05


#: Of a launch-bound step's idle device time, the share CUDA graphs leave: a replay launches a
#: step's kernels at once, but the host still runs the loader, the loss's Python and what the
#: graph does not hold. Published CUDA-graph gains on small models are 1.12-1.7x.
CUDA_GRAPH_RESIDUAL = 0.4


def compile_gain(facts: Facts) -> Expectation:
    if facts.shapes_vary:
        return Expectation(
            COMPILE_GAIN_VARYING_SHAPES,
            "batch shapes vary: compiled graphs recompile or run with dynamic shapes",
        )
    return Expectation(COMPILE_GAIN, "fuses elementwise ops and removes Python overhead")


#: Seconds a compile built aside inside the run takes per leaf module of the model: the text
#: workload's tagger (size large, 36 leaf modules) took 72 s on a 2-core EPYC while its job
#: trained (a gradient-free forward, a forward and backward, dynamic shapes, bf16 autocast). A
#: prior for whether the job's steps left can pay for the build; the build's own seconds are
#: reported.
SECONDS_PER_LEAF = 2.0


def _built_aside(config: TurboConfig, facts: Facts) -> AsideCandidate:
    """Compile as tuning inside the run tries it: the whole model, with dynamic shapes where
    batch shapes vary (one graph for every length), built aside (``Technique.built_aside``)."""
    dynamic = True if facts.shapes_vary else None
    compiled = config.replace(
        compile__mode="default", compile__dynamic=dynamic, compile__scope="model"
    )
    return AsideCandidate(
        candidate("compile", compiled, compile_gain(facts)), SECONDS_PER_LEAF * facts.leaf_modules
    )


def cuda_graphs_gain(facts: Facts) -> Expectation:
    """CUDA graphs (compile mode reduce-overhead): what they can buy is the device's idle time
    (``Facts.device_busy``), of which they remove all but :data:`CUDA_GRAPH_RESIDUAL`."""
    busy = facts.device_busy
    if busy is None:
        return Expectation(
            None, f"no device busy share measured on {facts.device}: CUDA graphs are a GPU's"
        )
    gain = 1 / (busy + CUDA_GRAPH_RESIDUAL * (1 - busy))
    shapes = "; batch shapes vary: a graph per shape" if facts.shapes_vary else ""
    return Expectation(
        gain, f"the device computes {busy:.0%} of a step: the rest is launch overhead{shapes}"
    )


def regional_compile_gain(facts: Facts) -> Expectation:
    """Compiling each repeated block once: compile's gain where the blocks are the work."""
    if facts.block_leaf_modules is None:
        return Expectation(
            None,
            "the model repeats no block (no nn.ModuleList of two or more modules of one "
            "class): there is nothing to compile once and reuse",
        )
    whole = compile_gain(facts)
    return Expectation(
        whole.gain,
        f"one block of each kind traced ({facts.block_leaf_modules} of {facts.leaf_modules} "
        f"leaf modules), the other blocks reuse its code; {whole.evidence}",
    )


TECHNIQUES = (
    Technique(
        name="compile",
        section="compile",
        fields=("mode", "fullgraph", "dynamic"),
        doc="docs/techniques/compile.md",
        requested=lambda config: config.compile.mode != "off" and config.compile.scope == "model",
        transform=_transform,
        toggle=_toggle,
        built_aside=_built_aside,
        order=40,
        order_reason=(
            "compile last among single-device transforms: it traces the model as the earlier "
            "ones left it, and without the collectives of distributed wrapping (DDP's hooks "
            "would break the graph)"
        ),
        explain_failure=explain_compile_failure,
        carried_by={"transformers": lambda config: "TrainingArguments(torch_compile=True)"},
        stage=Stage("compile", 40, compile_stage),
        levers=(Lever("compile", compile_gain), Lever("CUDA graphs", cuda_graphs_gain)),
        translations={"transformers": _hf_arguments},
    ),
    Technique(
        name="compile_cache",
        section="compile",
        fields=("cache_dir",),
        doc="docs/techniques/compile.md",
        requested=lambda config: config.compile.mode != "off" and bool(config.compile.cache_dir),
        switch=_cache_switch,
        order=41,
        order_reason="held around steps once compile (40) has set up what it caches",
        # The engine's compile transform points inductor at the folder as it compiles: no
        # need to set it again around every step. A trainer that compiles itself needs it.
        carried_by={"engine": lambda config: "apply_compile points inductor at the folder"},
        translations={"transformers": _cache_arguments, "lightning": _cache_arguments},
    ),
    # The budget is compile's (apply_compile partitions under it): no hook of its own to run,
    # an entry for its field's translation, its settings and its tests.
    Technique(
        name="compile_memory_budget",
        section="compile",
        fields=("activation_memory_budget",),
        doc="docs/techniques/compile.md",
        requested=_budget_requested,
        order=42,
        order_reason="a field of compile's (40), applied by its transform: it runs no hook",
        translations={"transformers": _budget_arguments, "lightning": _budget_arguments},
    ),
)
