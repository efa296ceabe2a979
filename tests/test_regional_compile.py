"""Regional compile (``[compile] scope = "blocks"``): which blocks, the effect, the composition.

The registry's tests (``regional_compile`` in technique_settings.py) train a two-layer Llama
with it against fp32 eager; these check what they cannot: the repeated blocks found, one graph
compiled for all of them (with a negative control that makes each block compile its own), its
composition with checkpointing, the chunked loss and FSDP, the tuner's candidates and cost.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import cpu_stage_context, torchrun_two
from technique_settings import tiny_llama
from torch import nn

from torchturbo import Turbo, TurboConfig
from torchturbo.base.blocks import repeated_blocks, traced_leaf_modules
from torchturbo.base.compiler import compiled_graphs
from torchturbo.config import ConfigError
from torchturbo.integrations.translate import hf_arguments
from torchturbo.recipe import Recipe
from torchturbo.techniques.compile import compile_stage
from torchturbo.techniques.framework.facts import leaf_module_count
from torchturbo.techniques.regional_compile import apply_regional_compile
from torchturbo.tune.search.budget import compile_seconds

SCRIPT = Path(__file__).parent / "scripts" / "regional_fsdp.py"
BLOCKS = TurboConfig(device="cpu").replace(compile__mode="default", compile__scope="blocks")


def _llama(layers: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


class Mixed(nn.Module):
    """A ModuleList of two classes, a list of one, and a list of identical lists."""

    def __init__(self) -> None:
        super().__init__()
        self.mixed = nn.ModuleList([nn.Sequential(nn.Linear(2, 2)), nn.Linear(2, 2)])
        self.single = nn.ModuleList([nn.Sequential(nn.Linear(2, 2))])
        self.nested = nn.ModuleList(
            nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]) for _ in range(2)
        )


def test_the_repeated_blocks_are_the_outermost_lists_of_one_class():
    names = [name for name, _ in repeated_blocks(_llama(3))]
    assert names == ["model.layers.0", "model.layers.1", "model.layers.2"]
    # Mixed classes and a single child repeat nothing; of nested lists, the outer one counts.
    assert [name for name, _ in repeated_blocks(Mixed())] == ["nested.0", "nested.1"]
    assert repeated_blocks(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))) == []


def test_regional_compile_traces_one_block_of_each_kind():
    model = _llama(4)
    one_layer = leaf_module_count(model.model.layers[0])
    assert traced_leaf_modules(model) == one_layer < leaf_module_count(model) / 4
    assert traced_leaf_modules(nn.Linear(2, 2)) is None


def test_scope_is_validated_with_the_field_named():
    with pytest.raises(ConfigError, match=r"\[compile\] scope = 'blocks' with mode = 'off'"):
        TurboConfig(device="cpu").replace(compile__scope="blocks")
    with pytest.raises(ConfigError, match=r"\[compile\] scope = 'layers'.*'model', 'blocks'"):
        TurboConfig.from_dict({"compile": {"mode": "default", "scope": "layers"}})


def test_blocks_are_compiled_in_place_and_the_rest_left_eager():
    """Nothing compiles until the first call: this checks the wiring without compiling."""
    model = _llama(3)
    keys, params = list(model.state_dict()), [id(p) for p in model.parameters()]
    result = apply_regional_compile(model, BLOCKS.compile)
    assert result.applied and result.targets == tuple(f"model.layers.{i}" for i in range(3))
    assert all(layer._compiled_call_impl is not None for layer in model.model.layers)
    assert model._compiled_call_impl is None and model.lm_head._compiled_call_impl is None
    assert list(model.state_dict()) == keys and [id(p) for p in model.parameters()] == params


def test_a_model_without_repeated_blocks_is_not_compiled_and_says_so():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    result = apply_regional_compile(model, BLOCKS.compile)
    assert not result.applied and "scope = 'model' compiles it whole" in str(result.reason)
    assert all(m._compiled_call_impl is None for m in model.modules())


def _recipe(model: type[nn.Module] | None = None) -> Recipe:
    data = torch.utils.data.TensorDataset(torch.randint(0, 64, (8, 6)))
    return Recipe(
        name="llama",
        model=model or (lambda: _llama(4)),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        loss_fn=lambda m, batch: m(input_ids=batch[0], labels=batch[0]).loss,
        dataset=data,
        batch_size=4,
    )


def test_the_compile_stage_proposes_whole_and_regional_compile():
    recipe = _recipe()
    facts = {"leaf_modules": 40, "block_leaf_modules": 9}
    candidates = {c.name: c for c in compile_stage(cpu_stage_context(recipe, facts=facts))}
    assert candidates["compile:default"].config.compile.scope == "model"
    regional = candidates["compile:default:blocks"]
    assert regional.config.compile.scope == "blocks" and regional.not_applicable is None
    assert "9 of 40 leaf modules" in regional.evidence
    # On top of a regional best, the whole-model candidate is whole again.
    on_regional = cpu_stage_context(recipe, facts=facts, best=regional.config)
    whole = next(c for c in compile_stage(on_regional) if c.name == "compile:default")
    assert whole.config.compile.scope == "model"
    # Without repeated blocks it is not applicable, with the reason.
    plain = cpu_stage_context(recipe, facts={"leaf_modules": 3})
    regional = next(c for c in compile_stage(plain) if c.name == "compile:default:blocks")
    assert regional.not_applicable and "repeats no block" in regional.not_applicable


def test_regional_compile_is_estimated_at_one_block_of_the_compile():
    facts = cpu_stage_context(_recipe(), facts={"leaf_modules": 90, "block_leaf_modules": 11})
    whole = compile_seconds(facts.facts)
    regional = compile_seconds(facts.facts, regional=True)
    assert regional < whole / 1.5
    plain = cpu_stage_context(_recipe(), facts={"leaf_modules": 90}).facts
    assert compile_seconds(plain, regional=True) == compile_seconds(plain)


def test_the_trainer_is_not_asked_to_compile_the_whole_model():
    translation = hf_arguments(BLOCKS)
    assert "torch_compile" not in translation.kwargs
    assert "TurboCallback" in translation.notes["[compile] scope"]


def _train(model: nn.Module, config: TurboConfig, *, use_cache: bool = False) -> list[float]:
    torch.compiler.reset()
    turbo = Turbo(config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, _, _ = turbo.setup(model, optimizer)
    generator = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(3):
        ids = torch.randint(0, 64, (2, 8), generator=generator)
        batch = {"input_ids": ids, "labels": ids}

        def loss_fn(m: nn.Module, b: dict) -> torch.Tensor:
            return m(**b, use_cache=use_cache).loss

        losses.append(float(turbo.step(loss_fn, batch).loss))
    assert all(result is None for result in turbo.applied.values()), turbo.applied
    return losses


@pytest.mark.slow
def test_every_block_runs_the_one_graph_compiled_for_the_first():
    eager = _train(_llama(4), TurboConfig(device="cpu"))
    before = compiled_graphs() or 0
    regional = _train(_llama(4), BLOCKS)
    assert (compiled_graphs() or 0) - before == 1  # four blocks, one graph
    assert regional == pytest.approx(eager, rel=1e-4)  # inductor reorders float32 sums
    # Negative control: a per-layer KV cache entry (use_cache left on) makes each block's
    # guards differ, and the counter sees one graph per block.
    before = compiled_graphs() or 0
    _train(_llama(2), BLOCKS, use_cache=True)
    assert (compiled_graphs() or 0) - before == 2


@pytest.mark.slow
def test_it_composes_with_checkpointing_and_the_chunked_loss():
    config = BLOCKS.replace(
        checkpointing__mode="full", chunked_loss__enabled=True, chunked_loss__chunk_tokens=5
    )
    torch.manual_seed(0)
    eager = _train(tiny_llama(vocab=64), TurboConfig(device="cpu"))
    torch.manual_seed(0)
    before = compiled_graphs() or 0
    composed = _train(tiny_llama(vocab=64), config)
    assert (compiled_graphs() or 0) - before == 1
    assert composed == pytest.approx(eager, rel=1e-4)


@pytest.mark.slow
def test_fsdp_shards_the_compiled_blocks(tmp_path):
    torchrun_two([str(SCRIPT), str(tmp_path)], timeout_s=300)
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["applied"]["regional_compile"] is None and result["compiled"]
        assert result["applied"]["distributed"] is None
        assert result["graphs"] == 1
        assert result["regional_losses"] == pytest.approx(result["eager_losses"], rel=1e-5)
        assert result["param_difference"] < 1e-5
