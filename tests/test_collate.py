"""The padding collate: variable-length dict samples padded per field, everything else as torch's
default collate does it."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import default_collate

from torchturbo.data.collate import IGNORE_INDEX, pad_collate


def _hf_sample(length: int, start: int = 1) -> dict[str, torch.Tensor]:
    ids = torch.arange(start, start + length)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones(length, dtype=torch.long),
        "token_type_ids": torch.zeros(length, dtype=torch.long),
        "labels": ids % 3,
    }


def test_hugging_face_style_samples_are_padded_field_by_field():
    batch = pad_collate([_hf_sample(3), _hf_sample(5, start=10)])
    assert batch["input_ids"].tolist() == [[1, 2, 3, 0, 0], [10, 11, 12, 13, 14]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert batch["token_type_ids"].tolist() == [[0] * 5, [0] * 5]
    assert batch["labels"][0].tolist() == [1, 2, 0, IGNORE_INDEX, IGNORE_INDEX]
    assert batch["input_ids"].dtype == torch.int64
    assert set(batch) == {"input_ids", "attention_mask", "token_type_ids", "labels"}


def test_pad_values_per_field_and_a_multiple():
    batch = pad_collate(
        [_hf_sample(3), _hf_sample(5)], pad_values={"input_ids": 99}, pad_to_multiple=8
    )
    assert batch["input_ids"].shape == (2, 8)
    assert batch["input_ids"][0, 3:].tolist() == [99] * 5
    assert batch["labels"].shape == (2, 8) and batch["labels"][1, 5:].eq(IGNORE_INDEX).all()


def test_a_multiple_pads_every_per_token_field_of_a_batch_of_one_length():
    """A length bucket's batch: every sample 5 long. Its labels and mask are padded with the
    tokens to the multiple (once only the tokens were: 8 tokens against 5 labels)."""
    samples = [
        {"tokens": torch.arange(1, 6), "labels": torch.arange(5), "id": torch.tensor(i)}
        for i in range(3)
    ]
    batch = pad_collate(samples, pad_to_multiple=8)
    assert batch["tokens"].shape == batch["labels"].shape == batch["mask"].shape == (3, 8)
    assert batch["labels"][:, 5:].eq(IGNORE_INDEX).all() and batch["tokens"][:, 5:].eq(0).all()
    assert batch["mask"].sum().item() == 15 and batch["id"].tolist() == [0, 1, 2]
    hf = pad_collate([_hf_sample(5), _hf_sample(5)], pad_to_multiple=8)
    assert {tuple(t.shape) for t in hf.values()} == {(2, 8)}


def test_a_missing_attention_mask_is_added_for_input_ids():
    samples = [{"input_ids": torch.arange(1, 3)}, {"input_ids": torch.arange(1, 5)}]
    batch = pad_collate(samples)
    assert batch["attention_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]


def test_torchturbo_token_samples_get_a_mask_and_lengths():
    samples = [
        {"tokens": torch.tensor([5, 6]), "labels": torch.tensor([1, 0])},
        {"tokens": torch.tensor([7, 8, 9]), "labels": torch.tensor([1, 1, 0])},
    ]
    batch = pad_collate(samples)
    assert batch["tokens"].tolist() == [[5, 6, 0], [7, 8, 9]]
    assert batch["mask"].tolist() == [[True, True, False], [True, True, True]]
    assert batch["lengths"].tolist() == [2, 3]


def test_fixed_size_samples_collate_exactly_as_torch_does():
    images = [(torch.randn(3, 4, 4), torch.tensor(i)) for i in range(3)]
    for ours, theirs in zip(pad_collate(images), default_collate(images), strict=True):
        assert torch.equal(ours, theirs)
    records = [{"x": torch.randn(4), "y": torch.tensor(1.0), "id": i} for i in range(3)]
    ours, theirs = pad_collate(records), default_collate(records)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_samples_with_other_fields_or_shapes_are_refused_with_what_differs():
    with pytest.raises(ValueError, match="sample 1 has fields"):
        pad_collate([{"input_ids": torch.arange(2)}, {"tokens": torch.arange(2)}])
    with pytest.raises(ValueError, match="differ beyond their first dimension"):
        pad_collate([{"x": torch.zeros(2, 3)}, {"x": torch.zeros(3, 4)}])
    with pytest.raises(ValueError, match="empty batch"):
        pad_collate([])


def test_a_sample_of_another_dtype_is_named_by_its_place_in_the_batch():
    from torchturbo.data.collate import SampleDtypeError

    samples = [{"x": torch.zeros(3), "y": torch.tensor(1)} for _ in range(4)]
    samples[2] = {"x": torch.zeros(3, dtype=torch.float64), "y": torch.tensor(1)}
    with pytest.raises(SampleDtypeError, match=r"sample\['x'\] is float64 where the other") as bad:
        pad_collate(samples)
    assert bad.value.position == 2
    pad_collate(samples[:2] + samples[3:])  # the control: one dtype, collated as before
