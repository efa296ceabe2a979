"""BatchAugment: per-sample randomness, determinism, exactness, ranges and input checks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from torchturbo.data.augment import BatchAugment, _color_jitter_

ROOT = Path(__file__).resolve().parents[1]
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
FULL = BatchAugment(
    resized_crop=(12, 20),
    hflip_p=0.5,
    brightness=0.4,
    contrast=0.4,
    saturation=0.4,
    mean=MEAN,
    std=STD,
)


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def images(batch: int = 4, channels: int = 3, size: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(
        0, 256, (batch, channels, size, size), dtype=torch.uint8, generator=seeded(seed)
    )


def same_image(batch: int, size: int = 16) -> torch.Tensor:
    """One asymmetric image repeated: any difference between outputs is the augmentation's."""
    return images(1, size=size).expand(batch, -1, -1, -1).contiguous()


def normalize(x: torch.Tensor, mean=MEAN, std=STD) -> torch.Tensor:
    mean = torch.tensor(mean).view(1, -1, 1, 1)
    std = torch.tensor(std).view(1, -1, 1, 1)
    return (x.float() / 255 - mean) / std


def flip_decisions(out: torch.Tensor, x: torch.Tensor) -> list[bool]:
    """Per sample: True if out[b] is exactly the mirrored input, False if exactly the input."""
    plain, mirrored = BatchAugment()(x), BatchAugment()(x.flip(-1))
    decisions = []
    for b in range(len(x)):
        assert torch.equal(out[b], mirrored[b]) or torch.equal(out[b], plain[b])
        decisions.append(torch.equal(out[b], mirrored[b]))
    return decisions


def assert_flips_vary(decisions: list[bool]) -> None:
    assert any(decisions) and not all(decisions), f"one flip decision for the batch: {decisions}"


