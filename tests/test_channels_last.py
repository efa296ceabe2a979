"""channels_last: strides prove the layout, outputs match, non-conv models are left alone."""

from __future__ import annotations

import copy

import torch
from conftest import MLP, ConvNet, classification_loss

from torchturbo import Turbo, TurboConfig


def test_channels_last_converts_weights_and_inputs_and_matches_outputs():
    model = ConvNet()
    reference = copy.deepcopy(model)
    turbo = Turbo(TurboConfig(device="cpu").replace(memory_format__channels_last=True))
    model, _, _ = turbo.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert turbo.applied["channels_last"] is None
    conv = model.features[0][0]
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert (
        not conv.weight.is_contiguous()
    )  # negative control: NCHW-contiguous is a different layout

    x = torch.randn(4, 3, 16, 16)
    with torch.no_grad():
        # NHWC convolutions accumulate in another order: agreement to float32 rounding.
        torch.testing.assert_close(model(x), reference(x), rtol=1e-4, atol=1e-5)

    seen = _conv_tensors_in_a_step(turbo, model, x)
    assert seen["input"].is_contiguous(memory_format=torch.channels_last)
    assert seen["input"].dtype == torch.float32
    # The effect that makes it fast: the convolution computes and returns NHWC activations.
    assert seen["output"].is_contiguous(memory_format=torch.channels_last)


def _conv_tensors_in_a_step(turbo: Turbo, model, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The first conv's input and output during one engine step on NCHW-contiguous ``x``."""
    seen = {}
    conv = model.features[0][0]
    conv.register_forward_hook(lambda m, args, out: seen.update(input=args[0], output=out))
    turbo.step(classification_loss, (x, torch.tensor([0, 1, 2, 3])))
    return seen


def test_negative_control_without_channels_last_the_step_stays_nchw():
    turbo = Turbo(TurboConfig(device="cpu"))
    model = ConvNet()
    turbo.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    seen = _conv_tensors_in_a_step(turbo, model, torch.randn(4, 3, 16, 16))
    assert not seen["input"].is_contiguous(memory_format=torch.channels_last)
    assert not seen["output"].is_contiguous(memory_format=torch.channels_last)


def test_channels_last_on_a_model_without_convolutions_is_a_recorded_no_op():
    turbo = Turbo(TurboConfig(device="cpu").replace(memory_format__channels_last=True))
    model = MLP()
    turbo.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert "no Conv2d" in turbo.applied["channels_last"]
    # Integer tensors and non-4-D tensors pass through untouched.
    from torchturbo.base.nhwc import to_channels_last

    ids = torch.zeros(2, 3, 4, 5, dtype=torch.int64)
    assert to_channels_last(ids) is ids
