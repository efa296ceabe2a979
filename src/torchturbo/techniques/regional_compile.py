"""Regional compilation: each repeated block compiled once, its code reused by every instance.

A decoder is one block repeated N times. Compiled whole, dynamo traces all N and Inductor
compiles one graph N blocks long, so the cold compile grows with depth. ``[compile] scope =
"blocks"`` compiles each block of every ``nn.ModuleList`` of two or more modules of one class
(``repeated_blocks``, Hugging Face accelerate's rule) in place with ``nn.Module.compile``, as
torchtitan compiles its transformer blocks: the blocks share their class's code, so dynamo
caches the first block's graph on it and the others pass its guards (torch >= 2.5 traces a
module's parameters as inputs, ``inline_inbuilt_nn_modules``). The rest of the model (embedding,
final norm, head, loss) runs eager. Parameters, their identity and ``state_dict`` keys are
unchanged, as with whole-model compile.

Composition: checkpointing (order 30) replaces a block's ``forward`` on the instance, which the
compiled ``_call_impl`` then traces, recompute boundaries included; the chunked loss patches the
root's forward, which stays eager; FSDP shards each compiled block afterwards, as torchtitan
does. torch's ``torch.compiler.nested_compile_region`` (invoke_subgraph, torch >= 2.8) is the
other way to compile a region once: the whole model is traced and the block's subgraph stamped
out. Measured slower to compile here (docs/techniques/regional_compile.md), so not used.

Blocks whose graphs differ still compile once each, and the tuner's first steps say so
(``compiled_graphs``): a Hugging Face causal LM trained with ``use_cache`` left on updates a
per-layer KV cache entry (``cache.layers[layer_idx]``), which each block's guards see apart.
"""

from __future__ import annotations

import torch
from torch import nn

from torchturbo.base.blocks import repeated_blocks
from torchturbo.base.compiler import use_compile_cache
from torchturbo.config import CompileConfig, TurboConfig
from torchturbo.techniques.compile import (
    compile_options,
    explain_compile_failure,
    probe_cpu_machine_wide,
    regional_compile_gain,
    trace_checkpointed_side_effects,
)
from torchturbo.techniques.framework.result import TechniqueResult, applied, not_applied
from torchturbo.techniques.framework.spec import Lever, Technique, TrainerArguments

NAME = "regional_compile"


def apply_regional_compile(model: nn.Module, config: CompileConfig) -> TechniqueResult:
    """Compile each repeated block of ``model`` in place (see the module docstring); the
    result's targets are the blocks' qualified names. Not applied, with the reason, when
    ``config.mode`` is "off" or the model repeats no block."""
    if config.mode == "off":
        return not_applied(NAME, "[compile] mode = 'off'")
    blocks = repeated_blocks(model)
    if not blocks:
        return not_applied(
            NAME,
            f"{type(model).__name__} has no nn.ModuleList of two or more modules of one class "
            "to compile once: [compile] scope = 'model' compiles it whole",
        )
    use_compile_cache(config.cache_dir)
    trace_checkpointed_side_effects()
    options = compile_options(config)
    try:
        for _, block in blocks:
            block.compile(**options)
    except RuntimeError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else "(no message)"
        return not_applied(NAME, f"torch.compile refused a block: {first}")
    return applied(NAME, tuple(name for name, _ in blocks))


def _requested(config: TurboConfig) -> bool:
    return config.compile.mode != "off" and config.compile.scope == "blocks"


def _transform(model: nn.Module, config: TurboConfig, device: torch.device) -> TechniqueResult:
    result = apply_regional_compile(model, config.compile)
    if result.applied:
        probe_cpu_machine_wide(device)
    return result


def _explain(error: BaseException) -> tuple[TechniqueResult, Exception] | None:
    return explain_compile_failure(error, NAME)


def _hf_arguments(config: TurboConfig, arguments: TrainerArguments) -> None:
    """The Trainer's ``torch_compile`` compiles the whole model: the callback compiles the
    blocks instead, with the section's mode."""
    compile_ = config.compile
    arguments.note(
        "compile",
        "scope",
        f"'blocks': applied by {arguments.callback} (TrainingArguments(torch_compile=True) "
        "compiles the whole model; leave it off)",
    )
    arguments.note("compile", "mode", f"{compile_.mode!r}: applied by {arguments.callback}")


TECHNIQUE = Technique(
    name=NAME,
    section="compile",
    fields=("scope",),
    doc="docs/techniques/regional_compile.md",
    requested=_requested,
    transform=_transform,
    order=44,
    order_reason=(
        "compile's place, for blocks: after checkpointing, whose block forwards it traces, and "
        "before distributed wrapping, which shards each compiled block (torchtitan's order); "
        "scope = 'model' or 'blocks' chooses it or whole-model compile, never both"
    ),
    explain_failure=_explain,
    levers=(Lever("regional compile", regional_compile_gain),),
    translations={"transformers": _hf_arguments},
)