def whole_batch_flip(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The source article's defect: one coin toss flips the whole batch."""
    flip = torch.rand((), generator=generator) < 0.5
    return BatchAugment()(x.flip(-1) if flip else x)


def test_flip_is_per_sample_and_exact():
    x = same_image(32)
    out = BatchAugment(hflip_p=0.5)(x, seeded(0))
    # flip_decisions asserts every sample is bit-exact plain or bit-exact torch.flip.
    assert_flips_vary(flip_decisions(out, x))


def test_negative_control_whole_batch_flip_fails_the_per_sample_check():
    x = same_image(32)
    decisions = flip_decisions(whole_batch_flip(x, seeded(0)), x)
    with pytest.raises(AssertionError, match="one flip decision"):
        assert_flips_vary(decisions)


def test_resized_crops_differ_across_identical_samples():
    out = BatchAugment(resized_crop=(8, 8))(same_image(16), seeded(0))
    distinct = {tuple(o.flatten().tolist()) for o in out}
    assert len(distinct) >= 2


def test_padded_crop_is_an_exact_per_sample_shift_of_the_zero_padded_image():
    pad, size = 3, 10
    x = same_image(16, size=size)
    out = BatchAugment(crop_padding=pad, hflip_p=0.5)(x, seeded(1))
    pixels = (out * 255).round().to(torch.uint8)  # undo the [0, 1] scaling exactly
    padded = F.pad(x[0], (pad, pad, pad, pad))
    windows = {
        (top, left, flipped): window.flip(-1) if flipped else window
        for top in range(2 * pad + 1)
        for left in range(2 * pad + 1)
        for flipped in (False, True)
        for window in [padded[:, top : top + size, left : left + size]]
    }
    found = [next(k for k, w in windows.items() if torch.equal(w, p)) for p in pixels]
    assert len(set(found)) >= 2  # different shifts (and flips) across identical samples


def test_full_scale_resized_crop_is_identity_and_smaller_scale_is_not():
    x = images()
    identity = BatchAugment(resized_crop=(16, 16), scale=(1.0, 1.0), ratio=(1.0, 1.0))
    # Bilinear sampling exactly at pixel centres: only float rounding of the grid (~1e-7).
    torch.testing.assert_close(identity(x, seeded(0)), normalize(x, (0.0,), (1.0,)))
    zoomed = BatchAugment(resized_crop=(16, 16), scale=(0.5, 0.5), ratio=(1.0, 1.0))
    assert not torch.allclose(zoomed(x, seeded(0)), normalize(x, (0.0,), (1.0,)), atol=1e-3)


def test_seeded_generator_is_deterministic_and_seed_dependent():
    x = images(8)
    assert torch.equal(FULL(x, seeded(7)), FULL(x, seeded(7)))
    assert not torch.equal(FULL(x, seeded(7)), FULL(x, seeded(8)))


def test_without_crop_and_jitter_it_is_plain_normalize():
    x = images()
    # The pipeline fuses /255, -mean and /std into one multiply-add: equal up to float rounding.
    torch.testing.assert_close(BatchAugment(mean=MEAN, std=STD)(x), normalize(x))
    # Negative control: any active augmentation breaks the equality.
    flipped = BatchAugment(hflip_p=1.0, mean=MEAN, std=STD)(x)
    assert not torch.allclose(flipped, normalize(x), atol=1e-3)


def test_brightness_factors_are_per_sample_and_in_range():
    x = (same_image(16) // 2).contiguous()  # values <= 127: a factor <= 1.4 cannot clip
    out = BatchAugment(brightness=0.4)(x, seeded(0))
    factors = out.sum(dim=(1, 2, 3)) / normalize(x, (0.0,), (1.0,)).sum(dim=(1, 2, 3))
    assert factors.min() >= 0.6 - 1e-5 and factors.max() <= 1.4 + 1e-5
    assert factors.unique().numel() >= 2


def reference_jitter(image: torch.Tensor, brightness: float, contrast: float, saturation: float):
    """torchvision's adjust_brightness/contrast/saturation on one [3, H, W] image in [0, 1]."""

    def gray(x: torch.Tensor) -> torch.Tensor:
        return (0.2989 * x[0] + 0.587 * x[1] + 0.114 * x[2]).unsqueeze(0)

    image = (image * brightness).clamp(0, 1)
    image = (contrast * image + (1 - contrast) * gray(image).mean()).clamp(0, 1)
    return (saturation * image + (1 - saturation) * gray(image)).clamp(0, 1)


def test_color_jitter_matches_torchvision_formulas_per_sample():
    x = images(4)
    factors = [torch.tensor([0.7, 1.3, 1.0, 0.6]) for _ in range(3)]
    factors[1], factors[2] = factors[1].flip(0), factors[2].roll(1)
    out = x.float()
    _color_jitter_(out, *factors)
    for b in range(len(x)):
        expected = reference_jitter(x[b] / 255, *(float(f[b]) for f in factors))
        # Merged passes (1/255 into brightness, lerp blends) change float rounding only.
        torch.testing.assert_close(out[b], expected, atol=1e-5, rtol=0)
    # Negative control: the factors of another sample give a different image.
    swapped = reference_jitter(x[0] / 255, *(float(f[1]) for f in factors))
    assert not torch.allclose(out[0], swapped, atol=1e-2)


def test_contrast_keeps_each_samples_luma_mean_and_scales_its_spread():
    x = (same_image(16) // 2 + 64).contiguous()  # in [64, 191]: a factor <= 1.4 cannot clip
    out = BatchAugment(contrast=0.4)(x, seeded(0))
    luma = torch.tensor([0.2989, 0.587, 0.114]).view(1, 3, 1, 1)
    before = (normalize(x, (0.0,), (1.0,)) * luma).sum(1)
    after = (out * luma).sum(1)
    # Kept up to (1 - factor) * mean * 1e-4: torchvision's luma weights sum to 0.9999.
    torch.testing.assert_close(after.mean((1, 2)), before.mean((1, 2)), atol=1e-4, rtol=0)
    factors = after.std((1, 2)) / before.std((1, 2))
    assert factors.min() >= 0.6 - 1e-4 and factors.max() <= 1.4 + 1e-4
    assert factors.unique().numel() >= 2


def test_upsampled_crop_at_the_image_edge_does_not_blend_in_padding():
    # Crops of at most a quarter of the area, resized up 2x+: edge samples fall outside the box.
    flat = torch.full((16, 3, 16, 16), 200, dtype=torch.uint8)
    out = BatchAugment(resized_crop=(32, 32), scale=(0.1, 0.25))(flat, seeded(0))
    torch.testing.assert_close(out, torch.full_like(out, 200 / 255))


def test_saturation_leaves_gray_images_unchanged_and_changes_colour():
    gray = images(8, channels=1).expand(-1, 3, -1, -1).contiguous()
    jitter = BatchAugment(saturation=0.9)
    # Blending a gray image with its own luma only rounds (weights sum to 0.9999).
    torch.testing.assert_close(
        jitter(gray, seeded(0)), normalize(gray, (0.0,), (1.0,)), atol=1e-3, rtol=0
    )
    colour = images(8)
    assert not torch.allclose(
        jitter(colour, seeded(0)), normalize(colour, (0.0,), (1.0,)), atol=1e-2
    )


def test_output_range_dtype_and_shape():
    x = images(8)
    unit = BatchAugment(
        resized_crop=(12, 20), hflip_p=0.5, brightness=0.4, contrast=0.4, saturation=0.4
    )(x, seeded(0))
    assert unit.shape == (8, 3, 12, 20) and unit.dtype == torch.float32
    assert unit.min() >= 0 and unit.max() <= 1
    out = FULL(x, seeded(0))
    low = (0 - torch.tensor(MEAN)) / torch.tensor(STD)
    high = (1 - torch.tensor(MEAN)) / torch.tensor(STD)
    per_channel = out.transpose(0, 1).flatten(1)
    assert (per_channel.min(1).values >= low - 1e-5).all()
    assert (per_channel.max(1).values <= high + 1e-5).all()
    padded = BatchAugment(crop_padding=2, dtype=torch.bfloat16)(images(2, channels=1, size=9))
    assert padded.shape == (2, 1, 9, 9) and padded.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (images().float(), "images.dtype"),
        (images()[0], "images.shape"),
        (images(0), "images.shape"),
        (images(channels=2), "mean has 3 values"),
    ],
)
def test_bad_input_raises_value_error(bad, match):
    with pytest.raises(ValueError, match=match):
        BatchAugment(mean=MEAN, std=STD)(bad)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"hflip_p": 1.5}, "hflip_p"),
        ({"resized_crop": (8, 8), "crop_padding": 2}, "exclusive"),
        ({"resized_crop": (0, 8)}, "resized_crop"),
        ({"crop_padding": -1}, "crop_padding"),
        ({"scale": (0.5, 0.1)}, "scale"),
        ({"brightness": -0.1}, "brightness"),
        ({"std": (1.0, 0.0, 1.0)}, "std"),
        ({"dtype": torch.int32}, "dtype"),
    ],
)
def test_bad_config_raises_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BatchAugment(**kwargs)


def test_saturation_needs_rgb():
    with pytest.raises(ValueError, match="saturation needs 3"):
        BatchAugment(saturation=0.2)(images(channels=1))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_batch_with_cuda_generator():
    x = images(8).cuda()
    gen = torch.Generator(device="cuda")
    first = FULL(x, gen.manual_seed(3))
    assert first.device == x.device and first.shape == (8, 3, 12, 20)
    assert torch.equal(first, FULL(x, gen.manual_seed(3)))
    with pytest.raises(ValueError, match="generator is on cpu"):
        FULL(x, seeded(0))


@pytest.mark.slow
def test_benchmark_quick_writes_json(tmp_path):
    out = tmp_path / "augment.json"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "augment.py"),
            "--quick",
            "--no-kornia",
            "--json",
            str(out),
        ],
        check=True,
        timeout=120,
        capture_output=True,
    )
    result = json.loads(out.read_text())
    variants = {row["variant"] for row in result["results"]}
    assert {"cpu_workers_0", "device_torch", "kernel_torch"} <= variants
    assert all(row["images_per_s"] > 0 for row in result["results"])
