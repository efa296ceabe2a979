"""The built-in workloads build, learn, are deterministic and have the shapes they promise."""

from __future__ import annotations

import functools
import statistics

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader

from torchturbo.data.collate import pad_collate
from torchturbo.recipe import Recipe
from torchturbo.workloads import WORKLOADS, get_workload

# Small data and batches keep the file fast; the models are the default ones.
SMALL = {
    "vision": {"num_samples": 512, "batch_size": 8},
    "segmentation": {"num_samples": 256, "batch_size": 8},
    "text": {"num_samples": 512, "batch_size": 8},
}


def _loader(recipe: Recipe) -> DataLoader:
    return DataLoader(
        recipe.dataset,
        batch_size=recipe.batch_size,
        shuffle=True,
        collate_fn=recipe.collate,
        drop_last=True,
        generator=torch.Generator().manual_seed(0),
    )


def _first_batch(recipe: Recipe):
    return next(iter(_loader(recipe)))


def _train_losses(recipe: Recipe, steps: int) -> list[float]:
    model, optimizer = recipe.build()
    losses: list[float] = []
    while len(losses) < steps:
        for batch in _loader(recipe):
            loss, _ = recipe.loss_fn(model, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            if len(losses) == steps:
                break
    return losses


def _flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _assert_batches_equal(a, b) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)
    else:
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_loss_falls_with_the_recipes_own_optimizer(name: str) -> None:
    losses = _train_losses(get_workload(name, **SMALL[name]), steps=30)
    first, last = statistics.mean(losses[:5]), statistics.mean(losses[-5:])
    # Measured ratios at 30 steps of 8 samples, seeds 0-2: vision 0.69/0.54/0.52, segmentation ~0.4,
    # text 0.66/0.64/0.67; 0.8 leaves margin while still failing a workload that does not learn
    # (ratio ~1).
    assert last < 0.8 * first, f"{name}: loss {first:.3f} -> {last:.3f} over 30 steps"


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_same_seed_same_data_and_weights_other_seed_other_data(name: str) -> None:
    a, b = get_workload(name, seed=3, **SMALL[name]), get_workload(name, seed=3, **SMALL[name])
    _assert_batches_equal(_first_batch(a), _first_batch(b))
    torch.testing.assert_close(
        _flat_params(a.build()[0]), _flat_params(b.build()[0]), rtol=0, atol=0
    )
    other = get_workload(name, seed=4, **SMALL[name])
    with pytest.raises(AssertionError):  # negative control: the seed must matter
        _assert_batches_equal(_first_batch(a), _first_batch(other))


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_default_batch_size_and_override(name: str) -> None:
    assert get_workload(name, num_samples=64).batch_size >= 8
    assert get_workload(name, num_samples=64, batch_size=5).batch_size == 5


def test_unknown_workload_error_lists_the_names() -> None:
    with pytest.raises(ValueError, match="unknown workload 'imagenet'") as err:
        get_workload("imagenet")
    for name in WORKLOADS:
        assert name in str(err.value)


def test_unknown_override_error_lists_accepted_arguments() -> None:
    with pytest.raises(ValueError, match="image_size"):
        get_workload("vision", widht=3)


def test_vision_items_and_structure() -> None:
    recipe = get_workload("vision", num_samples=32, image_size=48)
    image, label = recipe.dataset[0]
    assert image.shape == (3, 48, 48) and image.dtype == torch.float32
    assert label.dtype == torch.int64 and 0 <= int(label) < 10
    model, _ = recipe.build()
    blocks = [b for stage in model.stages for b in stage]
    assert len(blocks) == 6 and all(isinstance(s, nn.Sequential) for s in model.stages)
    assert all(any(True for _ in b.children()) for b in blocks)  # seen as blocks by checkpointing
    loss, count = recipe.loss_fn(model, _first_batch(recipe))
    assert loss.ndim == 0 and count == recipe.batch_size


