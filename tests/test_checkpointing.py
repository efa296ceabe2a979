"""Activation checkpointing: same gradients (dropout included), fewer saved activations."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.utils.checkpoint
from conftest import MLP, classification_loss
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from torchturbo import Turbo, TurboConfig
from torchturbo.base.blocks import find_blocks
from torchturbo.config import CheckpointConfig
from torchturbo.techniques.checkpointing import apply_activation_checkpointing, select_blocks

CONFIGS = {
    "full": CheckpointConfig(mode="full"),
    "by_type": CheckpointConfig(mode="selective", module_types=("Sequential",)),
    "by_name": CheckpointConfig(mode="selective", name_pattern="blocks.[02]"),
    "every_2nd": CheckpointConfig(mode="selective", every_n=2),
    "named_blocks": CheckpointConfig(mode="selective", blocks=("blocks.0", "blocks.3")),
}


def _grads(model: nn.Module, x: torch.Tensor, seed: int = 123) -> list[torch.Tensor]:
    torch.manual_seed(seed)  # the same dropout masks for every variant
    model(x).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_checkpointing_gives_identical_gradients_with_dropout(name):
    model = MLP(depth=4, dropout=0.3)
    x = torch.randn(8, 16)
    reference = _grads(copy.deepcopy(model), x)
    checkpointed = copy.deepcopy(model)
    assert apply_activation_checkpointing(checkpointed, CONFIGS[name]).applied
    for got, want in zip(_grads(checkpointed, x), reference, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # same ops, same inputs, same RNG


def test_negative_control_without_rng_preservation_gradients_differ():
    """Recomputing dropout with a fresh RNG draw changes the gradient: preserving RNG matters."""
    model = MLP(depth=4, dropout=0.3)
    x = torch.randn(8, 16)
    reference = _grads(copy.deepcopy(model), x)
    broken = copy.deepcopy(model)
    for _, block in find_blocks(broken):
        block.forward = functools.partial(
            torch.utils.checkpoint.checkpoint,
            block.forward,
            use_reentrant=False,
            preserve_rng_state=False,
        )
    got = _grads(broken, x)
    assert any(not torch.equal(g, w) for g, w in zip(got, reference, strict=True))


def _step_flops(model: nn.Module, x: torch.Tensor) -> int:
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    return counter.get_total_flops()


def test_checkpointing_recomputes_the_forward_of_checkpointed_blocks():
    """Effect, not call: backward re-runs each checkpointed block's forward (2*B*in*out each)."""
    model = MLP(width=32, depth=4)
    x = torch.randn(8, 32)
    plain = _step_flops(copy.deepcopy(model), x)
    checkpointed = copy.deepcopy(model)
    names = apply_activation_checkpointing(checkpointed, CheckpointConfig(mode="full")).targets
    recompute = len(names) * 2 * 8 * 32 * 32
    assert _step_flops(checkpointed, x) == plain + recompute


def _block_forwards(config: TurboConfig) -> dict[str, int]:
    """How many times each block of an MLP runs its forward during one engine step, counted on
    the block's Linear (the recompute calls the block's own forward directly, not through
    ``__call__``, so a hook on the block itself sees only the first run)."""
    model = MLP(width=16, depth=3)
    calls = {name: 0 for name, _ in find_blocks(model)}

    def count(name: str, module: nn.Module, args: object) -> None:
        calls[name] += 1

    for name, block in find_blocks(model):
        block[0].register_forward_pre_hook(functools.partial(count, name))
    turbo = Turbo(config)
    turbo.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    turbo.step(classification_loss, (torch.randn(4, 16), torch.randint(0, 5, (4,))))
    return calls


def test_engine_checkpointed_blocks_run_their_forward_again_in_backward():
    """Through the engine: each checkpointed block runs twice per step (forward, recompute)."""
    every_2nd = TurboConfig(device="cpu").replace(
        checkpointing__mode="selective", checkpointing__every_n=2
    )
    assert _block_forwards(every_2nd) == {"blocks.0": 2, "blocks.1": 1, "blocks.2": 2}
    # Negative control: without checkpointing every block runs once.
    assert set(_block_forwards(TurboConfig(device="cpu")).values()) == {1}


def test_a_config_that_selects_no_block_is_reported_not_applied():
    result = apply_activation_checkpointing(
        MLP(), CheckpointConfig(mode="selective", name_pattern="nothing.*")
    )
    assert not result.applied and "selected no block" in result.reason


def test_checkpointing_reduces_tensors_saved_for_backward():
    def saved_bytes(model: nn.Module) -> int:
        storages: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(torch.randn(64, 256))
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        return sum(n for ptr, n in storages.items() if ptr not in params)

    # Blocks with a 4x-wide hidden layer: their internal activations dwarf their inputs.
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)) for _ in range(6)]
    )
    checkpointed = copy.deepcopy(model)
    apply_activation_checkpointing(checkpointed, CheckpointConfig(mode="full"))
    assert saved_bytes(checkpointed) < 0.3 * saved_bytes(model)


def test_state_dict_keys_are_unchanged():
    model = MLP()
    keys = list(model.state_dict())
    apply_activation_checkpointing(model, CheckpointConfig(mode="full"))
    assert list(model.state_dict()) == keys


def test_block_discovery_takes_outermost_repeated_blocks():
    model = MLP(depth=3)
    assert [n for n, _ in find_blocks(model)] == ["blocks.0", "blocks.1", "blocks.2"]
    chosen = select_blocks(model, CheckpointConfig(mode="selective", name_pattern="blocks.*"))
    # "blocks.*" also matches the layers inside each block; only the outermost are kept.
    assert [n for n, _ in chosen] == ["blocks.0", "blocks.1", "blocks.2"]
    every_2nd = select_blocks(model, CheckpointConfig(mode="selective", every_n=2))
    assert [n for n, _ in every_2nd] == ["blocks.0", "blocks.2"]


