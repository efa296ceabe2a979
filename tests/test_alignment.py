"""Alignment audit finds misaligned dims; padding leaves outputs, loss and grads unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchturbo.techniques.tools.alignment import (
    audit_alignment,
    pad_embedding,
    pad_linear_classifier,
    round_up,
)


class TextClassifier(nn.Module):
    def __init__(self, vocab: int = 1000, dim: int = 32, classes: int = 10):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.head = nn.Linear(dim, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids).mean(1))


def _dyadic_(model: nn.Module) -> nn.Module:
    """Round parameters to multiples of 1/8 in [-1, 1]: with 8 tokens and these, every product and
    sum is exact in float32, so equality tests the maths, not which BLAS tiling rounded how."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randint(-8, 9, p.shape) / 8)
    return model


def test_audit_finds_planted_misaligned_layers_and_batch_dims() -> None:
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3),
        nn.Flatten(),
        nn.Linear(16, 30),
        nn.Linear(30, 32),
        nn.Embedding(1000, 24),
    )
    batch = {
        "ids": torch.zeros(6, 13, dtype=torch.long),
        "mask": torch.ones(6, 13, dtype=torch.bool),  # same sizes: not reported twice
        "images": torch.zeros(8, 3, 4, 4),
    }
    found = {(f.where, f.what, f.value) for f in audit_alignment(model, batch)}
    assert found == {
        ("0", "Conv2d.in_channels", 3),
        ("2", "Linear.out_features", 30),
        ("3", "Linear.in_features", 30),
        ("4", "Embedding.num_embeddings", 1000),  # a multiple of 8 but not of 64
        ("batch['ids']", "batch size", 6),
        ("batch['ids']", "sequence length", 13),
    }
    # Negative control: an aligned model and batch produce no finding.
    aligned = nn.Sequential(nn.Linear(16, 32), nn.Embedding(1024, 64))
    assert audit_alignment(aligned, (torch.zeros(8, 16, dtype=torch.long),)) == []


def test_finding_suggests_the_next_multiple() -> None:
    (finding,) = audit_alignment(nn.Embedding(50257, 768))
    assert finding.aligned == 50304 == round_up(50257, 64)
    assert "50304" in str(finding)


def _loss_and_grads(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor):
    model.zero_grad()
    logits = model(ids)
    loss = F.cross_entropy(logits, targets)
    loss.backward()
    return logits.detach(), loss.detach()


@pytest.mark.parametrize("output", ["slice", "masked"])
def test_padded_model_gives_identical_logits_loss_and_grads(output: str) -> None:
    model = _dyadic_(TextClassifier(vocab=1000, classes=10))
    padded = TextClassifier(vocab=1000, classes=10)
    padded.load_state_dict(model.state_dict())
    padded.embed = pad_embedding(padded.embed, 64)
    padded.head = pad_linear_classifier(padded.head, 8, output=output)
    assert padded.embed.num_embeddings == 1024 and padded.head.weight.shape[0] == 16

    ids = torch.randint(1, 1000, (8, 8))
    targets = torch.randint(0, 10, (8,))
    logits, loss = _loss_and_grads(model, ids, targets)
    padded_logits, padded_loss = _loss_and_grads(padded, ids, targets)

    # Exact: the real logits are the same dot products (padded rows only add extra outputs),
    # and masked logits are -inf, which contribute exp(-inf) = 0 to the softmax.
    assert torch.equal(padded_logits[:, :10], logits)
    if output == "masked":
        assert padded_logits.shape == (8, 16) and torch.isneginf(padded_logits[:, 10:]).all()
    assert torch.equal(padded_loss, loss)
    assert torch.equal(padded.head.bias.grad[:10], model.head.bias.grad)
    # Gradients through the head's matmuls are not dyadic ((softmax - onehot) / batch) and run
    # through gemms of another shape (16 vs 10 classes; the extra terms are exact zeros), whose
    # tiling may round differently: equal to a few float32 ulp, not bitwise.
    few_ulp = {"rtol": 1e-6, "atol": 1e-9}
    torch.testing.assert_close(padded.head.weight.grad[:10], model.head.weight.grad, **few_ulp)
    torch.testing.assert_close(padded.embed.weight.grad[:1000], model.embed.weight.grad, **few_ulp)
    # Padded rows get zero gradient, so training keeps them at zero.
    assert not padded.head.weight.grad[10:].any() and not padded.embed.weight.grad[1000:].any()


def test_negative_control_unmasked_padding_changes_the_loss() -> None:
    # Padding the head without hiding the extra logits adds exp(0) terms to the softmax: wrong.
    head = nn.Linear(16, 10)
    padded = pad_linear_classifier(head, 8, output="slice")
    x, targets = torch.randn(4, 16), torch.randint(0, 10, (4,))
    unmasked = F.linear(x, padded.weight, padded.bias)
    assert not torch.allclose(F.cross_entropy(unmasked, targets), F.cross_entropy(head(x), targets))


def test_truncation_like_the_article_loses_information() -> None:
    # The article "aligns" a 1001-wide input by dropping its last column; padding keeps it.
    linear = nn.Linear(1001, 8)
    x = torch.randn(2, 1001)
    truncated = F.linear(x[:, :1000], linear.weight[:, :1000], linear.bias)
    assert not torch.allclose(truncated, linear(x))


def test_padding_helpers_reject_bad_arguments() -> None:
    with pytest.raises(ValueError, match="output"):
        pad_linear_classifier(nn.Linear(4, 3), output="crop")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="multiple"):
        pad_linear_classifier(nn.Linear(4, 3), 0)
    with pytest.raises(ValueError, match="expected nn"):
        pad_embedding(nn.Linear(4, 3))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="vocab_multiple"):
        audit_alignment(nn.Linear(4, 3), vocab_multiple=-1)
