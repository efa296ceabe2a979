"""``[optimizer] state``: bf16 moments with stochastic rounding, torchao's 8-bit, 4-bit and fp8.

The registry's tests (``optimizer_state`` in technique_settings.py) train the ConvNet with bf16
moments against fp32 AdamW. These check the rounding itself (unbiased, where round-to-nearest
freezes the second moment: the negative control), the rebuild, the bytes the planner predicts
against the bytes torchao allocates, the translations, and (slow: torchao compiles its step)
each state's loss over 40 steps and its measured bytes.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchturbo import TurboConfig
from torchturbo.integrations.translate import hf_arguments, lightning_arguments
from torchturbo.techniques.optimizer_state import (
    TORCHAO_CLASSES,
    planned_state_bytes,
    rebuild_with_state,
    state_bytes,
    state_unavailable,
    state_unsupported,
)
from torchturbo.techniques.tools.bf16_adam import AdamBf16, stochastic_round_bf16


def test_stochastic_rounding_is_unbiased_where_nearest_is_not():
    value = torch.full((200_000,), 1 + 2**-10)  # a quarter of a bf16 step above 1.0
    rounded = stochastic_round_bf16(value, torch.Generator().manual_seed(0)).float()
    assert set(rounded.unique().tolist()) == {1.0, 1 + 2**-7}  # the two neighbours only
    assert rounded.mean().item() == pytest.approx(1 + 2**-10, abs=2e-5)
    assert value.to(torch.bfloat16).float().mean().item() == 1.0  # nearest: always down
    negative = stochastic_round_bf16(-value, torch.Generator().manual_seed(0)).float()
    assert negative.mean().item() == pytest.approx(-(1 + 2**-10), abs=2e-5)
    exact = torch.tensor([0.5, -3.0, 0.0])
    assert torch.equal(stochastic_round_bf16(exact, torch.Generator()).float(), exact)


def _second_moment(steps: int, rounding: str) -> float:
    """Adam's exp_avg_sq after ``steps`` constant unit gradients, kept in bf16."""
    if rounding == "stochastic":
        param = nn.Parameter(torch.zeros(1_000))
        optimizer = AdamBf16([param], lr=0.0, weight_decay=0.0)
        for _ in range(steps):
            param.grad = torch.ones_like(param)
            optimizer.step()
        return optimizer.state[param]["exp_avg_sq"].float().mean().item()
    moment = torch.zeros(1_000, dtype=torch.bfloat16)
    for _ in range(steps):
        moment = (moment.float() * 0.999 + 0.001).to(torch.bfloat16)
    return moment.float().mean().item()


def test_bf16_moments_keep_moving_where_nearest_rounding_freezes_them():
    true = 1 - 0.999**500  # 0.394
    assert _second_moment(500, "stochastic") == pytest.approx(true, rel=0.02)
    # Nearest stops at 0.25, where a step (0.001 x 0.75) is under half a bf16 ulp (2^-10).
    assert _second_moment(500, "nearest") == pytest.approx(0.25, abs=0.01)


#: 128 x 128 weights: large enough that torchao's per-tensor code map (1 KiB for 8-bit) is a
#: small part of the quantised bytes, and one shape, so that its step compiles once.
WIDTH = 128


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(WIDTH, WIDTH, bias=False), nn.Tanh(), nn.Linear(WIDTH, WIDTH, bias=False)
    )


def _train(optimizer_for, steps: int) -> tuple[list[float], torch.optim.Optimizer]:
    model = _mlp()
    optimizer = optimizer_for(model.parameters())
    teacher = torch.Generator().manual_seed(1)
    target = torch.randn(WIDTH, WIDTH, generator=teacher) / WIDTH**0.5
    losses = []
    for step in range(steps):
        x = torch.randn(32, WIDTH, generator=torch.Generator().manual_seed(100 + step))
        loss = torch.nn.functional.mse_loss(model(x), torch.tanh(x @ target) * 0.5)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, optimizer


