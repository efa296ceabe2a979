"""The engine's own contracts: the order of composition, its public state (state_dict,
recording, the end-of-epoch signal), and that nothing outside it writes its attributes."""

from __future__ import annotations

import ast
import copy
import dataclasses
from pathlib import Path

import pytest
import torch
from conftest import MLP, ConvNet, classification_loss
from torch import nn

from torchturbo import Turbo, TurboConfig
from torchturbo.distributed.launch import DistEnv
from torchturbo.distributed.strategy import Strategy
from torchturbo.engine import compose
from torchturbo.measure.breakdown import NullRecorder, PhaseRecorder
from torchturbo.techniques import registry
from torchturbo.techniques.checkpointing import CHECKPOINTED_MARK

SRC = Path(__file__).parents[1] / "src" / "torchturbo"


def _state(model: nn.Module) -> dict[str, object]:
    """What a composition step can observe of the steps before it."""
    conv = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
    return {
        "device": conv.weight.device.type,
        "nhwc": conv.weight.is_contiguous(memory_format=torch.channels_last),
        "checkpointed": sum(getattr(m, CHECKPOINTED_MARK, False) for m in model.modules()),
    }


def test_composition_runs_device_layout_checkpointing_compile_then_wrap(monkeypatch):
    """Each step is spied on: it must run after the ones it depends on, and see their effect."""
    seen: list[tuple[str, dict[str, object]]] = []

    def spy(name: str, real):
        def step(model, *args, **kwargs):
            seen.append((name, _state(model)))
            return real(model, *args, **kwargs)

        return step

    spied = tuple(
        dataclasses.replace(t, transform=spy(t.name, t.transform)) if t.transform else t
        for t in registry.techniques()
    )
    monkeypatch.setattr(registry, "techniques", lambda: spied)

    class Recording(Strategy):
        def wrap(self, model, optimizer, reference, comm_stats):
            seen.append(("wrap", _state(model)))
            return model

    config = TurboConfig(device="cpu").replace(
        memory_format__channels_last=True, checkpointing__mode="full", compile__mode="default"
    )
    model = ConvNet()
    # The meta device makes step 1 observable: every later step must see meta parameters.
    meta = torch.device("meta")
    compose.compose(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        config=config,
        device=meta,
        strategy=Recording(config, meta, DistEnv()),
        reference=lambda: torch.ones(()),
    )
    names = [name for name, _ in seen]
    assert names == ["channels_last", "checkpointing", "compile", "wrap"]
    states = dict(seen)
    assert all(state["device"] == "meta" for state in states.values())  # 1. device first
    assert states["checkpointing"]["nhwc"]  # 2. layout before checkpointing
    assert states["compile"]["checkpointed"] == 2  # 3. both blocks before compile
    assert states["wrap"]["nhwc"] and states["wrap"]["checkpointed"] == 2  # 5. wrap last


def _train(turbo: Turbo, batches, windows: int) -> None:
    stepped = 0
    for batch in batches:
        stepped += turbo.step(classification_loss, batch).optimizer_stepped
        if stepped == windows:
            return


def _batches(count: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(6, 16, generator=generator), torch.randint(0, 5, (6,), generator=generator))
        for _ in range(count)
    ]


def _engine(model: nn.Module) -> Turbo:
    config = TurboConfig(device="cpu").replace(accumulation__steps=2)
    turbo = Turbo(config)
    turbo.setup(model, torch.optim.Adam(model.parameters(), lr=0.01))
    return turbo


def test_state_dict_continues_a_run_exactly_in_another_engine():
    """Adam moments, counters and the dropout RNG all travel: the continuation is bit-exact."""
    torch.manual_seed(0)
    model = MLP(dropout=0.3)
    first, copy_of_model = _engine(model), copy.deepcopy(model)
    _train(first, _batches(4, 1), windows=2)
    state = copy.deepcopy(first.state_dict())  # like torch's, it holds the live tensors
    later = _batches(4, 2)
    _train(first, later, windows=2)
    # Another engine on the same architecture with its own (stale) weights; loading also puts
    # back the random state, which first's continuation has since moved on.
    second = _engine(copy.deepcopy(copy_of_model))
    second.load_state_dict(state)
    assert second.optimizer_steps == 2
    _train(second, later, windows=2)
    for a, b in zip(first.model.parameters(), second.model.parameters(), strict=True):
        assert torch.equal(a, b)
    # Negative control: without the random state the dropout masks differ, and so do results.
    third = _engine(copy.deepcopy(copy_of_model))
    third.load_state_dict({**state, "random": None})
    _train(third, later, windows=2)
    assert any(
        not torch.equal(a, b)
        for a, b in zip(first.model.parameters(), third.model.parameters(), strict=True)
    )


def test_state_dict_inside_a_window_is_refused():
    turbo = _engine(MLP())
    turbo.step(classification_loss, _batches(1, 0)[0])
    with pytest.raises(RuntimeError, match="inside an accumulation window"):
        turbo.state_dict()


