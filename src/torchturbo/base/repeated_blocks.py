"""The repeated blocks of a model: what regional compilation compiles once and reuses.

A decoder repeats one block N times, held in an ``nn.ModuleList`` (``model.layers`` of a Hugging
Face Llama, ``transformer.h`` of GPT-2). Hugging Face accelerate's ``compile_regions`` takes the
children of every ``nn.ModuleList`` whose children all share one class; so does this, keeping
the outermost such lists (a list inside a repeated block is compiled with its block) and
requiring two children at least (one block repeats nothing). A leaf module: the facts, the
tuner's compile stage and the technique all read it.
"""

from __future__ import annotations

from torch import nn


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
