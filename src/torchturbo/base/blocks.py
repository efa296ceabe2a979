"""The blocks of a model, one rule for every module that cuts a model into them.

**Blocks** (:func:`find_blocks`): the outermost non-leaf children of ``nn.Sequential`` and
``nn.ModuleList`` containers (a ResNet's stages, a decoder's layers), else the model's children
that hold parameters. What activation checkpointing wraps, the memory estimate and the doctor
count activations per, and FSDP shards one by one.

**Repeated blocks** (:func:`repeated_blocks`): the blocks that repeat one class in an
``nn.ModuleList`` of two or more (``model.layers`` of a Hugging Face Llama, ``transformer.h`` of
GPT-2), as Hugging Face accelerate's ``compile_regions`` takes them, the outermost such lists
only (a list inside a repeated block is compiled with its block): what regional compilation
compiles once and reuses.

A leaf module of its own: the facts, the doctor, the memory estimate, FSDP and the techniques all
read it, and none of them imports another's rule.
"""

from __future__ import annotations

from torch import nn


def find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost blocks of the model (see the module docstring), as (qualified name,
    module) pairs in the model's order."""
    blocks: list[tuple[str, nn.Module]] = []
    taken: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.Sequential, nn.ModuleList)):
            continue
        if any(name == t or name.startswith(t + ".") for t in taken):
            continue
        for child_name, child in module.named_children():
            if next(child.children(), None) is None:
                continue  # a leaf layer (Conv, Linear): too fine-grained to be a block
            qualified = f"{name}.{child_name}" if name else child_name
            blocks.append((qualified, child))
            taken.append(qualified)
    if blocks:
        return blocks
    return [(n, m) for n, m in model.named_children() if any(True for _ in m.parameters())]


def repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The children of the outermost ``nn.ModuleList``s of two or more modules of one class,
    as (qualified name, module) pairs in the model's order."""
    found: list[tuple[str, nn.Module]] = []
    taken: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(f"{outer}.") for outer in taken):
            continue
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        kinds = {type(child) for child in module}
        if len(kinds) != 1:
            continue
        taken.append(name)
        found.extend(
            (f"{name}.{child}" if name else child, block)
            for child, block in module.named_children()
        )
    return found


def traced_leaf_modules(model: nn.Module) -> int | None:
    """Leaf modules regional compilation traces: those of one block of each repeated class
    (the other blocks reuse its code); None when the model repeats no block."""
    first: dict[type, nn.Module] = {}
    for _, block in repeated_blocks(model):
        first.setdefault(type(block), block)
    if not first:
        return None
    return sum(
        1
        for block in first.values()
        for module in block.modules()
        if not any(True for _ in module.children())
    )
