"""Export round trip: the reloaded artefact computes what the eager model computes."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from torchturbo.techniques.tools.export import (
    ExportVerificationError,
    capture_model_inputs,
    export_model,
    export_recipe,
)
from torchturbo.techniques.tools.fusion import fuse_for_inference
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


def test_a_slice_of_a_large_tensor_does_not_carry_its_storage_into_the_file(
    tmp_path: Path,
) -> None:
    """torch.export.save stores the example inputs: a 4-row view must not bring 12 MB along."""
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 8)).eval()
    big = torch.randn(3072, 1024)  # 12.6 MB of which the example uses 4 rows (16 KB)
    report = export_model(model, (big[:4],), tmp_path / "m.pt2")
    # The file is the weights (4.2 MB) plus the graph, metadata and the 16 KB example: measured
    # 4.26 MB against 16.8 MB when the view was saved as it is.
    assert report.weights_bytes == sum(p.nbytes for p in model.parameters())
    assert report.weights_bytes < report.size_bytes < report.weights_bytes + 512 * 1024


def test_torchscript_notices_of_torch_2_13_and_2_14_are_silenced_and_nothing_else() -> None:
    import warnings

    from torchturbo.techniques.tools.export import _jit_deprecation_silenced

    notices = [
        ("`torch.jit.trace` is deprecated. Please switch to `torch.compile`.", DeprecationWarning),
        ("`torch.jit.save` is deprecated. Please switch to `torch.export`.", FutureWarning),
        ("`torch.jit.load` is not supported in Python 3.14+ and may break.", FutureWarning),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with _jit_deprecation_silenced():
            for message, category in notices:
                warnings.warn(message, category, stacklevel=1)
            # Negative control: another deprecation inside the block still surfaces.
            with pytest.raises(FutureWarning, match="other"):
                warnings.warn("some other API is deprecated", FutureWarning, stacklevel=1)


class _ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).mean(dim=(2, 3)))


def _conv_bn_recipe():
    """tests/recipes/tiny.py's data and optimizer, with a model that has BatchNorm to fold."""
    import dataclasses

    from torchturbo.recipe import load_recipe

    tiny = load_recipe(str(Path(__file__).parent / "recipes" / "tiny.py") + ":recipe")
    return dataclasses.replace(tiny, name="conv-bn", model=_ConvBN)


def _trained(recipe, checkpoint_dir: Path, steps: int = 3) -> nn.Module:
    """Train with the engine and save as `torchturbo train` does; return the trained model."""
    from torchturbo.config import TurboConfig
    from torchturbo.engine import Turbo

    turbo = Turbo(TurboConfig(device="cpu"))
    model, optimizer = recipe.build()
    _, _, loader = turbo.setup(model, optimizer, recipe.dataset, batch_size=recipe.batch_size)
    for batch, _ in zip(loader, range(steps), strict=False):
        turbo.step(recipe.loss_fn, batch)
    turbo.save(checkpoint_dir)
    return model.eval()


def _batch_norm_nodes(path: Path) -> int:
    graph = torch.export.load(path).graph
    return sum("batch_norm" in str(node.target) for node in graph.nodes)


def test_export_from_a_train_checkpoint_computes_what_the_trained_model_computes(
    tmp_path: Path,
) -> None:
    recipe = _conv_bn_recipe()
    trained = _trained(recipe, tmp_path / "ckpt")
    report = export_recipe(recipe, tmp_path / "trained.pt2", checkpoint=tmp_path / "ckpt")
    loaded = torch.export.load(report.path).module()
    x = torch.randn(5, 3, 16, 16)
    with torch.no_grad():
        # The same ATen kernels on the same weights: equal up to reduction order (see RTOL).
        torch.testing.assert_close(loaded(x), trained(x), rtol=1e-5, atol=1e-6)
        # Negative control: the recipe's initial weights, which `export` used to write, differ.
        torch.manual_seed(recipe.seed)
        initial = recipe.model().eval()
        assert not torch.allclose(loaded(x), initial(x), rtol=1e-3, atol=1e-4)
    assert _batch_norm_nodes(report.path) > 0


def test_fuse_folds_batch_norm_of_the_trained_model_before_export(tmp_path: Path) -> None:
    recipe = _conv_bn_recipe()
    trained = _trained(recipe, tmp_path / "ckpt")
    path = tmp_path / "fused.pt2"
    export_recipe(recipe, path, checkpoint=tmp_path / "ckpt", fuse=True)
    assert _batch_norm_nodes(path) == 0
    x = torch.randn(5, 3, 16, 16)
    with torch.no_grad():
        # Folding rescales the conv weights, so the sums round differently: fusion.md measured
        # ~3e-7 of the output's magnitude; 1e-5 relative leaves margin and still catches a
        # wrong fold (which is off by the BN scale, i.e. by O(1)).
        torch.testing.assert_close(
            torch.export.load(path).module()(x), trained(x), rtol=1e-5, atol=1e-5
        )


def test_a_checkpoint_of_another_model_is_refused_by_name(tmp_path: Path) -> None:
    _trained(_conv_bn_recipe(), tmp_path / "ckpt")
    other = get_workload("text", num_samples=8)
    with pytest.raises(ValueError, match="does not fit 'text'"):
        export_recipe(other, tmp_path / "x.pt2", checkpoint=tmp_path / "ckpt")


def test_a_missing_or_empty_checkpoint_directory_is_named(tmp_path: Path) -> None:
    from torchturbo.resume.files import CheckpointError

    recipe = _conv_bn_recipe()
    with pytest.raises(CheckpointError, match=r"no trained weights to export: .* does not exist"):
        export_recipe(recipe, tmp_path / "x.pt2", checkpoint=tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="holds no checkpoint"):
        export_recipe(recipe, tmp_path / "x.pt2", checkpoint=tmp_path / "empty")
