"""Mixed precision, loss scaling and clipping against fp32 references."""

from __future__ import annotations

import copy

import torch
from conftest import ConvNet, classification_loss

from torchturbo import Turbo, TurboConfig


def _data(n: int = 32, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 16, 16, generator=generator)
    y = (x[:, 0].mean(dim=(1, 2)) > 0).long() + 2 * (x[:, 1].mean(dim=(1, 2)) > 0).long()
    return x, y


def _train(config: TurboConfig, model, steps: int):
    turbo = Turbo(config)
    model, _, _ = turbo.setup(model, torch.optim.Adam(model.parameters(), lr=1e-2))
    batch = _data()
    return [float(turbo.step(classification_loss, batch).loss) for _ in range(steps)], turbo


def test_bf16_loss_tracks_fp32_and_falls():
    model = ConvNet()
    fp32, _ = _train(TurboConfig(device="cpu"), copy.deepcopy(model), 50)
    bf16, _ = _train(TurboConfig(device="cpu").replace(precision__dtype="bf16"), model, 50)
    # bf16 keeps 8 mantissa bits (~0.4% per rounding); a 2-conv net's loss stays within 2%.
    assert abs(bf16[0] - fp32[0]) <= 0.02 * fp32[0]
    assert sum(bf16[-5:]) / 5 < 0.5 * bf16[0]
    # and it tracks the fp32 run: the same model reaches a similar loss (bf16 noise, not drift)
    assert abs(sum(bf16[-5:]) - sum(fp32[-5:])) / 5 < 0.15 * fp32[0]


def test_fp16_scaler_skips_a_step_with_an_injected_inf_and_counts_it():
    model = ConvNet()
    turbo = Turbo(TurboConfig(device="cpu").replace(precision__dtype="fp16"))
    model, _, _ = turbo.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]
    x, y = _data()
    x[0, 0, 0, 0] = float("inf")
    metrics = turbo.step(classification_loss, (x, y))
    assert metrics.optimizer_stepped and metrics.skipped
    assert turbo.skipped_steps == 1
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    clean = turbo.step(classification_loss, _data())
    assert not clean.skipped and turbo.skipped_steps == 1


def test_clipping_under_fp16_scaler_clips_the_unscaled_gradient():
    model = ConvNet()
    x, y = _data()
    reference = copy.deepcopy(model)
    classification_loss(reference, (x, y)).backward()
    true_norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
    max_norm = float(true_norm) / 4  # so that clipping is active

    config = TurboConfig(device="cpu").replace(precision__dtype="fp16", clipping__max_norm=max_norm)
    turbo = Turbo(config)
    model, _, _ = turbo.setup(model, torch.optim.SGD(model.parameters(), lr=1.0))
    metrics = turbo.step(classification_loss, (x, y))
    # fp16 autocast computes the convs in half precision: the norm agrees to ~1%.
    torch.testing.assert_close(metrics.grad_norm, true_norm, rtol=2e-2, atol=0)
    # Negative control: a norm read before unscale_ is the loss scale (65536) times too large.
    assert turbo.scaler.get_scale() * float(true_norm) > 1000 * float(metrics.grad_norm)
    expected = [p - g * (max_norm / true_norm) for p, g in _params_and_grads(reference)]
    for got, want in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(got.detach(), want, rtol=2e-2, atol=2e-4)


def _params_and_grads(model):
    return [(p.detach(), p.grad) for p in model.parameters()]


def test_tf32_switch_is_scoped_to_the_engine():
    before = torch.get_float32_matmul_precision()
    turbo = Turbo(TurboConfig(device="cpu").replace(precision__dtype="tf32"))
    model = ConvNet()
    turbo.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert torch.get_float32_matmul_precision() == "high"
    turbo.close()
    assert torch.get_float32_matmul_precision() == before


def test_fp32_has_no_scaler_and_fp16_has_one():
    assert Turbo(TurboConfig(device="cpu")).scaler is None
    assert Turbo(TurboConfig(device="cpu").replace(precision__dtype="bf16")).scaler is None
    assert Turbo(TurboConfig(device="cpu").replace(precision__dtype="fp16")).scaler is not None
