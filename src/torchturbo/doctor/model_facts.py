"""What the doctor reads from the model itself: Conv→BatchNorm pairs, dimensions that are not
TensorCore-aligned (with each layer's share of the forward FLOPs), parameter dtypes, blocks for
checkpointing, and the bytes a forward pass holds for backward.

Conv→BN pairs are found on the ``torch.fx`` graph when the model traces, which sees pairs inside
any module's ``forward``; models with data-dependent control flow do not trace, and then only
consecutive children of ``nn.Sequential`` containers are found, which the result says.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from torchturbo.base.blocks import find_blocks
from torchturbo.base.nhwc import has_2d_convolutions
from torchturbo.measure.memory import activation_bytes

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_ALL_CONVS = (*_CONVS, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
#: TensorCore (and oneDNN's AVX-512 blocking) wants dims in multiples of 8; vocabularies of 64.
ALIGN = 8
VOCAB_ALIGN = 64
#: Conv input channels up to this are set by the data (gray, RGB, RGBA): not the model's choice.
DATA_CHANNELS = 4
#: A misaligned layer matters when it computes at least this share of the forward FLOPs.
SIGNIFICANT_FLOP_SHARE = 0.01


@dataclass(frozen=True)
class Misaligned:
    """A layer with dimensions that are not aligned, and its share of the forward FLOPs."""

    name: str
    kind: str
    problems: tuple[str, ...]
    #: None for layers without FLOPs (embedding lookups): they matter through their width.
    flop_share: float | None

    @property
    def significant(self) -> bool:
        return self.flop_share is None or self.flop_share >= SIGNIFICANT_FLOP_SHARE


@dataclass(frozen=True)
class ModelFacts:
    conv_bn_pairs: list[tuple[str, str]]
    #: How the pairs were found, e.g. "torch.fx graph" or why tracing failed.
    pair_method: str
    misaligned: list[Misaligned]
    #: Parameter element count per dtype name.
    param_dtypes: dict[str, int]
    num_params: int
    has_conv2d: bool
    has_batchnorm: bool
    blocks: list[str]
    forward_flops: int
    #: Bytes held for backward after one forward on the sample batch (parameters excluded).
    activation_bytes: int


def inspect_model(
    model: nn.Module, loss_fn: Callable[[nn.Module, Any], Any], batch: Any
) -> ModelFacts:
    """Read the facts; runs one forward of ``loss_fn(model, batch)`` (no backward)."""
    pairs, method = conv_bn_pairs(model)
    flops_by_module, total_flops, held = _forward_census(model, loss_fn, batch)
    dtypes: Counter[str] = Counter()
    for p in model.parameters():
        dtypes[str(p.dtype).removeprefix("torch.")] += p.numel()
    return ModelFacts(
        conv_bn_pairs=pairs,
        pair_method=method,
        misaligned=misaligned_layers(model, flops_by_module, total_flops),
        param_dtypes=dict(dtypes),
        num_params=sum(dtypes.values()),
        has_conv2d=has_2d_convolutions(model),
        has_batchnorm=any(isinstance(m, (*_NORMS, nn.SyncBatchNorm)) for m in model.modules()),
        blocks=[name for name, _ in find_blocks(model)],
        forward_flops=total_flops,
        activation_bytes=held,
    )


def _forward_census(
    model: nn.Module, loss_fn: Callable[[nn.Module, Any], Any], batch: Any
) -> tuple[dict[str, int], int, int]:
    """FLOPs per module (by qualified name), total forward FLOPs, bytes held for backward."""

    def forward() -> torch.Tensor:
        out = loss_fn(model, batch)
        return out[0] if isinstance(out, tuple) else out

    with FlopCounterMode(display=False) as counter:
        held = activation_bytes(forward, model=model)
    # FlopCounterMode names modules "<RootClass>.<qualified name>".
    prefix = type(model).__name__ + "."
    per_module = {
        key.removeprefix(prefix): sum(counts.values())
        for key, counts in counter.get_flop_counts().items()
        if key.startswith(prefix)
    }
    return per_module, int(counter.get_total_flops()), held


def conv_bn_pairs(model: nn.Module) -> tuple[list[tuple[str, str]], str]:
    """(conv, batchnorm) qualified names where the norm reads only that conv's output."""
    try:
        graph_module = torch.fx.symbolic_trace(model)
    except Exception as err:  # user models fail to trace in many ways; all mean "use fallback"
        reason = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        return _sequential_pairs(model), (
            f"torch.fx tracing failed ({reason.strip()[:120]}); found by walking nn.Sequential "
            "children only, pairs inside a custom forward are missed"
        )
    return _graph_pairs(graph_module), "torch.fx graph"