def test_bf16_adamw_follows_torch_adamw_over_40_steps():
    reference, fp32 = _train(lambda p: torch.optim.AdamW(p, lr=1e-2), 40)
    losses, bf16 = _train(lambda p: rebuild_with_state(torch.optim.AdamW(p, lr=1e-2), "bf16"), 40)
    assert reference[-1] < 0.5 * reference[0]  # it learns: the comparison means something
    # bf16 moments round each update by ~0.4%: measured at most 0.05% apart per step here.
    assert max(abs(a - b) / b for a, b in zip(losses, reference, strict=True)) < 0.002
    assert state_bytes(bf16) == planned_state_bytes(_mlp().parameters(), "bf16")
    assert state_bytes(bf16) / state_bytes(fp32) == pytest.approx(0.5, abs=1e-3)


def test_the_rebuild_keeps_groups_and_hyper_parameters():
    model = _mlp()
    first, second = model[0].weight, model[2].weight
    built = torch.optim.Adam(
        [{"params": [first], "lr": 0.1}, {"params": [second]}],
        lr=0.01,
        betas=(0.8, 0.9),
        eps=1e-6,
        weight_decay=0.05,
    )
    rebuilt = rebuild_with_state(built, "bf16")
    assert isinstance(rebuilt, AdamBf16)
    assert rebuilt.param_groups[0]["decoupled"] is False  # Adam: L2 decay
    assert [g["lr"] for g in rebuilt.param_groups] == [0.1, 0.01]
    assert [g["params"] for g in rebuilt.param_groups] == [[first], [second]]
    assert rebuilt.param_groups[1]["betas"] == (0.8, 0.9)
    assert rebuilt.param_groups[1]["weight_decay"] == 0.05
    if state_unavailable("8bit") is None:  # torchao: built, not stepped (nothing compiles)
        import torchao.optim

        eight = rebuild_with_state(torch.optim.AdamW(model.parameters(), lr=0.02), "8bit")
        assert type(eight) is torchao.optim.AdamW8bit
        assert float(eight.param_groups[0]["lr"]) == pytest.approx(0.02)


def test_what_cannot_be_rebuilt_says_why():
    params = list(_mlp().parameters())
    assert "Adam and AdamW only" in str(state_unsupported(torch.optim.SGD(params, lr=1), "8bit"))
    maximizing = torch.optim.AdamW(params, maximize=True)
    assert "maximize=True" in str(state_unsupported(maximizing, "bf16"))
    assert "amsgrad=True" in str(state_unsupported(torch.optim.AdamW(params, amsgrad=True), "bf16"))
    stepped = torch.optim.AdamW(params)
    for p in params:
        p.grad = torch.zeros_like(p)
    stepped.step()
    assert "has stepped" in str(state_unsupported(stepped, "bf16"))
    with pytest.raises(ValueError, match="state='3bit' is invalid"):
        rebuild_with_state(torch.optim.AdamW(params), "3bit")


def test_a_fused_rebuild_is_not_replaced_silently():
    from torchturbo import Turbo

    model = _mlp()
    turbo = Turbo(
        TurboConfig(device="cpu").replace(
            optimizer__implementation="fused", optimizer__state="bf16"
        )
    )
    _, optimizer, _ = turbo.setup(model, torch.optim.AdamW(model.parameters()))
    assert optimizer.param_groups[0]["fused"] is True
    assert "implementation = 'fused'" in str(turbo.applied["optimizer_state"])


@pytest.mark.skipif(state_unavailable("8bit") is not None, reason="torchao cannot run here")
@pytest.mark.parametrize("state", sorted(TORCHAO_CLASSES))
def test_the_planned_bytes_are_what_torchao_allocates(state):
    """torchao's own buffers for each parameter shape (allocated, not stepped: nothing
    compiles): quantised from 4,096 values divisible by the block, float32 otherwise."""
    import torchao.optim

    shapes = [(256, 64), (64,), (4097,), (128, 32)]
    params = [nn.Parameter(torch.zeros(shape)) for shape in shapes]
    optimizer = getattr(torchao.optim, TORCHAO_CLASSES[state][0])(params)
    from torchturbo.measure.memory import tensor_bytes

    allocated = sum(
        4
        + tensor_bytes(optimizer._new_buffer(p, True))
        + tensor_bytes(optimizer._new_buffer(p, False))
        for p in params
    )
    assert planned_state_bytes(params, state) == allocated
    fp32 = planned_state_bytes(params, "as_built")
    share = {"8bit": 0.25, "fp8": 0.25, "4bit": 0.125}[state]
    big = [params[0]]  # the quantised one: its share of float32's bytes
    assert planned_state_bytes(big, state) / planned_state_bytes(big, "as_built") == pytest.approx(
        share, rel=0.1
    )
    assert planned_state_bytes(params, state) < fp32


