"""The chunked loss computes what the plain LM head and cross-entropy compute.

Equivalence of the loss and of every gradient against ``F.cross_entropy(F.linear(...))`` and
against Hugging Face models' own loss, with negative controls: a chunked loss that drops one
token's label fails the same comparison, and a model whose forward changes its logits (Gemma-2's
soft-capping) is refused rather than trained on another loss. The registry's generic tests
(``technique_settings.py``) cover the engine and both callbacks.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import cpu_stage_context
from technique_settings import tiny_llama, token_batches

from torchturbo import Turbo, TurboConfig
from torchturbo.techniques.chunked_loss import (
    CHUNKED_MARK,
    apply_chunked_loss,
    chunked_loss_stage,
    expectation,
)
from torchturbo.techniques.framework.facts import lm_head_census
from torchturbo.techniques.tools.linear_cross_entropy import linear_cross_entropy

#: float32: the same sums in another order (chunks, gradients accumulated chunk by chunk).
FP32_TOLERANCE = 1e-5
#: bf16 autocast: both round the head's products to bf16 (8 mantissa bits, 0.4% per element);
#: the chunked loss accumulates the weight's gradient in float32, the plain head in one bf16
#: product, so gradients differ by about 0.3% (measured), the loss by 1e-7.
BF16_TOLERANCE = 1e-2


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


def _loss_and_grads(loss_fn: Any, *tensors: torch.Tensor | None) -> list[torch.Tensor]:
    for t in tensors:
        if t is not None:
            t.grad = None
    loss = loss_fn()
    loss.backward()
    return [loss.detach(), *(t.grad.clone() for t in tensors if t is not None)]


def _worst(chunked: list[torch.Tensor], plain: list[torch.Tensor]) -> float:
    return max(_relative(a, b) for a, b in zip(chunked, plain, strict=True))


def _head_inputs(bias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, Any]:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 75, 32, generator=generator).requires_grad_()
    weight = (0.1 * torch.randn(500, 32, generator=generator)).requires_grad_()
    b = torch.randn(500, generator=generator).requires_grad_() if bias else None
    labels = torch.randint(500, (2, 75), generator=generator)
    labels[:, ::7] = -100
    return hidden, weight, b, labels


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_loss_and_gradients_equal_the_plain_heads(dtype: str, bias: bool, reduction: str) -> None:
    hidden, weight, b, labels = _head_inputs(bias)
    tolerance = FP32_TOLERANCE if dtype == "fp32" else BF16_TOLERANCE

    def plain_loss() -> torch.Tensor:
        logits = F.linear(hidden, weight, b).float().flatten(0, 1)
        return F.cross_entropy(logits, labels.flatten(), reduction=reduction)

    def chunked_loss() -> torch.Tensor:
        return linear_cross_entropy(hidden, weight, labels, b, chunk_tokens=16, reduction=reduction)

    results = []
    for loss_fn in (plain_loss, chunked_loss):
        with torch.autocast("cpu", torch.bfloat16, enabled=dtype == "bf16"):
            results.append(_loss_and_grads(loss_fn, hidden, weight, b))
    plain, chunked = results
    assert _worst(chunked, plain) <= tolerance
    assert hidden.grad is not None and hidden.grad.dtype == hidden.dtype


def test_negative_control_a_dropped_label_fails_the_same_check() -> None:
    hidden, weight, _, labels = _head_inputs(bias=False)
    plain = _loss_and_grads(
        lambda: F.cross_entropy(F.linear(hidden, weight).flatten(0, 1), labels.flatten()),
        hidden,
        weight,
    )
    dropped = labels.clone()
    dropped[0, 1] = -100  # one label of 130 lost, as an off-by-one in the chunk edges would
    chunked = _loss_and_grads(
        lambda: linear_cross_entropy(hidden, weight, dropped, chunk_tokens=16), hidden, weight
    )
    assert _worst(chunked, plain) > FP32_TOLERANCE


def test_all_ignored_is_nan_like_torch_and_bad_input_is_refused() -> None:
    hidden, weight = torch.randn(4, 8), torch.randn(10, 8)
    ignored = torch.full((4,), -100)
    assert torch.isnan(F.cross_entropy(hidden @ weight.T, ignored))
    assert torch.isnan(linear_cross_entropy(hidden, weight, ignored))
    with pytest.raises(IndexError, match="label 10 is outside the vocabulary"):
        linear_cross_entropy(hidden, weight, torch.tensor([1, 2, 10, -100]))
    with pytest.raises(ValueError, match="do not match"):
        linear_cross_entropy(hidden, weight, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="chunk_tokens=0"):
        linear_cross_entropy(hidden, weight, ignored, chunk_tokens=0)


def _gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=96, n_embd=16, n_layer=2, n_head=2, n_positions=32)
    return GPT2LMHeadModel(config)


_MODELS = {
    "llama": lambda: tiny_llama(),
    "llama_tied": lambda: tiny_llama(tied=True),
    "gpt2_tied": _gpt2,
}


@pytest.mark.parametrize("name", list(_MODELS))
def test_hugging_face_loss_and_gradients_equal_the_models_own(name: str) -> None:
    torch.manual_seed(0)
    plain = _MODELS[name]()
    model = copy.deepcopy(plain)
    keys = list(model.state_dict())
    result = apply_chunked_loss(model, chunk_tokens=5)
    assert result.applied, result.reason
    assert list(model.state_dict()) == keys
    batch = token_batches(1)[0]
    count = torch.tensor(17)  # the Trainer's num_items_in_batch: a sum over that many
    for extra in ({}, {"num_items_in_batch": count}):
        outputs = []
        for m in (plain, model):
            m.zero_grad()
            torch.manual_seed(1)  # GPT-2's dropout draws the same masks in both
            output = m(**batch, **extra)
            output.loss.backward()
            grads = [p.grad.clone() for p in m.parameters() if p.grad is not None]
            outputs.append((output, [output.loss.detach(), *grads]))
        (_, expected), (chunked, got) = outputs
        assert chunked.logits is None
        assert len(got) == len(expected)
        assert _worst(got, expected) <= FP32_TOLERANCE, extra


def test_without_labels_or_gradients_the_model_runs_as_before() -> None:
    model = tiny_llama()
    apply_chunked_loss(model)
    batch = token_batches(1)[0]
    assert model(input_ids=batch["input_ids"]).logits.shape == (2, 12, 96)
    with torch.no_grad():
        evaluated = model(**batch)
    assert evaluated.logits is not None and evaluated.loss is not None
    assert isinstance(model(**batch, return_dict=False), tuple)


def _with_auxiliary_loss() -> torch.nn.Module:
    """A Llama whose forward adds a term to the loss, as MoE models add their router loss."""
    from transformers import LlamaForCausalLM

    class WithAuxiliaryLoss(LlamaForCausalLM):
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            output = super().forward(*args, **kwargs)
            if output.loss is not None:
                output.loss = output.loss + 0.5
            return output

    return WithAuxiliaryLoss(tiny_llama().config)


def test_a_model_that_changes_its_logits_is_refused_with_the_reason() -> None:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        vocab_size=96,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        final_logit_softcapping=2.0,
    )
    model = Gemma2ForCausalLM(config)
    result = apply_chunked_loss(model)
    assert not result.applied and "final_logit_softcapping" in str(result.reason)
    assert not getattr(model, CHUNKED_MARK, False)
    auxiliary = _with_auxiliary_loss()
    result = apply_chunked_loss(auxiliary)
    assert not result.applied and "an auxiliary loss" in str(result.reason)
    assert type(auxiliary).forward is auxiliary.forward.__func__  # left as it was
    assert apply_chunked_loss(torch.nn.Linear(4, 4)).reason == (
        "the model has no linear LM head (get_output_embeddings)"
    )


def _trained(config: TurboConfig) -> tuple[list[float], list[torch.Tensor], Turbo]:
    torch.manual_seed(0)
    model = tiny_llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    turbo = Turbo(config)
    model, optimizer, _ = turbo.setup(model, optimizer)
    losses = [float(turbo.step(lambda m, b: m(**b).loss, batch).loss) for batch in token_batches(3)]
    return losses, [p.detach().clone() for p in model.parameters()], turbo


@pytest.mark.parametrize(
    ("other", "tolerance"),
    [({"precision__dtype": "bf16"}, BF16_TOLERANCE), ({"checkpointing__mode": "full"}, 1e-5)],
    ids=["bf16", "checkpointing"],
)
def test_it_stacks_with_bf16_and_checkpointing(other: dict[str, Any], tolerance: float) -> None:
    base = TurboConfig(device="cpu").replace(**other)
    losses, parameters, _ = _trained(base)
    chunked_losses, chunked_parameters, turbo = _trained(base.replace(chunked_loss__enabled=True))
    assert turbo.applied["chunked_loss"] is None, turbo.applied
    assert all(reason is None for reason in turbo.applied.values()), turbo.applied
    differences = [abs(a - b) / b for a, b in zip(chunked_losses, losses, strict=True)]
    differences += [_relative(a, b) for a, b in zip(chunked_parameters, parameters, strict=True)]
    assert max(differences) <= tolerance


def test_the_facts_measure_the_logits_and_the_stage_proposes_by_their_share() -> None:
    model = tiny_llama()
    batch = token_batches(1)[0]
    logits, held = lm_head_census(model, lambda: model(**batch).loss)
    assert logits == 2 * 12 * 96 * 4
    assert held is not None and held > logits
    assert lm_head_census(torch.nn.Linear(2, 2), lambda: None) == (None, None)

    def context(share: float, **kw: Any) -> Any:
        facts = {"logits_bytes": int(share * 100 * 2**20), "activation_bytes": 100 * 2**20}
        return cpu_stage_context(None, facts=facts, **kw)

    over = chunked_loss_stage(context(0.1, memory_budget=2**20, best_memory_bytes=2**30))
    assert isinstance(over, list) and over[0].config.chunked_loss.enabled
    speed = chunked_loss_stage(context(0.8))
    assert isinstance(speed, list) and speed[0].expected_gain and speed[0].expected_gain > 1
    small = chunked_loss_stage(context(0.1))
    assert isinstance(small, list) and "too small a share" in str(small[0].not_applicable)
    assert "80%" in expectation(context(0.8).facts).evidence


def test_a_language_model_inside_a_wrapper_is_found_and_named() -> None:
    """A LightningModule (or any wrapper) holding the HF model: the model inside is patched."""

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm = tiny_llama()

    wrapper = Wrapper()
    result = apply_chunked_loss(wrapper)
    assert result.applied and result.targets == ("lm",), result
    assert getattr(wrapper.lm, CHUNKED_MARK) and not hasattr(wrapper, CHUNKED_MARK)
    output = wrapper.lm(**token_batches(1)[0])
    assert output.logits is None and output.loss is not None


def test_the_facts_see_the_logits_of_a_language_model_inside_a_wrapper() -> None:
    """The stage proposes the chunked loss from these facts: through a LightningModule without a
    forward of its own they read None, and a Lightning tune called the loss 'not applicable'."""

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm = tiny_llama()

    wrapper, batch = Wrapper(), token_batches(1)[0]
    bare = lm_head_census(wrapper.lm, lambda: wrapper.lm(**batch).loss)
    logits, held = lm_head_census(wrapper, lambda: wrapper.lm(**batch).loss)
    assert logits == bare[0] == 2 * 12 * 96 * 4
    assert held is not None and held > logits


def test_it_switches_off_and_on_between_steps_for_tuning_inside_the_run() -> None:
    """``Technique.toggle``: off, the model computes its own logits and loss again (exactly the
    unpatched model's); on, the chunked loss again; a model without the patch has nothing to
    switch. The registry switches it by what a config asks, and only a switchable transform
    counts as switchable without the engine's step hooks."""
    from torchturbo.techniques import registry
    from torchturbo.techniques.chunked_loss import TECHNIQUE

    torch.manual_seed(0)
    plain = tiny_llama()
    model = copy.deepcopy(plain)
    assert not TECHNIQUE.toggle(model, False)
    apply_chunked_loss(model)
    batch = token_batches(1)[0]
    wrapped_calls = []
    chunked_forward = model.forward

    def wrapper(*args, **kwargs):  # as accelerate wraps the forward in autocast
        wrapped_calls.append(1)
        return chunked_forward(*args, **kwargs)

    model.forward = wrapper
    registry.set_toggles(model, TurboConfig())
    off = model(**batch)
    assert wrapped_calls == [1]  # switching off keeps what wraps the forward
    assert off.logits is not None
    assert torch.equal(off.loss, plain(**batch).loss)
    registry.set_toggles(model, TurboConfig().replace(chunked_loss__enabled=True))
    assert model(**batch).logits is None
    base = TurboConfig()
    assert registry.switchable_by_toggle(base, base.replace(chunked_loss__enabled=True))
    assert not registry.switchable_by_toggle(base, base.replace(precision__dtype="bf16"))
    assert registry.switchable_per_step(base, base.replace(precision__dtype="bf16"))
    assert not registry.switchable_per_step(base, base.replace(memory_format__channels_last=True))
