"""Mixed precision, loss scaling and clipping against fp32 references; the forward really runs
in the requested dtype."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from conftest import ConvNet, classification_loss

from torchturbo import Turbo, TurboConfig
from torchturbo.config import PrecisionConfig
from torchturbo.techniques.precision import float32_matmul_precision


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
    scale = turbo.steps["precision"].scaler.get_scale()
    assert scale * float(true_norm) > 1000 * float(metrics.grad_norm)
    expected = [p - g * (max_norm / true_norm) for p, g in _params_and_grads(reference)]
    for got, want in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(got.detach(), want, rtol=2e-2, atol=2e-4)


def _params_and_grads(model):
    return [(p.detach(), p.grad) for p in model.parameters()]


def _layer_output_dtypes(config: TurboConfig) -> dict[str, torch.dtype]:
    """The dtype each layer of a ConvNet returns during one engine step."""
    model = ConvNet()
    seen: dict[str, torch.dtype] = {}

    def record(name: str, module, args, output) -> None:
        seen[name] = output.dtype

    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.Conv2d, torch.nn.Linear)):
            module.register_forward_hook(functools.partial(record, name))
    turbo = Turbo(config)
    turbo.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    turbo.step(classification_loss, _data(8))
    return seen


@pytest.mark.parametrize(("dtype", "expected"), [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_the_forward_runs_in_the_autocast_dtype(dtype, expected):
    """Effect, not call: every conv and linear of the step returns ``expected``; fp32 does not."""
    lowered = _layer_output_dtypes(TurboConfig(device="cpu").replace(precision__dtype=dtype))
    assert lowered and set(lowered.values()) == {expected}
    # Negative control: the same step in fp32 keeps every layer in float32.
    assert set(_layer_output_dtypes(TurboConfig(device="cpu")).values()) == {torch.float32}


def test_tf32_is_reported_not_applied_on_cpu_and_leaves_the_switch_alone():
    """TF32 exists on CUDA tensor cores only: on CPU the engine says so and changes nothing."""
    before = torch.get_float32_matmul_precision()
    turbo = Turbo(TurboConfig(device="cpu").replace(precision__dtype="tf32"))
    model = ConvNet()
    turbo.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert "CUDA tensor-core format" in turbo.applied["precision"]
    turbo.step(classification_loss, _data(8))
    assert torch.get_float32_matmul_precision() == before


def test_tf32_scope_sets_and_restores_the_process_switch():
    """Where TF32 applies (CUDA >= 8.0) a step holds this scope, and only for its span."""
    before = torch.get_float32_matmul_precision()
    with float32_matmul_precision(PrecisionConfig(dtype="tf32")):
        assert torch.get_float32_matmul_precision() == "high"
    assert torch.get_float32_matmul_precision() == before


def test_loss_scale_round_trips_through_the_state_dict():
    turbo = Turbo(TurboConfig(device="cpu").replace(precision__dtype="fp16"))
    model = ConvNet()
    turbo.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _data()
    x[0, 0, 0, 0] = float("inf")
    turbo.step(classification_loss, (x, y))  # the scaler halves its scale on the overflow
    state = turbo.steps.state_dict()
    fresh = Turbo(turbo.config)
    fresh.steps.load_state_dict(state)
    scalers = (fresh.steps["precision"].scaler, turbo.steps["precision"].scaler)
    assert scalers[0].get_scale() == scalers[1].get_scale() == 2.0**15


def test_fp32_has_no_precision_step_hooks_bf16_no_scaler_and_fp16_one():
    """The engine reaches precision through the registry's step hooks alone."""
    cpu = TurboConfig(device="cpu")
    assert "precision" not in Turbo(cpu).steps.hooks
    assert Turbo(cpu.replace(precision__dtype="bf16")).steps["precision"].scaler is None
    assert Turbo(cpu.replace(precision__dtype="fp16")).steps["precision"].scaler is not None


@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0),
    reason="needs a CUDA device with TF32 (compute capability >= 8.0)",
)
def test_tf32_holds_high_matmul_precision_during_a_cuda_step_only():
    seen = []
    model = ConvNet()
    model.head.register_forward_hook(
        lambda m, args, out: seen.append(torch.get_float32_matmul_precision())
    )
    before = torch.get_float32_matmul_precision()
    turbo = Turbo(TurboConfig(device="cuda").replace(precision__dtype="tf32"))
    turbo.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert turbo.applied["precision"] is None
    turbo.step(classification_loss, _data(8))
    assert seen == ["high"] and torch.get_float32_matmul_precision() == before


def test_the_loss_scale_survives_a_checkpoint_and_an_older_ones_file_name(tmp_path):
    """Saved as the precision hooks' own file (precision.pt); a version-1 checkpoint's
    scaler.pt still loads (``StepHooks.older_state``)."""
    config = TurboConfig(device="cpu").replace(precision__dtype="fp16")
    turbo = Turbo(config)
    model = ConvNet()
    turbo.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _data()
    x[0, 0, 0, 0] = float("inf")
    turbo.step(classification_loss, (x, y))  # halves the scale
    saved = turbo.save(tmp_path / "ckpt")
    assert (saved / "precision.pt").is_file()
    fresh = Turbo(config)
    other = ConvNet()
    fresh.setup(other, torch.optim.SGD(other.parameters(), lr=0.1))
    fresh.load(tmp_path / "ckpt")
    assert fresh.steps["precision"].scaler.get_scale() == 2.0**15
    scaler_state = turbo.steps["precision"].scaler.state_dict()
    older = fresh.steps.states_in({"scaler.pt": scaler_state})
    assert older == {"precision": {"scaler": scaler_state}}
    assert fresh.steps.states_in({}) == {}  # fp32-era checkpoints: nothing to restore
