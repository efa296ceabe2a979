"""BatchNorm folding: eval outputs unchanged, training mode refused, fallback when untraceable."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchturbo.techniques.tools.fusion import fuse_for_inference
from torchturbo.workloads import get_workload

# Folding rescales each weight by gamma / sqrt(var + eps) in float32 before the convolution
# instead of after it: every output moves by a few float32 ulps per layer (measured ~5e-7 of the
# output's magnitude through 15 folded layers). 1e-5 of the magnitude leaves 20x headroom and is
# still 100x below what the negative control (batch instead of running statistics) produces.
RTOL = 1e-5

WORKLOAD_INPUTS = {"vision": (8, 3, 32, 32), "segmentation": (4, 1, 32, 32)}


def _randomise_batch_norms(model: nn.Module) -> None:
    """Non-trivial running statistics and affine parameters, as after some training."""
    gen = torch.Generator().manual_seed(1)
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            n = module.num_features
            module.running_mean.copy_(0.5 * torch.randn(n, generator=gen))
            module.running_var.copy_(0.5 + 1.5 * torch.rand(n, generator=gen))
            with torch.no_grad():
                module.weight.copy_(0.5 + torch.rand(n, generator=gen))
                module.bias.copy_(0.2 * torch.randn(n, generator=gen))


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def _count(model: nn.Module, kind: type[nn.Module]) -> int:
    return sum(isinstance(m, kind) for m in model.modules())


@pytest.mark.parametrize("workload", sorted(WORKLOAD_INPUTS))
def test_fused_model_matches_eval_model(workload: str) -> None:
    model = get_workload(workload, num_samples=8).model()
    _randomise_batch_norms(model)
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fused, report = fuse_for_inference(model)
    assert report.traced and report.trace_error is None
    assert len(report.fused) == _count(model, nn.BatchNorm2d)  # every conv+bn in these models
    assert _count(fused, nn.BatchNorm2d) == 0
    assert not any(m.training for m in fused.modules())
    x = torch.randn(WORKLOAD_INPUTS[workload])
    with torch.no_grad():
        assert _relative_error(fused(x), model(x)) < RTOL
    # The input model is untouched: same tensors, same modules.
    assert _count(model, nn.BatchNorm2d) == len(report.fused)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])


def test_negative_control_batch_statistics_differ() -> None:
    """Folding the batch's statistics (what training-mode BN uses) must fail the same check."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
    _randomise_batch_norms(model)
    x = torch.randn(4, 3, 8, 8)
    with torch.no_grad():
        conv_out = model[0](x)
    wrong = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
    wrong.load_state_dict(model.state_dict())
    wrong[1].running_mean.copy_(conv_out.mean(dim=(0, 2, 3)))
    wrong[1].running_var.copy_(conv_out.var(dim=(0, 2, 3)))
    model.eval()
    fused_wrong, _ = fuse_for_inference(wrong.eval())
    fused_right, _ = fuse_for_inference(model)
    with torch.no_grad():
        reference = model(x)
        assert _relative_error(fused_right(x), reference) < RTOL
        assert _relative_error(fused_wrong(x), reference) > 100 * RTOL


def test_linear_batchnorm1d_is_folded() -> None:
    model = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 2))
    _randomise_batch_norms(model)
    model.eval()
    fused, report = fuse_for_inference(model)
    assert report.fused == ("0+1",)
    x = torch.randn(7, 6)
    with torch.no_grad():
        assert _relative_error(fused(x), model(x)) < RTOL


def test_training_mode_is_refused() -> None:
    model = get_workload("vision", num_samples=8).model()
    with pytest.raises(ValueError, match="eval-mode"):
        fuse_for_inference(model)
    model.eval()
    model.stem[1].train()  # one BatchNorm left in training mode is enough to refuse
    with pytest.raises(ValueError, match=r"stem\.1"):
        fuse_for_inference(model)


class _Branchy(nn.Module):
    """Data-dependent control flow: torch.fx cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.conv = nn.Conv2d(8, 8, 1)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body(x)
        if y.mean() > 0:
            return self.bn(self.conv(y))
        return -self.bn(self.conv(y))


def test_untraceable_model_falls_back_to_sequential_pairs() -> None:
    model = _Branchy()
    _randomise_batch_norms(model)
    model.eval()
    fused, report = fuse_for_inference(model)
    assert not report.traced
    assert report.trace_error is not None and "TraceError" in report.trace_error
    # Only the Sequential pair: conv/bn outside a Sequential cannot be proven adjacent.
    assert report.fused == ("body.0+body.1",)
    assert isinstance(fused.body[1], nn.Identity)
    assert isinstance(model.body[1], nn.BatchNorm2d)
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        assert _relative_error(fused(x), model(x)) < RTOL


class _SharedOutput(nn.Module):
    """A conv whose output also feeds a residual: folding the BN into it would change that."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return self.bn(y) + y


def test_conv_with_other_users_is_skipped() -> None:
    model = _SharedOutput()
    _randomise_batch_norms(model)
    model.eval()
    fused, report = fuse_for_inference(model)
    assert report.fused == ()
    assert len(report.skipped) == 1 and "also used" in report.skipped[0]
    x = torch.randn(2, 4, 6, 6)
    with torch.no_grad():
        assert torch.equal(fused(x), model(x))


@pytest.mark.slow
def test_fused_model_compiles_with_freezing() -> None:
    """The inference benchmark's compile path: fused GraphModule + inductor freezing, same outputs.

    Inductor reorders reductions and may pick other conv algorithms, so the tolerance is wider
    than folding's: 1e-4 of the output's magnitude (measured 2e-7 on this model).
    """
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 1)
    )
    _randomise_batch_norms(model)
    model.eval()
    fused, _ = fuse_for_inference(model)
    compiled = torch.compile(fused, dynamic=False, options={"freezing": True})
    x = torch.randn(2, 3, 8, 8)
    with torch.inference_mode():
        assert _relative_error(compiled(x), model(x)) < 1e-4
