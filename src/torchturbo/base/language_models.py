"""The causal language models inside a model: what the chunked loss patches and the facts read.

A Hugging Face LM names its head through ``get_output_embeddings()``. A LightningModule or
another wrapper holds one as a child (``self.model = LlamaForCausalLM(...)``) without a head of
its own, so the root alone is not enough to look at: the outermost modules whose output
embedding is an ``nn.Linear`` are. A leaf module: the facts and the technique both read it.
"""

from __future__ import annotations

from torch import nn


def language_models(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost modules of ``model`` (itself included, as "") with a linear output
    embedding, as (qualified name, module) pairs in the model's order."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if any(name.startswith(f"{outer}.") or not outer for outer, _ in found):
            continue
        if isinstance(output_embedding(module), nn.Linear):
            found.append((name, module))
    return found


def output_embedding(module: nn.Module) -> nn.Module | None:
    """``module.get_output_embeddings()``, or None for a module without one."""
    get_head = getattr(module, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    return head if isinstance(head, nn.Module) else None
