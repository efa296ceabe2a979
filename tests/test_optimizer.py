"""The optimizer rebuilt with foreach/fused: same state and hyper-parameters, the same training
(bit for bit with foreach, within rounding with fused), and a stated reason where it cannot be."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import MLP, classification_loss, cpu_stage_context
from torch import nn

from torchturbo.config import TurboConfig
from torchturbo.engine import Turbo
from torchturbo.recipe import Recipe
from torchturbo.techniques.optimizer import (
    implementation_unsupported,
    optimizer_stage,
    rebuild_optimizer,
)

#: (class, hyper-parameters): the built-in workloads' AdamW, plus Adam, SGD and Adagrad.
OPTIMIZERS = [
    (torch.optim.AdamW, {"lr": 1e-2, "betas": (0.8, 0.95), "weight_decay": 0.1}),
    (torch.optim.Adam, {"lr": 1e-2, "eps": 1e-6, "amsgrad": True}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3}),
    (torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 1e-3}),
]
# The fused kernel rounds each intermediate of the update differently from the per-tensor loop:
# about one fp32 ulp (6e-8 relative) per step, so 2e-7 after 20 steps was measured; 2e-6 leaves
# 10x margin and is still 1000x below what losing the optimizer state does (negative control).
FUSED = {"rtol": 2e-6, "atol": 1e-7}
STEPS_BEFORE, STEPS_AFTER = 3, 20


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(16, 32, generator=generator)
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()


def _runs(cls, kwargs, implementation, rebuild=rebuild_optimizer):
    """(reference model, model whose optimizer was rebuilt after STEPS_BEFORE steps)."""
    reference, rebuilt = _model(), _model()
    reference_opt, opt = cls(reference.parameters(), **kwargs), cls(rebuilt.parameters(), **kwargs)
    _train(reference, reference_opt, STEPS_BEFORE)
    _train(rebuilt, opt, STEPS_BEFORE)
    opt, reason = rebuild(opt, implementation)
    assert reason is None
    _train(reference, reference_opt, STEPS_AFTER)
    _train(rebuilt, opt, STEPS_AFTER)
    return reference, rebuilt


@pytest.mark.parametrize(("cls", "kwargs"), OPTIMIZERS, ids=[c.__name__ for c, _ in OPTIMIZERS])
def test_foreach_trains_bit_for_bit_like_the_optimizer_built(cls, kwargs) -> None:
    reference, rebuilt = _runs(cls, kwargs, "foreach")
    for a, b in zip(reference.parameters(), rebuilt.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("cls", "kwargs"), OPTIMIZERS, ids=[c.__name__ for c, _ in OPTIMIZERS])
def test_fused_trains_like_the_optimizer_built_within_rounding(cls, kwargs) -> None:
    reference, rebuilt = _runs(cls, kwargs, "fused")
    for a, b in zip(reference.parameters(), rebuilt.parameters(), strict=True):
        torch.testing.assert_close(b, a, **FUSED)


def test_negative_control_a_fused_optimizer_without_the_old_state_fails_the_tolerance() -> None:
    def fresh(optimizer, implementation):  # what a naive rebuild would do: state lost
        return type(optimizer)(optimizer.param_groups[0]["params"], lr=1e-2, fused=True), None

    reference, rebuilt = _runs(torch.optim.Adam, {"lr": 1e-2}, "fused", rebuild=fresh)
    close = [
        torch.allclose(b, a, **FUSED)
        for a, b in zip(reference.parameters(), rebuilt.parameters(), strict=True)
    ]
    assert not any(close)


def test_the_rebuilt_optimizer_holds_the_same_groups_hyper_parameters_and_state() -> None:
    model = _model()
    groups = [
        {"params": model[0].parameters(), "lr": 1e-3},
        {"params": model[2].parameters(), "weight_decay": 0.5},
    ]
    optimizer = torch.optim.AdamW(groups, lr=1e-2, betas=(0.8, 0.95))
    _train(model, optimizer, 2)
    rebuilt, reason = rebuild_optimizer(optimizer, "fused")
    assert reason is None and type(rebuilt) is torch.optim.AdamW and rebuilt is not optimizer
    for old, new in zip(optimizer.param_groups, rebuilt.param_groups, strict=True):
        assert new["params"] == old["params"]
        assert {k: v for k, v in new.items() if k not in ("fused", "foreach")} == {
            k: v for k, v in old.items() if k not in ("fused", "foreach")
        }
        assert new["fused"] is True and new["foreach"] is False
    for p in model.parameters():
        for key, value in optimizer.state[p].items():
            assert torch.equal(rebuilt.state[p][key], value), key
    assert rebuilt.defaults["decoupled_weight_decay"] is True  # AdamW's, not a constructor arg


@pytest.mark.parametrize(
    ("build", "implementation", "reason"),
    [
        (lambda ps: torch.optim.RMSprop(ps), "fused", "RMSprop has no fused= option"),
        (lambda ps: torch.optim.LBFGS(ps), "foreach", "LBFGS has no foreach= option"),
    ],
)
def test_classes_without_the_option_are_left_as_built_with_the_reason(
    build, implementation, reason
) -> None:
    optimizer = build(_model().parameters())
    same, why = rebuild_optimizer(optimizer, implementation)
    assert same is optimizer and why == reason


def test_an_optimizer_a_scheduler_or_hooks_hold_is_not_rebuilt() -> None:
    optimizer = torch.optim.AdamW(_model().parameters())
    torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    same, why = rebuild_optimizer(optimizer, "fused")
    assert same is optimizer and "LR scheduler" in why
    hooked = torch.optim.AdamW(_model().parameters())
    hooked.register_step_post_hook(lambda *args: None)
    assert "hooks" in implementation_unsupported(hooked, "fused")


def test_an_unknown_implementation_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="implementation='apex' is invalid: expected one of"):
        implementation_unsupported(torch.optim.SGD(_model().parameters(), lr=0.1), "apex")


def _recipe(optimizer) -> Recipe:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=generator)
    return Recipe(
        name="mlp",
        model=MLP,
        optimizer=optimizer,
        loss_fn=classification_loss,
        dataset=torch.utils.data.TensorDataset(x, (x[:, :5].argmax(1)).long()),
        batch_size=16,
    )


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_engine_rebuilds_the_optimizer_and_training_matches(dtype) -> None:
    def run(implementation: str):
        recipe = _recipe(lambda params: torch.optim.AdamW(params, lr=1e-2))
        config = TurboConfig(device="cpu").replace(
            precision__dtype=dtype, optimizer__implementation=implementation
        )
        turbo = Turbo(config)
        model, optimizer = recipe.build()
        model, optimizer, _ = turbo.setup(model, optimizer)
        batch = next(iter(torch.utils.data.DataLoader(recipe.dataset, batch_size=16)))
        losses = [float(turbo.step(recipe.loss_fn, batch).loss) for _ in range(5)]
        turbo.close()
        return optimizer, model, losses, turbo.applied

    _, plain_model, plain_losses, _ = run("as_built")
    optimizer, model, losses, applied = run("fused")
    assert applied["optimizer"] is None and optimizer.param_groups[0]["fused"] is True
    assert losses == pytest.approx(plain_losses, rel=1e-5)
    for a, b in zip(plain_model.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(b, a, **FUSED)


def test_the_engine_reports_an_optimizer_it_cannot_rebuild() -> None:
    model = _model()
    optimizer = torch.optim.RMSprop(model.parameters())
    turbo = Turbo(TurboConfig(device="cpu").replace(optimizer__implementation="fused"))
    _, returned, _ = turbo.setup(model, optimizer)
    assert returned is optimizer and turbo.applied["optimizer"] == "RMSprop has no fused= option"


def test_the_tuner_stage_proposes_what_the_optimizer_class_supports() -> None:
    adamw = optimizer_stage(cpu_stage_context(_recipe(lambda ps: torch.optim.AdamW(ps))))
    assert [c.name for c in adamw] == ["optimizer:foreach", "optimizer:fused"]
    assert adamw[1].config.optimizer.implementation == "fused"
    rmsprop = optimizer_stage(cpu_stage_context(_recipe(lambda ps: torch.optim.RMSprop(ps))))
    assert [c.name for c in rmsprop] == ["optimizer:foreach"]
    lbfgs = optimizer_stage(cpu_stage_context(_recipe(lambda ps: torch.optim.LBFGS(ps))))
    assert lbfgs == "foreach: LBFGS has no foreach= option; fused: LBFGS has no fused= option"


def test_rebuilding_keeps_the_old_optimizer_untouched_for_a_copy() -> None:
    # The rebuilt optimizer shares state tensors; the old object keeps its own groups and flags.
    optimizer = torch.optim.Adam(_model().parameters(), lr=1e-2)
    groups = copy.deepcopy(
        [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    )
    rebuild_optimizer(optimizer, "fused")
    assert [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups] == groups
