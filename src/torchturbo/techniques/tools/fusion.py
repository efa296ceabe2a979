"""Fold BatchNorm into the preceding convolution or linear layer, for inference.

In eval mode BatchNorm is a fixed per-channel affine map ``y = (x - mean) / sqrt(var + eps) * w +
b``, so it can be folded into the weights and bias of a Conv or Linear whose output only it reads:
one op and one pass over the activations fewer, the same result up to float rounding. In training
mode it is not fixed (it normalises with the batch's statistics and updates the running ones), so
folding there is wrong and :func:`fuse_for_inference` refuses.

The pairs are found on a ``torch.fx`` symbolic trace, so any traceable model works, not only the
modules named by hand that ``torch.ao.quantization.fuse_modules`` needs (the article's example
names a ``relu`` submodule its model lacks, and fails). The maths is PyTorch's own
(``torch.nn.utils.fusion.fuse_conv_bn_eval`` / ``fuse_linear_bn_eval``); this module only finds
the pairs and rewires the graph. ``torch.fx.experimental.optimization.fuse`` does that rewrite
too, but it is experimental, reports nothing, folds a conv that is called at several places
(changing the other call sites), fails with a bare assertion in training mode and cannot handle an
untraceable model. Here, a model that cannot be traced (data-dependent control flow) falls back to
adjacent Conv->BN children of ``nn.Sequential`` containers, and the report says that tracing
failed and why. A ReLU after the pair stays a separate op: eager runs it in place, and
``torch.compile`` fuses it into the conv's epilogue anyway.

``torch.compile`` already folds these on CPU when compiling inference with freezing (inductor's
pre-grad ``fuse_conv_bn`` pass) and fuses the elementwise ops in training, so this pass matters
for eager inference and for exported artefacts.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass

import torch.fx
from torch import nn
from torch.nn.utils.fusion import fuse_conv_bn_eval, fuse_linear_bn_eval

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_TRANSPOSED_CONVS = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


@dataclass(frozen=True)
class FusionReport:
    """What :func:`fuse_for_inference` did.

    ``fused``: one ``"producer+batchnorm"`` entry per folded pair (qualified module names).
    ``skipped``: pairs left alone, each with the reason. ``traced``: whether ``torch.fx`` traced
    the model; when it did not, ``trace_error`` holds the error and only ``nn.Sequential``
    neighbours were fused.
    """

    fused: tuple[str, ...]
    skipped: tuple[str, ...]
    traced: bool
    trace_error: str | None = None


def fuse_for_inference(model: nn.Module) -> tuple[nn.Module, FusionReport]:
    """A copy of the eval-mode ``model`` with Conv/Linear + BatchNorm pairs folded, and a report.

    Returns a ``torch.fx.GraphModule`` when the model traces, else a fused deep copy of it. The
    input model is never modified. Linear + BatchNorm1d assumes the usual 2-D ``[N, features]``
    activations (BatchNorm1d on ``[N, C, L]`` normalises dim 1, not Linear's output features).
    """
    training = [name or "<root>" for name, m in model.named_modules() if m.training]
    if training:
        raise ValueError(
            f"fuse_for_inference(model) needs an eval-mode model, but {training[:3]} are in "
            "training mode: BatchNorm then normalises with batch statistics and folding its "
            "running statistics would change the result. Call model.eval() first."
        )
    model = copy.deepcopy(model)
    try:
        graph_module = torch.fx.symbolic_trace(model)
    except Exception as error:  # fx raises TraceError, TypeError, ... depending on the construct
        fused, skipped = _fuse_sequential_pairs(model)
        report = FusionReport(fused, skipped, traced=False, trace_error=_describe(error))
        return model, report
    fused, skipped = _fuse_graph_pairs(graph_module)
    # The GraphModule's container submodules are created anew, in training mode; the model was
    # entirely in eval mode, so the result must be too (export_model checks it).
    graph_module.eval()
    return graph_module, FusionReport(fused, skipped, traced=True)


def _describe(error: Exception) -> str:
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {first_line}"


def _fold(producer: nn.Module, bn: nn.Module) -> nn.Module | str:
    """The folded module, or why the pair cannot be folded."""
    if not isinstance(bn, _BATCH_NORMS):
        return "not a BatchNorm"
    if bn.running_mean is None or bn.running_var is None:
        return "BatchNorm has track_running_stats=False: it always uses batch statistics"
    if isinstance(producer, _CONVS):
        return fuse_conv_bn_eval(producer, bn)
    if isinstance(producer, _TRANSPOSED_CONVS):
        return fuse_conv_bn_eval(producer, bn, transpose=True)
    if isinstance(producer, nn.Linear):
        if not isinstance(bn, nn.BatchNorm1d) or bn.num_features != producer.out_features:
            return "BatchNorm does not normalise the Linear's output features"
        return fuse_linear_bn_eval(producer, bn)
    return "producer is not a Conv or Linear"


def _fuse_graph_pairs(gm: torch.fx.GraphModule) -> tuple[tuple[str, ...], tuple[str, ...]]:
    modules = dict(gm.named_modules())
    calls: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            calls[node.target] = calls.get(node.target, 0) + 1
    fused: list[str] = []
    skipped: list[str] = []
    for bn_node in list(gm.graph.nodes):
        if bn_node.op != "call_module" or not isinstance(modules[bn_node.target], _BATCH_NORMS):
            continue
        producer_node = bn_node.args[0] if bn_node.args else None
        if not isinstance(producer_node, torch.fx.Node) or producer_node.op != "call_module":
            continue
        assert isinstance(producer_node.target, str)  # a call_module node's target: its name
        producer = modules[producer_node.target]
        if not isinstance(producer, (*_CONVS, *_TRANSPOSED_CONVS, nn.Linear)):
            continue
        pair = f"{producer_node.target}+{bn_node.target}"
        # Folding rewrites the producer's weights: only safe if nothing else reads its output
        # and neither module is called elsewhere (shared weights).
        if len(producer_node.users) != 1:
            skipped.append(f"{pair}: the producer's output is also used outside the BatchNorm")
            continue
        if calls[producer_node.target] != 1 or calls[bn_node.target] != 1:
            skipped.append(f"{pair}: a module is called more than once (shared weights)")
            continue
        folded = _fold(producer, modules[bn_node.target])
        if isinstance(folded, str):
            skipped.append(f"{pair}: {folded}")
            continue
        _set_submodule(gm, producer_node.target, folded)
        bn_node.replace_all_uses_with(producer_node)
        gm.graph.erase_node(bn_node)
        fused.append(pair)
    gm.delete_all_unused_submodules()
    gm.recompile()
    return tuple(fused), tuple(skipped)


def _set_submodule(root: nn.Module, target: str, module: nn.Module) -> None:
    parent_name, _, name = target.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, name, module)


def _fuse_sequential_pairs(model: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Fold adjacent (producer, BatchNorm) children of every ``nn.Sequential``, in place."""
    fused: list[str] = []
    skipped: list[str] = []
    for seq_name, seq in list(model.named_modules()):
        if not isinstance(seq, nn.Sequential):
            continue
        children = list(seq.named_children())
        for (name_a, a), (name_b, b) in itertools.pairwise(children):
            if not isinstance(a, (*_CONVS, *_TRANSPOSED_CONVS, nn.Linear)):
                continue
            if not isinstance(b, _BATCH_NORMS):
                continue
            prefix = f"{seq_name}." if seq_name else ""
            pair = f"{prefix}{name_a}+{prefix}{name_b}"
            folded = _fold(a, b)
            if isinstance(folded, str):
                skipped.append(f"{pair}: {folded}")
                continue
            setattr(seq, name_a, folded)
            setattr(seq, name_b, nn.Identity())
            fused.append(pair)
    return tuple(fused), tuple(skipped)
