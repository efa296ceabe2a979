"""How each registered technique is tested: the config that switches it on, the tolerance it
keeps against the fp32 eager baseline, and what shows it took effect.

``tests/test_technique_registry.py`` runs every entry through the same tests (parity with the
baseline, negative controls, composition with every technique it stacks with, each trainer's
translation), as Composer's ``algorithm_settings`` does. A technique without an entry here fails
those tests: registering one means writing its entry.

``tolerance`` is the largest relative difference allowed between the technique's run and the
baseline's, on every step's loss and on the trained parameters (0: bit-identical).
``took_effect`` reads a :class:`Run` (the engine, the composed model, what the loss function saw
inside each step) and must be False for the baseline: that is the negative control.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from conftest import ConvNet
from torch import nn

from torchturbo.base.compiler import CACHE_ENV, compiled_graphs
from torchturbo.base.nested import iter_tensors
from torchturbo.base.saved_tensors import saved_tensor_packer
from torchturbo.measure.memory import activation_bytes
from torchturbo.techniques.checkpointing import CHECKPOINTED_MARK
from torchturbo.techniques.float8 import float8_unavailable
from torchturbo.techniques.liger import liger_unavailable


@dataclass
class Run:
    """One short training run: the engine after it, per-step losses, the parameters trained, and
    what the loss function observed inside each step (``probes``)."""

    turbo: Any
    model: nn.Module
    losses: list[float]
    parameters: list[torch.Tensor]
    probes: list[dict[str, Any]] = field(default_factory=list)
    #: Padded input elements over all batches (the data techniques' observable).
    input_elements: int = 0
    #: One batch and the loss function, to look inside a forward afterwards.
    batch: Any = None
    loss_fn: Any = None
    #: The baseline's run it was compared with (itself for the baseline), and the largest
    #: relative difference from it.
    baseline: Run | None = None
    difference: float = 0.0


@dataclass(frozen=True)
class Setting:
    #: ``TurboConfig.replace`` keywords that switch the technique on (a callable for fresh ones).
    on: dict[str, Any] | Callable[[], dict[str, Any]]
    tolerance: float
    took_effect: Callable[[Run], bool]
    #: Why it cannot take effect on this machine (then its tests skip, saying so), or None.
    unavailable: Callable[[], str | None] = lambda: None
    #: True, or why it does not stack with the others in the composition tests.
    stacks: bool | str = True
    #: Techniques it does not apply beside, with why; it must say so itself (a reason in
    #: ``Turbo.applied``), which the composition test checks.
    excludes: dict[str, str] = field(default_factory=dict)
    #: It trains through ``Turbo.setup``'s loader on variable-length samples (data techniques).
    data: bool = False
    #: It trains a tiny causal language model (Llama, built from a config) on token batches
    #: with labels, and its loss is the model's own (the loss techniques).
    lm: bool = False
    #: Its runs compile (tens of seconds): marked slow.
    slow: bool = False
    #: The optimizer its runs (and their baseline) train with, over the model's parameters;
    #: None: SGD with momentum.
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None

    def overrides(self) -> dict[str, Any]:
        return self.on() if callable(self.on) else dict(self.on)


def _applied(run: Run, name: str) -> bool:
    return run.turbo.applied.get(name, "not requested") is None


def _stores_compressed(run: Run) -> bool:
    """Whether a forward, as a step runs it, stores some saved tensor in bf16 (what autograd
    keeps, seen by a packer after the technique's own)."""
    stored: list[Any] = []

    def look(value: Any) -> Any:
        stored.extend(t.dtype for t in iter_tensors(value))
        return value

    with run.turbo.switches(), saved_tensor_packer(look, lambda value: value):
        run.turbo.forward(run.loss_fn, run.batch)
    return torch.bfloat16 in stored


def _chunked(run: Run) -> bool:
    """Whether the loss came from the chunked path: applied, and no step saw full logits."""
    return _applied(run, "chunked_loss") and all(p["logits"] is None for p in run.probes)


def _keeps_only_its_inputs(run: Run) -> bool:
    """Whether the compiled model keeps nothing for backward beyond its inputs (the batch and
    copies of the weights), as under budget 0 the partitioner recomputes every activation.
    Plain compile keeps the convolutions' outputs, 8x as many bytes here; eager keeps more."""
    if not _applied(run, "compile"):
        return False
    batch = run.batch[0]
    inputs = [batch, *run.model.parameters()]
    saved = activation_bytes(lambda: run.model(batch).sum(), model=run.model)
    return saved <= sum(t.numel() * t.element_size() for t in inputs)


def _blocks_compiled(run: Run) -> bool:
    """Whether every decoder layer, and not the model around them, runs compiled, and dynamo
    built graphs for them."""
    layers = list(run.model.model.layers)
    return (
        _applied(run, "regional_compile")
        and all(layer._compiled_call_impl is not None for layer in layers)
        and run.model._compiled_call_impl is None
        and (compiled_graphs() or 0) > 0
    )


def _moments_in_bf16(run: Run) -> bool:
    """Whether the optimizer that trained keeps every moment in bfloat16."""
    states = list(run.turbo.optimizer.state.values())
    return bool(states) and all(
        s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.bfloat16 for s in states
    )


def _compile_cache() -> dict[str, Any]:
    folder = tempfile.mkdtemp(prefix="torchturbo-cache-")
    return {"compile__mode": "default", "compile__cache_dir": folder}


def _cache_written(run: Run) -> bool:
    folder = os.environ.get(CACHE_ENV)
    cache = run.turbo.config.compile.cache_dir
    return bool(cache) and folder == str(Path(cache).resolve()) and any(Path(folder).iterdir())


SETTINGS: dict[str, Setting] = {
    "float8": Setting(
        on={"precision__dtype": "bf16", "precision__float8": True},
        # e4m3 keeps 3 mantissa bits: about 5% per element of a Linear's output.
        tolerance=0.1,
        took_effect=lambda run: _applied(run, "float8"),
        unavailable=lambda: float8_unavailable("cuda" if torch.cuda.is_available() else "cpu"),
    ),
    "channels_last": Setting(
        on={"memory_format__channels_last": True},
        # NHWC convolutions sum in another order.
        tolerance=1e-4,
        took_effect=lambda run: next(
            m for m in run.model.modules() if isinstance(m, nn.Conv2d)
        ).weight.is_contiguous(memory_format=torch.channels_last),
    ),
    "checkpointing": Setting(
        on={"checkpointing__mode": "full"},
        tolerance=0.0,  # the recompute is the same arithmetic
        took_effect=lambda run: any(
            getattr(m, CHECKPOINTED_MARK, False) for m in run.model.modules()
        ),
    ),
    "compile": Setting(
        on={"compile__mode": "default"},
        tolerance=1e-4,  # inductor fuses and reorders float32 sums
        took_effect=lambda run: _applied(run, "compile") and (compiled_graphs() or 0) > 0,
        slow=True,
    ),
    "regional_compile": Setting(
        on={"compile__mode": "default", "compile__scope": "blocks"},
        tolerance=1e-4,  # compile's: inductor fuses and reorders float32 sums
        took_effect=_blocks_compiled,
        stacks="it compiles the repeated blocks of the causal LM (the other settings train a "
        "ConvNet, which repeats none): its composition with checkpointing, the chunked loss "
        "and FSDP is tested in tests/test_regional_compile.py",
        lm=True,
        slow=True,
    ),
    "compile_cache": Setting(
        on=_compile_cache,
        tolerance=1e-4,
        took_effect=_cache_written,
        slow=True,
    ),
    "compile_memory_budget": Setting(
        on={"compile__mode": "default", "compile__activation_memory_budget": 0.0},
        tolerance=1e-4,  # compile's: the recompute is the same arithmetic, fused as compiled
        took_effect=_keeps_only_its_inputs,
        stacks="it is compile's partition under a budget: compile's pairs cover how compiling "
        "composes, and each pair compiles for tens of seconds; the planner's compiled plans "
        "with micro-batches are tested in tests/test_compile_budget.py",
        slow=True,
    ),
    "cudnn_benchmark": Setting(
        on={"backend__cudnn_benchmark": True},
        tolerance=0.0,  # on a CPU the flag changes nothing but itself
        took_effect=lambda run: all(p["cudnn_benchmark"] for p in run.probes),
    ),
    "precision": Setting(
        on={"precision__dtype": "bf16"},
        tolerance=0.05,  # bf16 keeps 8 bits of mantissa in the autocast forward
        took_effect=lambda run: all(p["output_dtype"] == torch.bfloat16 for p in run.probes),
    ),
    "optimizer": Setting(
        on={"optimizer__implementation": "fused"},
        tolerance=1e-5,  # one kernel, the same maths in another rounding order
        took_effect=lambda run: run.turbo.optimizer.param_groups[0].get("fused") is True,
    ),
    "optimizer_state": Setting(
        on={"optimizer__state": "bf16"},
        # bf16 moments (8 bits of mantissa, stochastically rounded) move each AdamW update by
        # ~0.4% of its size: under 1e-3 of the ConvNet's weights over the 3 steps; the other
        # states (torchao's, compiled) are measured over 40 steps in test_optimizer_state.py.
        tolerance=5e-3,
        took_effect=_moments_in_bf16,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
        excludes={
            "optimizer": "a fused or foreach rebuild is torch's kernel, which a smaller "
            "state would replace"
        },
    ),
    "liger_kernel": Setting(
        on={"liger_kernel__enabled": True},
        # Liger's Triton kernels: RMSNorm and SwiGLU in float32 differ from eager by rounding.
        tolerance=1e-4,
        took_effect=lambda run: _applied(run, "liger_kernel"),
        # The registry's runs are on the CPU: Liger's kernels need CUDA, so these always skip;
        # tests/test_liger.py runs it on a GPU where there is one.
        unavailable=lambda: liger_unavailable("cpu"),
        stacks="it patches a Hugging Face causal LM, which the other settings do not train, "
        "and only on CUDA: tests/test_liger.py checks it there",
        lm=True,
    ),
    "length_buckets": Setting(
        on={"data__batches": "buckets"},
        tolerance=1e-5,  # the same samples, once each, summed in other batches
        took_effect=lambda run: (
            run.baseline is not None and run.input_elements < run.baseline.input_elements
        ),
        stacks="it changes which samples share a batch, not the step: the step techniques "
        "stack with it in the tuner's tests (tests/test_tune.py), on its own batches",
        data=True,
    ),
    "packing": Setting(
        on={"data__batches": "packed"},
        tolerance=1e-5,  # the same samples, once each, pooled per document of packed rows
        took_effect=lambda run: (
            "document_ids" in run.batch
            and run.baseline is not None
            and run.input_elements < run.baseline.input_elements
        ),
        stacks="it changes which samples share a row, not the step: the step techniques stack "
        "with it as with length buckets, on its own batches",
        data=True,
    ),
    "activation_compression": Setting(
        on={"activation_compression__dtype": "bf16", "activation_compression__min_bytes": 1024},
        # Saved activations rounded to bf16 (0.4% each) reach the gradients only.
        tolerance=0.02,
        took_effect=lambda run: _applied(run, "activation_compression") and _stores_compressed(run),
        excludes={
            name: "compiled graphs save their tensors out of reach of saved-tensor hooks"
            for name in ("compile", "compile_cache")
        },
    ),
    "chunked_loss": Setting(
        on={"chunked_loss__enabled": True, "chunked_loss__chunk_tokens": 7},
        # The same float32 sums in other orders (chunks of 7 tokens, gradients accumulated).
        tolerance=1e-5,
        took_effect=_chunked,
        stacks="it changes a causal LM's loss, a model the other settings do not train: its "
        "composition with bf16 and checkpointing is tested in tests/test_chunked_loss.py",
        lm=True,
    ),
}


def model_for(setting: Setting) -> nn.Module:
    """The model each step technique trains: convolutions and Linears."""
    if setting.lm:
        return tiny_llama()
    return TokenClassifier() if setting.data else ConvNet()


def tiny_llama(vocab: int = 96, tied: bool = False) -> nn.Module:
    """A two-layer LlamaForCausalLM built from a config (no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(config)


def token_batches(steps: int, vocab: int = 96) -> list[dict[str, torch.Tensor]]:
    """Causal-LM batches of 2 x 12 tokens, labels the inputs with a padded tail ignored."""
    generator = torch.Generator().manual_seed(2)
    batches = []
    for _ in range(steps):
        ids = torch.randint(vocab, (2, 12), generator=generator)
        labels = ids.clone()
        labels[1, 9:] = -100
        batches.append({"input_ids": ids, "labels": labels})
    return batches


class TokenClassifier(nn.Module):
    """Mean-pooled embeddings of variable-length token ids (0 pads), each token given its
    document's class logits: the data techniques' model. Given ``document_ids`` (a packed row) it
    pools each document of the row; it reads no positions, so it keeps packed documents apart
    (the isolation check the batch plan runs before packing passes on it)."""

    def __init__(self, vocab: int = 50, width: int = 16, classes: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.head = nn.Linear(width, classes)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if document_ids is None:  # one document per row, padded with 0
            mask = (input_ids != 0).unsqueeze(-1).float()
            pooled = (self.embed(input_ids) * mask).sum(1) / mask.sum(1).clamp(min=1)
            return self.head(pooled).unsqueeze(1).expand(-1, input_ids.shape[1], -1)
        documents = document_ids[0]
        count = int(documents.max()) + 1
        embedded = self.embed(input_ids[0])
        summed = embedded.new_zeros(count, embedded.shape[1]).index_add_(0, documents, embedded)
        sizes = torch.bincount(documents, minlength=count).unsqueeze(1)
        return self.head(summed / sizes)[documents].unsqueeze(0)
