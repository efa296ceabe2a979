"""The non-finite guard names the step and the module; unreadable batches name their structure."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

from torchturbo import Turbo, TurboConfig
from torchturbo.reliability.guard import BatchError, NonFiniteError, describe_batch


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


# --- what the optimizer applies: gradients after unscaling and clipping ----------------------


def _clipping_by_nan(dtype: str = "fp32", patience: int = 3):
    """An engine whose clipping coefficient is NaN, as ``max_norm = nan`` made it before the
    config refused it: the gradients are finite until clipping multiplies them by NaN."""
    config = TurboConfig(device="cpu").replace(
        clipping__max_norm=1.0,
        precision__dtype=dtype,
        reliability__nonfinite_patience=patience,
    )
    object.__setattr__(config.clipping, "max_norm", float("nan"))  # past validation, on purpose
    turbo = Turbo(config)
    model = _model()
    turbo.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return turbo, model


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_gradients_clipping_made_nan_are_skipped_not_applied(dtype):
    turbo, model = _clipping_by_nan(dtype)
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(2):
        metrics = turbo.step(_loss, _batch())
        # The loss and the gradients before clipping were finite: only the applied ones are not.
        assert torch.isfinite(metrics.loss) and torch.isfinite(metrics.grad_norm)
        assert metrics.skipped
    with pytest.raises(NonFiniteError, match="3 consecutive"):
        turbo.step(_loss, _batch())
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_negative_control_without_the_guard_nan_clipping_destroys_the_weights(dtype):
    turbo, model = _clipping_by_nan(dtype, patience=0)
    turbo.step(_loss, _batch())
    assert all(torch.isnan(p).all() for p in model.parameters())


def test_fp16_overflow_is_still_the_scalers_to_skip():
    """Under a GradScaler an overflow skips the step and lowers the scale without counting
    towards the guard's patience: the guard counts only what the scaler cannot see."""
    config = TurboConfig(device="cpu").replace(precision__dtype="fp16", clipping__max_norm=1.0)
    turbo = Turbo(config)
    model = _model()
    turbo.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]
    scale = turbo.steps["precision"].scaler.get_scale()
    for _ in range(5):  # x 1e35, then x the scale (65536): the gradients overflow fp32
        assert turbo.step(lambda m, b: _loss(m, b) * 1e35, _batch()).skipped
    assert turbo.guard.streak == 0 and turbo.steps["precision"].scaler.get_scale() < scale
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


# --- non-finite inputs and the end of a run ----------------------------------------------------


def test_non_finite_inputs_are_named_as_the_cause():
    turbo, _ = _setup(patience=2)
    x, y = _batch()
    x[1, 2] = float("inf")
    turbo.step(_loss, (x, y))
    with pytest.raises(NonFiniteError, match=r"inputs are not finite: batch\[0\]: 1 of 24 values"):
        turbo.step(_loss, (x, y))


def test_a_run_ending_inside_a_non_finite_streak_is_an_error():
    turbo, model = _setup(patience=3)
    turbo.guard.raise_if_ending_nonfinite(model, 0)  # negative control: nothing went wrong
    model.boom.shift = 1e6
    turbo.step(_loss, _batch())
    with pytest.raises(NonFiniteError, match=r"ended with 1 non-finite optimizer step.*'boom'"):
        turbo.guard.raise_if_ending_nonfinite(model, 1)


def test_non_finite_weights_are_never_saved(tmp_path):
    turbo, model = _setup(patience=0)
    turbo.step(_loss, _batch())
    turbo.save(tmp_path)  # finite: saved
    model.boom.shift = 1e6
    turbo.step(_loss, _batch())  # the guard is off: NaN reaches the weights
    with pytest.raises(NonFiniteError, match=r"non-finite weights: model\['fc1\.weight'\]"):
        turbo.save(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-0000000001"]


def test_a_loss_fn_that_returns_a_string_count_is_a_clear_error():
    turbo, _ = _setup()
    with pytest.raises(BatchError, match=r"it returned tuple\(Tensor\[\] float32, str\)"):
        turbo.step(lambda model, batch: (_loss(model, batch), "eight"), _batch())
