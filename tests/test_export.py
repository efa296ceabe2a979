"""Export round trip: the reloaded artefact computes what the eager model computes."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from torchturbo.techniques.export import (
    ExportVerificationError,
    capture_model_inputs,
    export_model,
    export_recipe,
)
from torchturbo.techniques.fusion import fuse_for_inference
from torchturbo.workloads import get_workload


def _small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(512, 4)
    ).eval()


def test_export_round_trip_at_two_batch_sizes(tmp_path: Path) -> None:
    model = _small_cnn()
    x = torch.randn(3, 3, 8, 8)
    report = export_model(model, (x,), tmp_path / "model.pt2")
    assert report.path.stat().st_size == report.size_bytes > 0
    assert report.checked_batch_sizes == (3, 6)
    assert report.max_rel_diff <= report.tolerance
    # Independently of export_model's own check: a fresh load at a batch size never seen.
    loaded = torch.export.load(tmp_path / "model.pt2").module()
    y = torch.randn(5, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(loaded(y), model(y), rtol=1e-5, atol=1e-6)


def test_negative_control_changed_weights_are_detected(tmp_path: Path) -> None:
    """The saved artefact holds the weights at export time; a later change must show up."""
    model = _small_cnn()
    x = torch.randn(2, 3, 8, 8)
    export_model(model, (x,), tmp_path / "model.pt2", dynamic_batch=False)
    loaded = torch.export.load(tmp_path / "model.pt2").module()
    with torch.no_grad():
        model[4].weight.mul_(1.01)
        assert not torch.allclose(loaded(x), model(x), rtol=1e-5, atol=1e-6)


def test_verification_rejects_a_wrong_artefact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _small_cnn()
    real_load = torch.export.load

    def perturbed_load(
        path: Path,
    ) -> SimpleNamespace:  # an artefact whose weights drifted from the model's
        program = real_load(path)
        module = program.module()
        with torch.no_grad():
            next(module.parameters()).add_(0.1)
        return SimpleNamespace(module=lambda: module)

    monkeypatch.setattr(torch.export, "load", perturbed_load)
    with pytest.raises(ExportVerificationError, match="differs"):
        export_model(model, (torch.randn(2, 3, 8, 8),), tmp_path / "model.pt2")


def test_torchscript_legacy_round_trip(tmp_path: Path) -> None:
    model = _small_cnn()
    report = export_model(
        model, (torch.randn(2, 3, 8, 8),), tmp_path / "m.pt", method="torchscript"
    )
    assert report.method == "torchscript"
    assert report.max_rel_diff <= report.tolerance


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    model = _small_cnn()
    x = (torch.randn(2, 3, 8, 8),)
    with pytest.raises(ValueError, match="choose one of"):
        export_model(model, x, tmp_path / "m.pt2", method="onnx")
    with pytest.raises(ValueError, match=r"\.pt2"):
        export_model(model, x, tmp_path / "m.pt")
    with pytest.raises(ValueError, match="batch of >= 2"):
        export_model(model, (torch.randn(1, 3, 8, 8),), tmp_path / "m.pt2")
    with pytest.raises(ValueError, match="eval-mode"):
        export_model(model.train(), x, tmp_path / "m.pt2")


def test_export_recipe_captures_dict_inputs(tmp_path: Path) -> None:
    recipe = get_workload("text", num_samples=8)
    model = recipe.model().eval()
    (batch,) = capture_model_inputs(model, recipe, batch_size=2)
    assert isinstance(batch, dict) and batch["tokens"].shape[0] == 2
    report = export_recipe(recipe, tmp_path / "text.pt2")
    assert report.checked_batch_sizes == (2, 4)
    assert report.max_rel_diff <= report.tolerance


def test_fused_model_exports(tmp_path: Path) -> None:
    """fuse_for_inference's GraphModule is a valid export input (all eval, no BatchNorm left)."""
    model = _small_cnn()
    fused, report = fuse_for_inference(model)
    assert report.fused == ("0+1",)
    x = torch.randn(2, 3, 8, 8)
    exported = export_model(fused, (x,), tmp_path / "fused.pt2")
    assert exported.max_rel_diff <= exported.tolerance
    loaded = torch.export.load(tmp_path / "fused.pt2").module()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=1e-5, atol=1e-6)