def _graph_pairs(graph_module: torch.fx.GraphModule) -> list[tuple[str, str]]:
    modules = dict(graph_module.named_modules())
    nodes = [n for n in graph_module.graph.nodes if n.op == "call_module"]
    calls = Counter(n.target for n in nodes)
    pairs = []
    for node in nodes:
        source = node.args[0] if node.args else None
        if not (isinstance(modules[node.target], _NORMS) and isinstance(source, torch.fx.Node)):
            continue
        is_conv = source.op == "call_module" and isinstance(modules[source.target], _CONVS)
        # Folding rewrites both modules: each must be called once, the conv read only by the norm.
        single = len(source.users) == 1 and calls[source.target] == calls[node.target] == 1
        if is_conv and single and _foldable(modules[node.target]):
            pairs.append((str(source.target), str(node.target)))
    return pairs


def _sequential_pairs(model: nn.Module) -> list[tuple[str, str]]:
    pairs = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Sequential):
            continue
        children = list(module.named_children())
        for (conv_name, conv), (norm_name, norm) in itertools.pairwise(children):
            if isinstance(conv, _CONVS) and isinstance(norm, _NORMS) and _foldable(norm):
                prefix = f"{name}." if name else ""
                pairs.append((prefix + conv_name, prefix + norm_name))
    return pairs


def _foldable(norm: nn.Module) -> bool:
    """A norm without running statistics uses batch statistics even in eval: nothing to fold."""
    return getattr(norm, "running_mean", None) is not None


def misaligned_layers(
    model: nn.Module, flops_by_module: dict[str, int], total_flops: int
) -> list[Misaligned]:
    """Linear, Conv and Embedding layers with a dimension off the alignment, largest share first.

    Widths want multiples of 8, vocabularies (embedding rows, and a Linear whose outputs are as
    many as an embedding's rows: the output projection) multiples of 64. Conv input channels of
    4 or fewer are exempt: the data sets them.
    """
    vocab_sizes = {m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)}
    found = []
    for name, module in model.named_modules():
        problems = _problems(module, vocab_sizes)
        if not problems:
            continue
        share = None
        if not isinstance(module, nn.Embedding):
            share = flops_by_module.get(name, 0) / total_flops if total_flops else 0.0
        found.append(Misaligned(name, type(module).__name__, tuple(problems), share))
    return sorted(found, key=lambda m: -1.0 if m.flop_share is None else -m.flop_share)


def _problems(module: nn.Module, vocab_sizes: set[int]) -> list[str]:
    if isinstance(module, nn.Linear):
        out_align = VOCAB_ALIGN if module.out_features in vocab_sizes else ALIGN
        dims = [("in_features", module.in_features, ALIGN)]
        dims.append(("out_features", module.out_features, out_align))
    elif isinstance(module, _ALL_CONVS):
        dims = [("out_channels", module.out_channels, ALIGN)]
        if module.in_channels > DATA_CHANNELS:
            dims.insert(0, ("in_channels", module.in_channels, ALIGN))
    elif isinstance(module, nn.Embedding):
        dims = [
            ("num_embeddings", module.num_embeddings, VOCAB_ALIGN),
            ("embedding_dim", module.embedding_dim, ALIGN),
        ]
    else:
        return []
    return [f"{label}={value} not a multiple of {m}" for label, value, m in dims if value % m]
