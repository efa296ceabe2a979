"""Accumulation over unequal micro-batches must reproduce the full-batch gradient."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from conftest import MLP
from torch import nn

from torchturbo import Turbo, TurboConfig
from torchturbo.data.collate import pad_collate
from torchturbo.techniques.tools.accumulation import scale_and_clip_gradients, scale_gradients

SIZES = [7, 2, 13, 4]  # deliberately unequal micro-batches


def _delta_after_one_window(model, batches, loss_fn, steps):
    """Run one accumulation window with SGD(lr=1): the parameter change is minus the gradient."""
    model = copy.deepcopy(model)
    before = [p.detach().clone() for p in model.parameters()]
    turbo = Turbo(TurboConfig(device="cpu").replace(accumulation__steps=steps))
    model, _optimizer, _ = turbo.setup(model, torch.optim.SGD(model.parameters(), lr=1.0))
    for batch in batches:
        metrics = turbo.step(loss_fn, batch)
    assert metrics.optimizer_stepped and turbo.optimizer_steps == 1
    return [b - p.detach() for b, p in zip(before, model.parameters(), strict=True)]


def _full_batch_grad(model, batch, loss_fn):
    model = copy.deepcopy(model)
    out = loss_fn(model, batch)
    loss = out[0] if isinstance(out, tuple) else out
    loss.backward()
    return [p.grad for p in model.parameters()]


def _relative_error(actual, expected) -> float:
    """||a - e|| / ||e|| over the whole gradient (all parameters flattened together).

    Per tensor would be wrong: some gradients are zero in exact arithmetic (an attention key
    bias cannot change a softmax), so their relative error is rounding noise over rounding noise.
    """
    a = torch.cat([t.flatten() for t in actual])
    e = torch.cat([t.flatten() for t in expected])
    return float((a - e).norm() / e.norm())


def _assert_grads_close(actual, expected):
    # fp32 sums in a different order (and, for text, attention over different padded lengths):
    # a relative error of 1e-5 is many ulps of float32 (1.2e-7) yet far below any real mistake.
    assert _relative_error(actual, expected) <= 1e-5


def _sample_batches():
    x = torch.randn(sum(SIZES), 16)
    y = torch.randint(0, 5, (sum(SIZES),))
    return (x, y), list(zip(x.split(SIZES), y.split(SIZES), strict=True))


def _sample_loss(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y), len(y)


def test_sample_weighted_accumulation_matches_full_batch():
    model = MLP()
    full, micro = _sample_batches()
    expected = _full_batch_grad(model, full, _sample_loss)
    actual = _delta_after_one_window(model, micro, _sample_loss, steps=len(SIZES))
    _assert_grads_close(actual, expected)


def test_default_count_is_the_batch_size():
    """A loss_fn returning only the loss is weighted by the batch's leading dimension."""
    model = MLP()
    full, micro = _sample_batches()
    expected = _full_batch_grad(model, full, _sample_loss)

    def mean_only(model, batch):
        return _sample_loss(model, batch)[0]

    actual = _delta_after_one_window(model, micro, mean_only, steps=len(SIZES))
    _assert_grads_close(actual, expected)


def test_negative_control_dividing_by_micro_steps_is_wrong():
    """The article's loss / accum_steps differs from the full-batch gradient on unequal batches."""
    model = MLP()
    full, micro = _sample_batches()
    expected = _full_batch_grad(model, full, _sample_loss)
    naive = copy.deepcopy(model)
    for batch in micro:
        (_sample_loss(naive, batch)[0] / len(SIZES)).backward()
    assert _relative_error([p.grad for p in naive.parameters()], expected) > 1e-2


class TinyTagger(nn.Module):
    def __init__(self, vocab: int = 64, width: int = 32, classes: int = 7):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layer = nn.TransformerEncoderLayer(
            width, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True
        )
        self.head = nn.Linear(width, classes)

    def forward(self, batch):
        hidden = self.layer(self.embed(batch["tokens"]), src_key_padding_mask=~batch["mask"])
        return self.head(hidden)


