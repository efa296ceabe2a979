"""Padding collate for variable-length samples: the engine's default collate.

Dict samples (``{"input_ids": LongTensor[L], "attention_mask": ..., "labels": ...}``, or
torchturbo's ``{"tokens", "labels"}``) have every variable-length tensor field padded to the
longest sample of the batch, optionally rounded up to a multiple (8 for TensorCore-friendly
shapes): label fields (names containing "label") with ``IGNORE_INDEX`` so the loss skips them,
the others with 0 unless ``pad_values`` says otherwise (a tokenizer's ``pad_token_id``). Token ids
stay int64. Fields of one shape in every sample, and non-dict samples, are collated by torch's
``default_collate``: this collate only differs where that one would raise.

Conventions that add fields: samples with ``tokens`` also get ``mask`` [B, T] (True on real
tokens) and ``lengths`` [B] (what the built-in text workload's model reads); samples with
``input_ids`` and no ``attention_mask`` get an ``attention_mask`` (Hugging Face's name).

Hugging Face's ``DataCollatorWithPadding`` pads through a tokenizer, which synthetic and
pre-tokenized datasets do not have, and torch has no padding collate: hence this module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import default_collate

from torchturbo.base.nested import named_tensors

IGNORE_INDEX = -100  # the default ignore_index of torch.nn.functional.cross_entropy
#: The fields whose lengths define a sample's sequence length, in order of preference.
_SEQUENCE_KEYS = ("tokens", "input_ids")


def pad_collate(
    samples: Sequence[Any],
    *,
    pad_id: int = 0,
    pad_to_multiple: int = 1,
    pad_values: Mapping[str, int] | None = None,
) -> Any:
    """Collate ``samples``, padding variable-length tensor fields of dict samples (see above)."""
    if not samples:
        raise ValueError("pad_collate got an empty batch")
    if pad_to_multiple < 1:
        raise ValueError(f"pad_to_multiple must be >= 1, got {pad_to_multiple}")
    check_dtypes(samples)
    if not all(isinstance(s, Mapping) for s in samples):
        return default_collate(list(samples))
    keys = list(samples[0])
    for index, sample in enumerate(samples):
        if list(sample) != keys:
            raise ValueError(
                f"pad_collate: sample {index} has fields {sorted(sample)} but sample 0 has "
                f"{sorted(keys)}: every sample must have the same fields"
            )
    sequence_key = next((k for k in _SEQUENCE_KEYS if k in keys), None)
    # Padded up to a multiple, the fields as long as the sequence are padded with it, even in a
    # batch whose samples are all of one length (a length bucket's).
    rounded = sequence_key is not None and pad_to_multiple > 1
    batch: dict[str, Any] = {}
    for key in keys:
        values = [sample[key] for sample in samples]
        if _variable_length(values) or (rounded and _per_token(values, samples, sequence_key)):
            pad = _pad_value(key, pad_id, pad_values)
            batch[key] = _pad(values, pad, pad_to_multiple)
        else:
            batch[key] = default_collate(values)
    if sequence_key is not None:
        lengths = torch.tensor([len(s[sequence_key]) for s in samples], dtype=torch.int64)
        width = batch[sequence_key].shape[1]
        mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
        if sequence_key == "tokens":
            batch["mask"], batch["lengths"] = mask, lengths
        elif "attention_mask" not in batch:
            batch["attention_mask"] = mask.long()
    return batch


class SampleDtypeError(ValueError):
    """A sample whose tensor has another dtype than the same tensor of the batch's others:
    ``torch.stack`` would promote the whole batch to the wider dtype, and the model would fail
    on it later ("mat1 and mat2 must have the same dtype") or train in it unseen. ``position``
    is the sample's place in its batch (None once re-raised from a loader worker, which keeps
    the message only); the loader then names its dataset index and the step."""

    def __init__(self, message: str, position: int | None = None) -> None:
        super().__init__(message)
        self.position = position


def check_dtypes(samples: Sequence[Any]) -> None:
    """Raise :class:`SampleDtypeError` for the first sample whose tensor at some place differs
    in dtype from the majority of the batch's (every sample's tensors by name)."""
    named = [dict(named_tensors(sample, "sample")) for sample in samples]
    for name in named[0]:
        tensors = [each.get(name) for each in named]
        kinds = [t.dtype for t in tensors if t is not None]
        if len(set(kinds)) < 2:
            continue
        usual = max(set(kinds), key=kinds.count)
        odd, tensor = next(
            (i, t) for i, t in enumerate(tensors) if t is not None and t.dtype != usual
        )
        raise SampleDtypeError(
            f"{name} is {_dtype_name(tensor.dtype)} where the other samples of its batch hold "
            f"{_dtype_name(usual)}: convert it where the dataset builds its samples",
            odd,
        )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _per_token(values: list[Any], samples: Sequence[Any], sequence_key: str | None) -> bool:
    """Tensors whose leading size is each sample's sequence length (tokens, labels, masks)."""
    return all(
        isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == len(s[sequence_key])
        for v, s in zip(values, samples, strict=True)
    )


def _variable_length(values: list[Any]) -> bool:
    """Tensors of at least one dimension whose leading sizes differ (trailing ones equal)."""
    if not all(isinstance(v, torch.Tensor) and v.dim() >= 1 for v in values):
        return False
    if len({v.shape[1:] for v in values}) != 1:
        raise ValueError(
            "pad_collate: tensors differ beyond their first dimension "
            f"({sorted({tuple(v.shape) for v in values})}): only the length may vary"
        )
    return len({v.shape[0] for v in values}) > 1


def _pad_value(key: str, pad_id: int, pad_values: Mapping[str, int] | None) -> int:
    if pad_values and key in pad_values:
        return pad_values[key]
    return IGNORE_INDEX if "label" in key else pad_id


def _pad(values: list[torch.Tensor], value: int, multiple: int) -> torch.Tensor:
    longest = max(v.shape[0] for v in values)
    width = -(-longest // multiple) * multiple
    out = values[0].new_full((len(values), width, *values[0].shape[1:]), value)
    for row, tensor in enumerate(values):
        out[row, : tensor.shape[0]] = tensor
    return out
