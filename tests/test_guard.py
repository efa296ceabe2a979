"""The non-finite guard names the step and the module; unreadable batches name their structure."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

from torchturbo import Turbo, TurboConfig
from torchturbo.guard import BatchError, NonFiniteError, describe_batch


class Log(nn.Module):
    """log(x - shift): NaN wherever x < shift, so the shift decides when the model breaks."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x.abs() + 1 - self.shift)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        OrderedDict(fc1=nn.Linear(4, 8), act=nn.ReLU(), boom=Log(), fc2=nn.Linear(8, 2))
    )


def _loss(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def _setup(patience: int = 3):
    turbo = Turbo(TurboConfig(device="cpu").replace(reliability__nonfinite_patience=patience))
    model = _model()
    turbo.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return turbo, model


def _batch():
    return torch.randn(6, 4), torch.randint(0, 2, (6,))


def test_a_loss_that_stays_nan_names_the_step_and_the_layer():
    turbo, model = _setup(patience=3)
    model.boom.shift = 1e6  # every output of "boom" is NaN from now on
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(2):
        assert turbo.step(_loss, _batch()).skipped
    with pytest.raises(NonFiniteError, match=r"3 consecutive optimizer steps.*step 3") as caught:
        turbo.step(_loss, _batch())
    assert "'boom'" in str(caught.value)
    # Without a scaler the guard skipped the non-finite steps: the weights stayed finite.
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


def test_negative_control_a_transient_nan_is_skipped_and_forgiven():
    turbo, model = _setup(patience=2)
    turbo.step(_loss, _batch())
    model.boom.shift = 1e6
    assert turbo.step(_loss, _batch()).skipped
    model.boom.shift = 0.0
    for _ in range(3):
        assert not turbo.step(_loss, _batch()).skipped
    assert turbo.skipped_steps == 1 and turbo.guard.streak == 0
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_patience_zero_turns_the_guard_off():
    turbo, model = _setup(patience=0)
    model.boom.shift = 1e6
    for _ in range(4):
        assert not turbo.step(_loss, _batch()).skipped  # the NaN goes into the weights
    assert not all(torch.isfinite(p).all() for p in model.parameters())


def test_a_batch_of_the_wrong_structure_names_its_structure():
    turbo, _ = _setup()

    def dict_loss(model, batch):
        return nn.functional.cross_entropy(model(batch["x"]), batch["y"])

    with pytest.raises(BatchError, match=r"tuple\(Tensor\[6, 4\] float32, Tensor\[6\] int64\)"):
        turbo.step(dict_loss, _batch())


def test_describe_batch_nests():
    batch = {"tokens": torch.zeros(2, 3, dtype=torch.int64), "meta": ["a", 1]}
    assert describe_batch(batch) == "{'tokens': Tensor[2, 3] int64, 'meta': list(str, int)}"