def test_the_trainers_carry_it_or_say_how():
    base = TurboConfig(device="cpu")
    assert hf_arguments(base.replace(optimizer__state="8bit")).kwargs["optim"] == "adamw_torch_8bit"
    assert hf_arguments(base.replace(optimizer__state="4bit")).kwargs["optim"] == "adamw_torch_4bit"
    bf16 = hf_arguments(base.replace(optimizer__state="bf16"))
    assert "optim" not in bf16.kwargs and "rebuild_with_state" in bf16.notes["[optimizer] state"]
    lightning = lightning_arguments(base.replace(optimizer__state="8bit"))
    assert "configure_optimizers" in lightning.notes["[optimizer] state"]


@pytest.mark.slow
@pytest.mark.skipif(state_unavailable("8bit") is not None, reason="torchao cannot run here")
@pytest.mark.parametrize("state", sorted(TORCHAO_CLASSES))
def test_torchao_states_follow_adamw_over_40_steps_in_fewer_bytes(state):
    reference, fp32 = _train(lambda p: torch.optim.AdamW(p, lr=1e-2), 40)
    losses, rebuilt = _train(lambda p: rebuild_with_state(torch.optim.AdamW(p, lr=1e-2), state), 40)
    differences = [abs(a - b) / b for a, b in zip(losses, reference, strict=True)]
    # Measured here, per step over the 40 (the loss falls 6x): 8bit at most 0.2% (0.06% on
    # average), fp8 0.6% (0.17%), 4bit 6.5% (1.8%): 4-bit moments are the coarsest. Bounds
    # at about twice that; the tuner's own rule is 5% on the mean of the first 6 steps.
    bound = {"8bit": 0.005, "fp8": 0.012, "4bit": 0.12}[state]
    assert max(differences) < bound and sum(differences) / len(differences) < bound / 3
    assert state_bytes(rebuilt) == planned_state_bytes(_mlp().parameters(), state)
    share = {"8bit": 0.25, "fp8": 0.25, "4bit": 0.125}[state]
    assert state_bytes(rebuilt) / state_bytes(fp32) == pytest.approx(share, rel=0.1)


def _state_bound(mib: int = 2**20):
    """An estimate whose optimizer state (8 MiB) dwarfs its activations (a few KiB in 2 blocks):
    no recompute or micro-batch frees what a budget under weights + gradients + state asks."""
    from torchturbo.measure.footprint import BlockMemory, Line, MemoryEstimate

    blocks = tuple(
        BlockMemory(
            name=f"layers.{i}",
            type_name="Layer",
            checkpointable=True,
            held=Line(0.0, 512.0),
            freeable=Line(0.0, 384.0),
            forward_s=0.01,
        )
        for i in range(2)
    )
    estimate = MemoryEstimate(
        batch_size=8,
        slices=(2, 4),
        weights_bytes=4 * mib,
        gradients_bytes=4 * mib,
        optimizer_bytes=8 * mib,
        blocks=blocks,
    )
    return estimate, {"bf16": 4 * mib, "8bit": 2 * mib + 40_000, "4bit": mib + 40_000}


def test_the_planner_frees_optimizer_state_only_where_nothing_else_fits():
    from torchturbo.tune.memory.plan import plan_name, plans

    estimate, states = _state_bound()
    mib = 2**20
    # 16 MiB of weights, gradients and state: 13 MiB fits with bf16 moments (12), not without.
    found = plans(estimate, 13 * mib, states=states)
    assert [p.state for p in found] == ["bf16"]  # the least lossy; 8bit and 4bit dominated
    assert plan_name(found[0], 2, 8) == "plan: bf16 optimizer state"
    assert found[0].estimated_bytes == 12 * mib + 2 * 8 * 512  # two blocks of 8 samples
    # 11 MiB needs 8-bit moments; 9.6 MiB 4-bit ones.
    assert {p.state for p in plans(estimate, 11 * mib, states=states)} == {"8bit"}
    assert {p.state for p in plans(estimate, int(9.6 * mib), states=states)} == {"4bit"}
    # Negative control: without states nothing fits (the leanest plan alone, over the budget).
    (leanest,) = plans(estimate, 13 * mib)
    assert leanest.state is None and leanest.estimated_bytes > 13 * mib
    # Where recomputing fits, no state is planned (it would change the updates for nothing).
    roomy = plans(estimate, 16 * mib + 1024, states=states)
    assert roomy and all(p.state is None for p in roomy)