@pytest.mark.parametrize("norm", ["group", "none"])
def test_vision_norm_options_remove_batchnorm(norm: str) -> None:
    model, _ = get_workload("vision", num_samples=8, norm=norm).build()
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    batchnorm_model, _ = get_workload("vision", num_samples=8).build()
    assert any(isinstance(m, nn.BatchNorm2d) for m in batchnorm_model.modules())


def test_vision_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"norm must be one of .*'batch'.*'layer'"):
        get_workload("vision", norm="layer")
    with pytest.raises(ValueError, match="image_size"):
        get_workload("vision", image_size=30)


def test_segmentation_items_and_structure() -> None:
    recipe = get_workload("segmentation", num_samples=16, image_size=80, in_channels=3)
    image, mask = recipe.dataset[0]
    assert image.shape == (3, 80, 80) and image.dtype == torch.float32
    assert mask.shape == (80, 80) and mask.dtype == torch.int64
    masks = torch.stack([recipe.dataset[i][1] for i in range(16)])
    assert set(masks.unique().tolist()) == {0, 1, 2}  # background, disc, rectangle all occur
    model, _ = recipe.build()
    assert isinstance(model.down, nn.ModuleList) and isinstance(model.up, nn.ModuleList)
    logits = model(image.unsqueeze(0))
    assert logits.shape == (1, 3, 80, 80)


def _saved_activation_bytes(
    recipe: Recipe, model: nn.Module, batch, checkpointed: list[nn.Module]
) -> int:
    """Bytes of distinct storages autograd keeps for backward, plus the inputs that
    ``checkpointed`` blocks keep for their recomputation."""
    storages: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    def keep_inputs(module: nn.Module, args: tuple) -> None:
        for arg in args:
            keep(arg)

    handles = [m.register_forward_pre_hook(keep_inputs) for m in checkpointed]
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        recipe.loss_fn(model, batch)
    for handle in handles:
        handle.remove()
    return sum(storages.values())


class _Checkpointed(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, *args, use_reentrant=False)


def test_segmentation_activations_live_inside_blocks() -> None:
    # The workload exists to show activation checkpointing; if most saved memory sat outside
    # the blocks (e.g. upsampled maps in the parent), checkpointing the blocks would save little.
    recipe = get_workload("segmentation", num_samples=8, batch_size=4)
    batch = _first_batch(recipe)
    model, _ = recipe.build()
    plain = _saved_activation_bytes(recipe, model, batch, checkpointed=[])
    wrapped = []
    for container in (model.down, model.up):
        for i, block in enumerate(container):
            container[i] = _Checkpointed(block)
            wrapped.append(container[i])
    checkpointed = _saved_activation_bytes(recipe, model, batch, checkpointed=wrapped)
    assert checkpointed < 0.4 * plain, f"{plain / 2**20:.1f} -> {checkpointed / 2**20:.1f} MiB"


def test_text_lengths_are_long_tailed_and_capped() -> None:
    recipe = get_workload("text")
    lengths = torch.tensor(recipe.lengths, dtype=torch.float32)
    median, p90 = lengths.median().item(), lengths.quantile(0.9).item()
    assert p90 / median > 2 and 16 <= median <= 64
    assert lengths.max() <= 512 and lengths.max() >= 256 and lengths.min() >= 1
    assert recipe.count_unit == "tokens"
    assert [len(recipe.dataset[i]["tokens"]) for i in range(50)] == recipe.lengths[:50]


def test_text_items_and_structure() -> None:
    recipe = get_workload("text", num_samples=32)
    item = recipe.dataset[0]
    assert item["tokens"].dtype == torch.int64 and item["labels"].shape == item["tokens"].shape
    model, _ = recipe.build()
    layers = model.encoder.layers
    assert isinstance(layers, nn.ModuleList) and len(layers) == 2
    assert any(isinstance(m, nn.Dropout) and m.p > 0 for m in layers[0].modules())