def test_blocks_that_are_sequentials_of_blocks_are_not_taken_twice():
    # A ResNet's stages: a Sequential of stages, each a Sequential of residual blocks.
    def stage() -> nn.Sequential:
        return nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(2)))

    model = nn.Module()
    model.stem = nn.Linear(4, 4)
    model.stages = nn.Sequential(stage(), stage())
    assert [n for n, _ in find_blocks(model)] == ["stages.0", "stages.1"]


def test_applying_twice_does_not_nest_checkpoints():
    model = MLP(width=32, depth=2)
    x = torch.randn(4, 32)
    once = copy.deepcopy(model)
    apply_activation_checkpointing(once, CheckpointConfig(mode="full"))
    twice = copy.deepcopy(model)
    apply_activation_checkpointing(twice, CheckpointConfig(mode="full"))
    apply_activation_checkpointing(twice, CheckpointConfig(mode="full"))
    assert _step_flops(once, x) == _step_flops(twice, x)


def test_batchnorm_statistics_are_updated_once_not_twice():
    """The recompute in backward must not move BatchNorm running stats a second time."""
    model = nn.Sequential(
        *[
            nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
            for _ in range(3)
        ]
    )
    x = torch.randn(8, 4, 8, 8)
    plain = copy.deepcopy(model)
    plain(x).sum().backward()
    checkpointed = copy.deepcopy(model)
    apply_activation_checkpointing(checkpointed, CheckpointConfig(mode="full"))
    checkpointed(x).sum().backward()
    for want, got in zip(plain.buffers(), checkpointed.buffers(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # Negative control: plain checkpoint (no restore) counts the batch twice.
    broken = copy.deepcopy(model)
    for _, block in find_blocks(broken):
        block.forward = functools.partial(
            torch.utils.checkpoint.checkpoint, block.forward, use_reentrant=False
        )
    broken(x).sum().backward()
    assert int(broken[0][1].num_batches_tracked) == 2
    assert int(checkpointed[0][1].num_batches_tracked) == 1


@pytest.mark.slow
def test_compiled_checkpointed_blocks_match_compiled_blocks_and_count_statistics_once():
    """torch.compile accepts torchturbo's checkpoint regions (it refuses their eager context_fn):
    the same gradients and buffers as compiling without checkpointing, bit for bit."""
    torch.manual_seed(0)
    model = nn.Sequential(
        *[
            nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
            for _ in range(2)
        ]
    )
    x = torch.randn(8, 4, 8, 8)
    reference = copy.deepcopy(model)
    torch.compile(reference)(x).sum().backward()
    compiled = copy.deepcopy(model)
    assert apply_activation_checkpointing(compiled, CheckpointConfig(mode="full")).applied
    torch.compile(compiled)(x).sum().backward()
    for want, got in zip(reference.parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=0)
    for want, got in zip(reference.buffers(), compiled.buffers(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert int(compiled[0][1].num_batches_tracked) == 1


class _Active:
    """Python state a forward sets and resets around its work, as transformers >= 5.25 does in
    every attention forward when Hugging Face's ``kernels`` is installed: its first set under
    compile also flips a flag for good (``CompileableContextVar.uses_global_var``), a change
    the checkpoint region does not undo."""

    def __init__(self) -> None:
        self.value: object = None
        self.compiled = False

    def set(self, value: object) -> object:
        before, self.value = self.value, value
        if torch.compiler.is_compiling():
            self.compiled = True
        return before


_ACTIVE = _Active()


class _SetsStateBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        before = _ACTIVE.set({"block": id(self)})
        try:
            return torch.relu(self.linear(x))
        finally:
            _ACTIVE.set(before)


class _TwoSetsStateBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_SetsStateBlock(), _SetsStateBlock()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _graph_breaks_and_grads(model: nn.Module, x: torch.Tensor) -> tuple[int, list[torch.Tensor]]:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model(x).square().mean().backward()
    return sum(counters["graph_break"].values()), [p.grad for p in model.parameters()]


@pytest.mark.slow
@pytest.mark.parametrize("scope", ["model", "blocks"])
def test_compile_traces_a_checkpointed_block_that_sets_python_state(scope):
    """Compiled in name only before: dynamo refused the checkpoint region (it mutates state
    outside it) and ran the block eager. Now no graph break, and eager checkpointing's
    gradients."""
    from torch._dynamo import config as dynamo_config

    _ACTIVE.compiled = False  # as in a fresh process
    torch.manual_seed(0)
    model = _TwoSetsStateBlocks()
    x = torch.randn(4, 8)
    eager = copy.deepcopy(model)
    blocks = ("layers.0", "layers.1")
    apply_activation_checkpointing(eager, CheckpointConfig(mode="selective", blocks=blocks))
    _, want = _graph_breaks_and_grads(eager, x)

    # Negative control: torch.compile of the checkpointed blocks as dynamo leaves it.
    with dynamo_config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=False):
        breaks, _ = _graph_breaks_and_grads(torch.compile(copy.deepcopy(eager)), x)
    assert breaks > 0

    turbo = Turbo(
        TurboConfig(device="cpu").replace(
            checkpointing__mode="selective",
            checkpointing__blocks=blocks,
            compile__mode="default",
            compile__scope=scope,
        )
    )
    compiled, _, _ = turbo.setup(copy.deepcopy(model), torch.optim.SGD(model.parameters()))
    breaks, got = _graph_breaks_and_grads(compiled, x)
    assert breaks == 0
    assert turbo.applied["compile" if scope == "model" else "regional_compile"] is None
    for want_grad, got_grad in zip(want, got, strict=True):
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-6)