def test_recording_times_the_phases_and_puts_the_previous_recorder_back():
    turbo = _engine(MLP())
    before = turbo.recorder
    recorder = PhaseRecorder("cpu")
    with turbo.recording(recorder):
        _train(turbo, _batches(2, 0), windows=1)
    assert turbo.recorder is before and isinstance(before, NullRecorder)
    assert recorder.counts() == {"forward": 2, "backward": 2, "optimizer": 1}


def test_the_loader_signals_its_last_batch_and_the_engine_closes_the_window_on_it():
    model = MLP()
    turbo = Turbo(TurboConfig(device="cpu").replace(accumulation__steps=4))
    dataset = torch.utils.data.TensorDataset(torch.randn(24, 16), torch.randint(0, 5, (24,)))
    _, _, loader = turbo.setup(
        model, torch.optim.SGD(model.parameters(), lr=0.1), dataset, batch_size=4
    )
    signals, stepped = [], []
    for batch in loader:
        signals.append(loader.at_last_batch)
        stepped.append(turbo.step(classification_loss, batch).optimizer_stepped)
    assert signals == [False] * 5 + [True]
    assert stepped == [False, False, False, True, False, True]  # the 2-batch tail is applied
    assert not loader.at_last_batch  # and the signal ends with the epoch


def test_setup_twice_is_refused():
    turbo = _engine(MLP())
    model = MLP()
    with pytest.raises(RuntimeError, match="already called"):
        turbo.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))


def _turbo_attribute_writes(source: str, name: str) -> list[str]:
    """``x.turbo.attr = ...`` / ``turbo.attr = ...`` assignments in one source file."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            for leaf in ast.walk(target):
                if not isinstance(leaf, ast.Attribute):
                    continue
                owner = leaf.value
                owner_name = owner.attr if isinstance(owner, ast.Attribute) else ""
                owner_name = owner_name or getattr(owner, "id", "")
                if owner_name in ("turbo", "_turbo"):
                    found.append(f"{name}:{node.lineno}")
    return found


def test_no_module_outside_the_engine_assigns_a_turbo_attribute():
    writes = [
        hit
        for path in sorted(SRC.rglob("*.py"))
        if path.relative_to(SRC).parts[0] != "engine"
        for hit in _turbo_attribute_writes(path.read_text(), str(path.relative_to(SRC)))
    ]
    assert writes == []
    # The check sees the patterns it forbids.
    swap = "trial.turbo.recorder = recorder\nturbo.applied['x'] = None\n_turbo.model += 1\n"
    assert _turbo_attribute_writes(swap, "swap.py") == ["swap.py:1", "swap.py:2", "swap.py:3"]


def test_counting_ddp_traffic_in_one_process_is_refused():
    from torchturbo.distributed.comm import CommStats

    turbo = Turbo(TurboConfig(device="cpu"))
    model = MLP()
    with pytest.raises(ValueError, match="this run has one process"):
        turbo.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), comm_stats=CommStats())


def test_a_step_technique_reaches_the_engine_through_the_registry_alone(monkeypatch):
    """A loss-scaling variant declared only as a technique with a ``step`` hook (no engine
    edit): it scales the loss by 1/8 and unscales the gradients before clipping, the engine runs
    both and keeps its state, and the weights are those of an engine without it."""
    from torchturbo.techniques.framework.spec import Technique
    from torchturbo.techniques.framework.steps import StepHooks

    calls: list[str] = []

    class EighthScale(StepHooks):
        def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
            calls.append("scale")
            return loss / 8

        def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
            calls.append("unscale")
            for group in optimizer.param_groups:
                for param in group["params"]:
                    param.grad.mul_(8)

        def state_dict(self) -> dict:
            return {"scale": 8}

    probe = Technique(
        name="eighth_scale",
        section="precision",
        doc="CONTRIBUTING.md",
        requested=lambda config: True,
        step=lambda config, device: EighthScale(),
        order=51,
        order_reason="a probe of the step hooks, beside precision's",
    )

    def engine() -> Turbo:  # SGD: Adam would not see a gradient scale left over
        torch.manual_seed(0)
        model = MLP()
        turbo = Turbo(TurboConfig(device="cpu").replace(accumulation__steps=2))
        turbo.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        return turbo

    techniques = registry.techniques()
    batches = _batches(4, seed=1)
    plain = engine()
    _train(plain, batches, windows=2)
    monkeypatch.setattr(registry, "techniques", lambda: (*techniques, probe))
    scaled = engine()
    _train(scaled, batches, windows=2)
    assert calls.count("scale") == len(batches) and calls.count("unscale") == 2
    assert scaled.state_dict()["steps"] == {"eighth_scale": {"scale": 8}}
    for got, want in zip(scaled.model.parameters(), plain.model.parameters(), strict=True):
        # Scaling by a power of two is exact: the same weights to the last bit.
        assert torch.equal(got, want)
    # Negative control: unscaling forgotten leaves gradients 8x too small: other weights.
    monkeypatch.setattr(EighthScale, "unscale_gradients", lambda self, optimizer: None)
    forgot = engine()
    _train(forgot, batches, windows=2)
    assert not all(
        torch.equal(a, b)
        for a, b in zip(forgot.model.parameters(), plain.model.parameters(), strict=True)
    )
