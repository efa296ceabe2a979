"""torch.compile computes what eager computes (one small model: compiling costs seconds)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import MLP

from torchturbo import Turbo, TurboConfig


def _loss(model, batch):
    return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])


@pytest.mark.slow
def test_compiled_training_step_matches_eager():
    model = MLP(width=32)
    x, y = torch.randn(8, 32), torch.randint(0, 5, (8,))
    losses = {}
    for mode in ("off", "default"):
        turbo = Turbo(TurboConfig(device="cpu").replace(compile__mode=mode))
        fresh = copy.deepcopy(model)
        m, _, _ = turbo.setup(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1))
        losses[mode] = [float(turbo.step(_loss, (x, y)).loss) for _ in range(3)]
        if mode == "default":
            assert turbo.applied["compile"] is None
            assert list(m.state_dict()) == list(model.state_dict())  # no _orig_mod. prefix
    # Inductor fuses and reorders fp32 reductions: agreement to ~1e-5 relative.
    torch.testing.assert_close(losses["default"], losses["off"], rtol=1e-5, atol=1e-6)
