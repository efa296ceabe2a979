"""Automatic micro-batching: an out-of-memory step is retried in pieces, with the same gradient."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from torchturbo import Turbo, TurboConfig
from torchturbo.reliability.oom import MemoryBudgetError, split_batch

# fp32 sums in a different order after a split: 1e-5 relative is many float32 ulps (1.2e-7)
# and far below what a wrong normalization gives (see the negative control).
TOLERANCE = 1e-5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 3))  # no BatchNorm


def _loss(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def _batch(n: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=generator), torch.randint(0, 3, (n,), generator=generator)


def _saved_bytes(model, batch) -> int:
    """Bytes a forward keeps for backward, parameters excluded (what the budget counts)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[tuple[int, int], int] = {}

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in params:
            saved[tensor.data_ptr(), tensor.numel()] = tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _loss(model, batch)
    return sum(saved.values())


def _train(batches, *, steps: int = 1, budget: int | None = None, model=None):
    """Parameters after training on ``batches`` with SGD(lr=1) (so the change is -gradient)."""
    model = copy.deepcopy(model or _model())
    config = TurboConfig(device="cpu").replace(
        accumulation__steps=steps, reliability__memory_budget_bytes=budget
    )
    turbo = Turbo(config)
    model, _, _ = turbo.setup(model, torch.optim.SGD(model.parameters(), lr=1.0))
    metrics = [turbo.step(_loss, batch) for batch in batches]
    return model, turbo, metrics


def _relative_error(a: nn.Module, b: nn.Module) -> float:
    x = torch.cat([p.detach().flatten() for p in a.parameters()])
    y = torch.cat([p.detach().flatten() for p in b.parameters()])
    start = torch.cat([p.detach().flatten() for p in _model().parameters()])
    return float((x - y).norm() / (y - start).norm())


def test_an_out_of_memory_step_is_split_and_gives_the_unsplit_gradient(caplog):
    batch = _batch(15)  # 15 rows: pieces of 4, 4, 4, 3, so unequal counts are exercised
    # 15 and 8 rows exceed it, 4 rows fit (+64: the engine's loss weighting saves two scalars)
    budget = _saved_bytes(_model(), _batch(4)) + 64
    expected, _, _ = _train([batch])
    with caplog.at_level(logging.WARNING, logger="torchturbo"):
        actual, turbo, [metrics] = _train([batch], budget=budget)
    assert _relative_error(actual, expected) <= TOLERANCE
    # The split is reported: in the metrics, on the engine, in the log.
    assert metrics.micro_batches == 4 and metrics.optimizer_stepped
    assert turbo.microbatcher.split == 4 and turbo.microbatcher.micro_batch_size == 4
    assert float(metrics.count) == 15  # every sample counted once
    assert len(turbo.microbatcher.events) == 2 and "micro-batch 15 -> 8" in caplog.text


def test_negative_control_averaging_the_pieces_equally_is_wrong():
    """Dividing each piece's loss by the number of pieces (the article's rule) is not exact."""
    batch = _batch(15)
    expected, _, _ = _train([batch])
    model = _model()
    for piece in split_batch(batch, 4):
        (_loss(model, piece) / 4).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= p.grad
    assert _relative_error(model, expected) > 100 * TOLERANCE


def test_an_out_of_memory_late_in_a_window_replays_the_window_once():
    """OOM on the 2nd batch of a window: the 1st is replayed, nothing is lost or applied twice."""
    small, large = _batch(3, seed=1), _batch(16, seed=2)
    budget = _saved_bytes(_model(), _batch(8)) + 64  # 3 rows fit, 16 do not, 8 do
    expected, _, _ = _train([small, large], steps=2)
    actual, turbo, metrics = _train([small, large], steps=2, budget=budget)
    assert [m.micro_batches for m in metrics] == [1, 2]
    assert turbo.optimizer_steps == 1
    assert _relative_error(actual, expected) <= TOLERANCE
    # The split stays for later steps without a new out-of-memory.
    _, turbo_more, _ = _train([small, large, small, large], steps=2, budget=budget)
    assert len(turbo_more.microbatcher.events) == 1 and turbo_more.optimizer_steps == 2


def test_an_out_of_memory_in_backward_is_retried_exactly():
    """A CUDA-style OOM raised in backward, after some gradients were already accumulated."""

    def loss_oom_in_backward(model, batch):
        x, y = batch
        hidden = model[1](model[0](x))
        if x.shape[0] > 4:  # the test hook: pieces over 4 samples "run out of memory"

            def fail(_grad):
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")

            hidden.register_hook(fail)
        return nn.functional.cross_entropy(model[2](hidden), y)

    batch = _batch(12)
    expected, _, _ = _train([batch])
    model = copy.deepcopy(_model())
    turbo = Turbo(TurboConfig(device="cpu"))
    model, _, _ = turbo.setup(model, torch.optim.SGD(model.parameters(), lr=1.0))
    metrics = turbo.step(loss_oom_in_backward, batch)
    assert metrics.micro_batches == 4 and turbo.microbatcher.events
    assert _relative_error(model, expected) <= TOLERANCE


def test_a_budget_below_one_sample_is_a_clear_error():
    with pytest.raises(MemoryBudgetError, match=r"memory_budget_bytes = 64 cannot hold one sample"):
        _train([_batch(4)], budget=64)


def test_auto_microbatch_off_lets_the_error_through():
    config = TurboConfig(device="cpu").replace(
        reliability__memory_budget_bytes=64, reliability__auto_microbatch=False
    )
    turbo = Turbo(config)
    model = _model()
    turbo.setup(model, torch.optim.SGD(model.parameters(), lr=1.0))
    with pytest.raises(torch.OutOfMemoryError, match="memory_budget_bytes = 64"):
        turbo.step(_loss, _batch(4))


def test_split_batch_keeps_structure_and_every_row_once():
    batch = {"x": torch.arange(10).view(5, 2), "ids": torch.arange(5), "scale": 2.0}
    pieces = split_batch(batch, 2)
    assert [p["ids"].tolist() for p in pieces] == [[0, 1, 2], [3, 4]]
    assert all(p["scale"] == 2.0 and p["x"].shape[1] == 2 for p in pieces)
    assert len(split_batch(batch, 8)) == 5  # never an empty piece