def _token_loss(model, batch):
    logits = model(batch)
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
    return loss, batch["mask"].sum()


def test_token_weighted_accumulation_matches_full_batch():
    generator = torch.Generator().manual_seed(1)
    lengths = [3, 40, 5, 17, 9, 30, 2, 11]
    samples = [
        {
            "tokens": torch.randint(0, 64, (n,), generator=generator),
            "labels": torch.randint(0, 7, (n,), generator=generator),
        }
        for n in lengths
    ]
    collate = functools.partial(pad_collate)
    full = collate(samples)
    micro = [collate(samples[i : i + 2]) for i in range(0, len(samples), 2)]
    model = TinyTagger()
    expected = _full_batch_grad(model, full, _token_loss)
    actual = _delta_after_one_window(model, micro, _token_loss, steps=len(micro))
    _assert_grads_close(actual, expected)
    # Negative control: weighting micro-batches by sample count instead of tokens is wrong.
    by_samples = _delta_after_one_window(
        model, micro, lambda m, b: _token_loss(m, b)[0], steps=len(micro)
    )
    assert _relative_error(by_samples, expected) > 1e-2


def test_trailing_partial_window_is_applied_by_the_setup_loader():
    model = MLP()
    dataset = torch.utils.data.TensorDataset(torch.randn(10, 16), torch.randint(0, 5, (10,)))
    turbo = Turbo(TurboConfig(device="cpu").replace(accumulation__steps=2))
    model, _optimizer, loader = turbo.setup(
        model, torch.optim.SGD(model.parameters(), lr=0.1), dataset, batch_size=4, shuffle=False
    )
    stepped = [turbo.step(_sample_loss, batch).optimizer_stepped for batch in loader]
    # 3 batches (4, 4, 2 samples): one full window, then the trailing single batch is applied.
    assert stepped == [False, True, True]
    assert turbo.optimizer_steps == 2


def test_flush_applies_an_open_window_in_manual_loops():
    model = MLP()
    turbo = Turbo(TurboConfig(device="cpu").replace(accumulation__steps=4))
    model, _optimizer, _ = turbo.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    _, micro = _sample_batches()
    turbo.step(_sample_loss, micro[0])
    assert turbo.flush() is True
    assert turbo.optimizer_steps == 1
    assert turbo.flush() is False
    assert all(p.grad is None for p in model.parameters())  # zero_grad(set_to_none=True)


@pytest.mark.parametrize("bad", [(torch.tensor(1.0), 3, 4), torch.ones(2)])
def test_malformed_loss_output_is_a_clear_error(bad):
    model = MLP()
    turbo = Turbo(TurboConfig(device="cpu"))
    turbo.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="loss_fn must return"):
        turbo.step(lambda m, b: bad, torch.randn(2, 16))


@pytest.mark.parametrize("max_norm", [0.1, 1e6], ids=["clipping", "not clipping"])
def test_correction_and_clipping_in_one_pass_equal_the_two_passes(max_norm):
    generator = torch.Generator().manual_seed(0)
    shapes = [(8, 4), (4,), (3, 3, 2)]
    grads = [torch.randn(shape, generator=generator) for shape in shapes]

    def params():
        made = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
        for p, g in zip(made, grads, strict=True):
            p.grad = g.clone()
        return made

    factor = torch.tensor(0.37)
    two_passes, one_pass = params(), params()
    scale_gradients(two_passes, factor)
    expected_norm = torch.nn.utils.clip_grad_norm_(two_passes, max_norm)
    norm = scale_and_clip_gradients(one_pass, factor, max_norm, 2.0)
    # The norm is factor x the unscaled norm rather than the norm of the scaled values: fp32
    # rounding apart, the same numbers.
    torch.testing.assert_close(norm, expected_norm, rtol=1e-6, atol=0)
    for a, b in zip(one_pass, two_passes, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)
