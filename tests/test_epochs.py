"""EpochLoader resume: each kind of data reaches the saved position without replaying it.

Each test trains a few batches with a checkpoint after every step, resumes in a fresh engine and
checks two things: the batches after the resume are the uninterrupted run's, and no sample of the
skipped batches was loaded again (counted in the dataset), except for a stream without state,
which can only be drained and says so.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from torchturbo import Turbo, TurboConfig

CONFIG = TurboConfig(device="cpu")
SAMPLES, BATCH, SAVED_AT, TRAINED = 40, 4, 3, 7  # 10 batches an epoch; resume at batch 3


class CountingDataset(Dataset):
    """A map-style dataset that records every index it loads."""

    def __init__(self) -> None:
        self.loaded: list[int] = []

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.loaded.append(index)
        return torch.full((2,), float(index)), torch.tensor(index % 2)


class CountingStream(IterableDataset):
    """A stream; with ``stateful`` it saves its position as streaming datasets do."""

    def __init__(self) -> None:
        self.loaded: list[int] = []
        self.next_index = 0

    def __iter__(self):
        while self.next_index < SAMPLES:
            index, self.next_index = self.next_index, self.next_index + 1
            self.loaded.append(index)
            yield torch.full((2,), float(index)), torch.tensor(index % 2)
        self.next_index = 0


class StatefulStream(CountingStream):
    def state_dict(self) -> dict[str, int]:
        return {"next_index": self.next_index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.next_index = state["next_index"]


class PositionLoader(DataLoader):
    """A DataLoader that saves its own position (as torchdata's StatefulDataLoader does)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.yielded, self.restored = 0, []

    def __iter__(self):
        start, self.yielded = self.yielded, 0
        for indices in itertools.islice(self.batch_sampler, start, None):
            self.yielded = start = start + 1
            yield self.collate_fn([self.dataset[i] for i in indices])
        self.yielded = 0

    def state_dict(self) -> dict[str, int]:
        return {"yielded": self.yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.restored.append(state)
        self.yielded = state["yielded"]


def _loss(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def _run(make_data, *, batches: int, save_to=None, resume_from=None):
    """Train ``batches`` batches in a fresh engine (saving after each into ``save_to``, after
    resuming from ``resume_from``); return the data, the first feature of each sample of each
    batch trained, and how the loader resumed."""
    torch.manual_seed(0)
    data = make_data()
    turbo = Turbo(CONFIG)
    model = nn.Linear(2, 2)
    kwargs = {} if isinstance(data, DataLoader) else {"batch_size": BATCH, "seed": 3}
    _, _, loader = turbo.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), data, **kwargs)
    if resume_from is not None:
        turbo.load(resume_from)
    note = loader.resume_note
    seen = []
    epochs = itertools.chain.from_iterable(iter(loader) for _ in range(3))
    for batch in itertools.islice(epochs, batches):
        seen.append([int(v) for v in batch[0][:, 0]])
        turbo.step(_loss, batch)
        if save_to is not None:
            turbo.save(save_to)
    return data, seen, note


def _dataset_of(data):
    return data.dataset if isinstance(data, DataLoader) else data


CASES = {
    "map-style": (CountingDataset, "the batch sampler's indices skipped, no sample loaded"),
    "stateful stream": (StatefulStream, "the stream's own load_state_dict(), no batch loaded"),
    "stateful loader": (
        lambda: PositionLoader(CountingDataset(), batch_size=BATCH),
        "the loader's own load_state_dict(), no batch loaded",
    ),
}


@pytest.mark.parametrize("kind", sorted(CASES))
def test_resume_skips_the_trained_batches_without_loading_them(tmp_path, kind):
    make_data, how = CASES[kind]
    _, full, _ = _run(make_data, batches=TRAINED)
    _run(make_data, batches=SAVED_AT, save_to=tmp_path)
    data, rest, note = _run(make_data, batches=TRAINED - SAVED_AT, resume_from=tmp_path)
    assert note == f"epoch 0, {SAVED_AT} batches in: {how}"
    assert rest == full[SAVED_AT:TRAINED]
    trained_before = {i for batch in full[:SAVED_AT] for i in batch}
    assert not trained_before & set(_dataset_of(data).loaded)
    if kind == "stateful loader":
        assert data.restored == [{"yielded": SAVED_AT}]  # after the last trained batch


def test_a_stream_without_state_is_drained_and_says_so(tmp_path):
    _, full, _ = _run(CountingStream, batches=TRAINED)
    _run(CountingStream, batches=SAVED_AT, save_to=tmp_path)
    data, rest, note = _run(CountingStream, batches=TRAINED - SAVED_AT, resume_from=tmp_path)
    assert rest == full[SAVED_AT:TRAINED]
    assert note == (
        f"epoch 0, {SAVED_AT} batches in: drained: {SAVED_AT} batches fetched again and "
        "discarded (a stream without state_dict()/load_state_dict())"
    )
    # Negative control for the tests above: draining loads the trained samples again.
    assert set(range(SAVED_AT * BATCH)) <= set(data.loaded)