class Wide(nn.Module):
    """Two 256-wide layers on 4 samples: 1 MiB of Adam moments, kilobytes of activations."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Sequential(nn.Linear(256, 256), nn.Tanh()),
            nn.Sequential(nn.Linear(256, 256), nn.Tanh()),
        )
        self.head = nn.Linear(256, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(x))


def _wide_recipe():
    from torchturbo.recipe import Recipe

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=generator)
    return Recipe(
        name="wide",
        model=Wide,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        loss_fn=lambda model, batch: torch.nn.functional.cross_entropy(model(batch[0]), batch[1]),
        dataset=torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long()),
        batch_size=4,
    )


def test_a_budget_only_a_smaller_state_meets_is_met_and_the_written_config_trains_in_it(
    monkeypatch,
):
    """The tuner over a budget below weights + gradients + fp32 moments + activations: the
    planner's plan is the bf16 state (torchao's states are left out here: they compile), its
    loss difference is measured, and turbo.toml's config trains within the budget."""
    import dataclasses

    from test_tune import QUICK

    from torchturbo.trials.trial import Trial, fixed_batches
    from torchturbo.tune.memory import plan as memory_plan
    from torchturbo.tune.search.run import tune
    from torchturbo.tune.search.stages import tuner_stages

    monkeypatch.setattr(memory_plan, "PLANNER_STATES", ("bf16",))
    recipe = _wide_recipe()
    weights = sum(p.numel() * 4 for p in Wide().parameters())
    budget = int(3.5 * weights)  # weights + gradients + fp32 moments = 4x the weights
    options = dataclasses.replace(QUICK, memory_budget=budget, max_rounds=3)
    config, result = tune(recipe, options, stages={"memory": tuner_stages()["memory"]})
    rows = {o.name: o for o in result.candidates}
    plan = rows["plan: bf16 optimizer state"]
    assert plan.verdict == "adopted" and config.optimizer.state == "bf16"
    assert plan.parity is not None and plan.parity.relative_diff < 0.05  # stated and small
    assert plan.memory_bytes is not None and plan.memory_bytes <= budget
    trial = Trial(recipe, config, fixed_batches(recipe, 2))  # what turbo.toml trains
    try:
        trial.step()
        trial.step()
        footprint, _ = trial.memory_footprint()
    finally:
        trial.close()
    assert footprint is not None and footprint <= budget < 4 * weights


# Lightning's own warnings, as tests/test_integrations_lightning.py ignores them.
@pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning")
@pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)`:FutureWarning")
def test_lightning_trains_with_the_state_built_in_configure_optimizers():
    """The Lightning path: ``configure_optimizers`` returns the rebuilt optimizer; Lightning
    fits with it, and the tuner's recipe rebuilds it per trial with the same state."""
    from test_integrations_lightning import STEPS, Classifier, Images, fit

    from torchturbo.integrations.lightning import recipe_from_lightning

    class Bf16Classifier(Classifier):
        def configure_optimizers(self):
            return rebuild_with_state(torch.optim.AdamW(self.parameters(), lr=1e-2), "bf16")

    module = Bf16Classifier()
    recorder = fit(module, None)
    optimizer = module.trainer.optimizers[0]
    assert isinstance(optimizer, AdamBf16) and len(recorder.losses) == STEPS
    assert all(s["exp_avg"].dtype == torch.bfloat16 for s in optimizer.state.values())
    _, rebuilt = recipe_from_lightning(Bf16Classifier(), Images()).build()
    assert isinstance(rebuilt, AdamBf16) and rebuilt.param_groups[0]["decoupled"] is True