def test_text_loss_is_over_real_tokens_only() -> None:
    recipe = get_workload("text", num_samples=16)
    samples = [recipe.dataset[i] for i in range(6)]
    model, _ = recipe.build()
    model.eval()  # dropout off: the two paddings must give the same loss
    tight = pad_collate(samples)
    padded = pad_collate(samples, pad_to_multiple=128)
    loss_tight, count = recipe.loss_fn(model, tight)
    loss_padded, _ = recipe.loss_fn(model, padded)
    assert int(count) == sum(len(s["tokens"]) for s in samples)
    torch.testing.assert_close(loss_padded, loss_tight, rtol=1e-5, atol=1e-5)
    # Negative control: with padding visible to attention, extra padding changes the loss.
    padded_unmasked = {**padded, "mask": torch.ones_like(padded["mask"])}
    loss_unmasked, _ = recipe.loss_fn(model, padded_unmasked)
    assert not torch.allclose(loss_unmasked, loss_tight, rtol=1e-3, atol=1e-3)


def test_text_collate_is_naive_padding() -> None:
    recipe = get_workload("text", num_samples=64, batch_size=8)
    assert isinstance(recipe.collate, functools.partial) and recipe.collate.func is pad_collate
    batch = _first_batch(recipe)
    assert batch["tokens"].shape[1] == int(batch["lengths"].max())


# --- sized for the device --------------------------------------------------------------------

H200_PEAK, H200_MEMORY = 762e12, 141 * 2**30  # measured bf16 rate and memory of the first GPU


def test_the_batch_is_set_by_the_flop_target_the_memory_or_the_cpu_sizes_batch() -> None:
    from torchturbo.workloads.sizing import BATCH_MULTIPLE, DENSE_S, MEMORY_SHARE, batch_for

    batch, bound = batch_for(40e9, 64 * 2**20, H200_PEAK, H200_MEMORY, floor=16)
    assert bound == "compute" and batch % BATCH_MULTIPLE == 0
    assert batch <= DENSE_S * H200_PEAK / 40e9 < batch + BATCH_MULTIPLE
    batch, bound = batch_for(40e9, 2**30, H200_PEAK, H200_MEMORY, floor=16)
    assert bound == "memory" and batch * 2**30 <= MEMORY_SHARE * H200_MEMORY
    assert batch_for(40e9, 64 * 2**20, 1e12, 24 * 2**30, floor=16) == (16, "floor")


def test_auto_is_the_small_size_on_a_cpu() -> None:
    recipe = get_workload("vision", "auto", device="cpu")
    assert recipe.name == "vision" and recipe.batch_size == 16 and "sizing" not in recipe.extras


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_on_a_gpu_each_workload_is_widened_and_batched_for_the_measured_device(
    monkeypatch, name
) -> None:
    """The GPU size on this CPU, with the H200's measured rate and memory standing in for the
    measurement: the FLOPs and bytes per sample are counted here, on the model the GPU builds."""
    import torchturbo.workloads as workloads

    monkeypatch.setattr(workloads, "best_peak", lambda device: H200_PEAK)
    monkeypatch.setattr(workloads, "memory_capacity", lambda device: H200_MEMORY)
    small = get_workload(name, num_samples=8)
    recipe = get_workload(name, "gpu", device="cpu")
    sizing = recipe.extras["sizing"]
    assert recipe.name == f"{name}-gpu" and recipe.batch_size == sizing.batch_size
    assert sizing.bound == "compute" and sizing.batch_size > 4 * small.batch_size
    assert len(recipe.dataset) >= 8 * recipe.batch_size
    step_flops = sizing.batch_size * sizing.flops_per_sample
    assert 4e12 < step_flops <= 7.62e12  # DENSE_S at the peak, rounded down to the multiple
    assert f"{name}-gpu sized for cpu: batch {sizing.batch_size} (compute-bound" in (
        sizing.describe(recipe.name)
    )
    wider = sum(p.numel() for p in recipe.model().parameters())
    assert wider > 3 * sum(p.numel() for p in small.model().parameters())


def test_a_given_batch_size_skips_the_measurement() -> None:
    recipe = get_workload("text", "gpu", device="cpu", batch_size=8, num_samples=32)
    assert recipe.batch_size == 8 and "sizing" not in recipe.extras
