"""The one nested-batch walker, and the modules that map over batches through it."""

from __future__ import annotations

import collections
import dataclasses
from typing import NamedTuple

import torch

from torchturbo.base.device import to_device
from torchturbo.base.nested import iter_tensors, map_tensors, named_tensors
from torchturbo.reliability.oom import leading_size, split_batch


class Pair(NamedTuple):
    image: torch.Tensor
    label: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Sample:
    tokens: torch.Tensor
    extra: dict
    note: str = "kept"
    length: int = dataclasses.field(init=False, default=0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "length", self.tokens.shape[-1])


def _batch():
    counts = collections.defaultdict(list, {"a": torch.ones(4, 2)})
    return {
        "pair": Pair(torch.zeros(4, 3, 2, 2), torch.arange(4)),
        "sample": Sample(torch.ones(4, 5, dtype=torch.long), {"mask": torch.ones(4, 5)}),
        "list": [torch.full((4,), 2.0), 7],
        "ordered": collections.OrderedDict(x=torch.ones(4)),
        "counts": counts,
        "name": "batch-1",
    }


def test_map_tensors_reaches_every_container_and_keeps_types():
    doubled = map_tensors(lambda t: t * 2, _batch())
    assert isinstance(doubled["pair"], Pair) and torch.equal(
        doubled["pair"].label, torch.arange(4) * 2
    )
    assert isinstance(doubled["sample"], Sample) and doubled["sample"].note == "kept"
    assert doubled["sample"].length == 5  # an init=False field is recomputed, not copied
    assert torch.equal(doubled["sample"].extra["mask"], torch.full((4, 5), 2.0))
    assert doubled["list"][1] == 7 and torch.equal(doubled["list"][0], torch.full((4,), 4.0))
    assert isinstance(doubled["ordered"], collections.OrderedDict)
    assert doubled["counts"].default_factory is list  # a defaultdict keeps its factory
    assert doubled["name"] == "batch-1"


def test_named_tensors_gives_paths_and_iter_tensors_the_same_order():
    names = [name for name, _ in named_tensors(_batch())]
    assert names == [
        "batch['pair'].image",
        "batch['pair'].label",
        "batch['sample'].tokens",
        "batch['sample'].extra['mask']",
        "batch['list'][0]",
        "batch['ordered']['x']",
        "batch['counts']['a']",
    ]
    assert len(list(iter_tensors(_batch()))) == len(names)


def test_splitting_and_moving_see_into_dataclasses_and_namedtuples():
    """The consumers agree with the walker: every tensor is cut, every tensor is moved."""
    batch = _batch()
    assert leading_size(batch) == 4
    first, second = split_batch(batch, 2)
    assert first["sample"].tokens.shape == (2, 5) and second["pair"].image.shape == (2, 3, 2, 2)
    assert first["sample"].extra["mask"].shape == (2, 5)
    rows = torch.cat([first["pair"].label, second["pair"].label])
    assert torch.equal(rows, torch.arange(4))  # every row once, in order
    moved = to_device(batch, "meta", non_blocking=False)
    assert {t.device.type for t in iter_tensors(moved)} == {"meta"}


def test_a_hugging_face_model_output_is_mapped_item_by_item():
    """ModelOutput is a dict that refuses update(); a compiled model's outputs are mapped."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    output = CausalLMOutputWithPast(loss=torch.tensor(2.0), logits=torch.ones(1, 2, 3))
    mapped = map_tensors(lambda t: t * 2, output)
    assert type(mapped) is CausalLMOutputWithPast
    assert float(mapped.loss) == 4.0 and float(mapped["logits"].sum()) == 12.0
    assert float(output.loss) == 2.0  # the original is left as it was
