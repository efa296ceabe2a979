"""Tests of the measurement layer: timing order and statistics, FLOP counts, peak and MFU,
activation bytes with and without checkpointing, peak memory, and the phase split."""

from __future__ import annotations

import dataclasses
import functools
import time
import types
import weakref

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from torchturbo.measure import (
    CHECKPOINT_MARKER,
    NullRecorder,
    PhaseRecorder,
    Timing,
    activation_bytes,
    breakdown,
    count_forward_flops,
    count_step_flops,
    dtype_for_precision,
    measure_interleaved,
    measured_peak_flops,
    memory,
    mfu,
    noise_band,
    paired,
    paired_noise,
    ratio,
    time_once,
    timing,
    track_peak_memory,
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class FakeClock:
    """A perf_counter that only moves when a variant says so: exact, load-independent timings."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


# --- timing -------------------------------------------------------------------------------------


def test_interleaving_alternates_rotates_and_syncs_around_each_block(monkeypatch):
    log: list[str] = []
    monkeypatch.setattr(timing, "sync", lambda device: log.append("sync"))
    variants = {name: functools.partial(log.append, name) for name in "abc"}

    measure_interleaved(variants, device="cpu", warmup=1, repeats=4, steps_per_repeat=2)

    def block(name: str) -> list[str]:
        return ["sync", name, name, "sync"]

    expected = ["a", "b", "c"]  # warm-up: every variant, untimed, no sync needed
    for first in "abca":  # round r starts at variant r mod 3
        order = "abc"[("abc".index(first)) :] + "abc"[: "abc".index(first)]
        for name in order:
            expected += block(name)
    assert log == expected


def test_samples_are_per_step_seconds(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))

    def step(seconds: float) -> None:
        clock.now += seconds

    result = measure_interleaved(
        {"fast": functools.partial(step, 1.0), "slow": functools.partial(step, 3.0)},
        device="cpu",
        warmup=2,
        repeats=3,
        steps_per_repeat=4,
    )
    # Each block runs 4 steps; a sample is the block divided by 4, and warm-up is not timed.
    assert result["fast"].samples == [1.0, 1.0, 1.0]
    assert result["slow"].samples == [3.0, 3.0, 3.0]
    assert ratio(result["fast"], result["slow"]) == 3.0
    assert ratio(result["slow"], result["fast"]) == pytest.approx(1 / 3)


class _LoadedMachine:
    """A virtual clock on which a step costs ``cost`` seconds times the load of the moment: the
    load is 1 for ``calm`` seconds, then 4 for as long, and so on (other jobs coming and going)."""

    def __init__(self, calm: float) -> None:
        self.now = 0.0
        self.calm = calm

    def clock(self) -> float:
        return self.now

    def step(self, cost: float):
        def run() -> None:
            load = 1.0 if int(self.now / self.calm) % 2 == 0 else 4.0
            self.now += cost * load

        return run


@pytest.mark.parametrize("block", [8, 1])
def test_blocks_taking_turns_within_a_round_cancel_a_busy_spell(block):
    """An A/A comparison of 8-step rounds on a machine whose load swings every 30 calm steps:
    timed as one block per side, a round's ratio is off by up to 4x; cut into blocks of one step
    that take turns, every round's ratio is near 1. The first case is the control: it must swing."""
    machine = _LoadedMachine(calm=30.0)
    rounds = paired.paired_rounds(
        paired.Side(machine.step(1.0)),
        paired.Side(machine.step(1.0)),
        device="cpu",
        steps_per_round=8,
        max_rounds=10,
        stop=lambda rounds: False,
        steps_per_block=block,
        clock=machine.clock,
    )
    worst = max(max(r.ratio, 1 / r.ratio) for r in rounds)
    if block == 8:
        assert worst > 2.5
    else:
        assert worst < 1.1


def test_interleaved_round_runs_blocks_in_turn_and_times_each_side():
    calls: list[str] = []
    now = [0.0]

    def step(name: str, cost: float):
        def run() -> None:
            calls.append(name)
            now[0] += cost

        return run

    seconds = paired.interleaved_round(
        [step("a", 1.0), step("b", 3.0)], 5, 2, torch.device("cpu"), lambda: now[0]
    )
    assert calls == ["a", "a", "b", "b", "a", "a", "b", "b", "a", "b"]
    assert seconds == pytest.approx([1.0, 3.0])
    with pytest.raises(ValueError, match="steps_per_block"):
        paired.interleaved_round([step("a", 1.0)], 2, 0, torch.device("cpu"), lambda: now[0])


def test_timing_statistics_on_injected_samples():
    odd = Timing([4.0, 1.0, 100.0, 3.0, 2.0])
    assert (odd.median, odd.min) == (3.0, 1.0)
    # Inclusive quartiles of 1,2,3,4,100 are 2 and 4: the outlier 100 does not move the spread.
    assert odd.spread == pytest.approx((4.0 - 2.0) / 3.0)
    even = Timing([1.0, 2.0, 3.0, 4.0])
    assert even.median == 2.5
    assert even.spread == pytest.approx((3.25 - 1.75) / 2.5)
    assert Timing([0.5]).spread == 0.0
    assert dataclasses.asdict(odd)["median"] == 3.0  # derived fields travel to JSON
    with pytest.raises(ValueError, match="at least one sample"):
        Timing([])


def test_noise_band_is_the_largest_relative_iqr():
    quiet, noisy = Timing([1.0, 1.0, 1.0, 1.0, 1.0]), Timing([1.0, 2.0, 3.0, 4.0, 5.0])
    assert noise_band({"quiet": quiet, "noisy": noisy}) == pytest.approx(2.0 / 3.0)
    assert noise_band([quiet]) == 0.0
    with pytest.raises(ValueError):
        noise_band({})


def test_paired_noise_cancels_batch_cost_that_both_variants_share():
    # Rounds alternate cheap and costly batches; the candidate is 1.25x faster on every one.
    best = Timing([1.0, 3.0, 1.0, 3.0, 1.0, 3.0, 2.0])
    candidate = Timing([s / 1.25 for s in best.samples])
    assert noise_band([best, candidate]) > 0.5  # per-variant spread: the batches, not noise
    assert paired_noise(candidate, best) == pytest.approx(0.0, abs=1e-12)
    jitter = [1, 1.1, 0.9, 1, 1.2, 1, 0.8]
    jittered = Timing([s * f for s, f in zip(candidate.samples, jitter, strict=True)])
    assert 0.05 < paired_noise(jittered, best) < 0.5
    with pytest.raises(ValueError, match="one sample per round"):
        paired_noise(Timing([1.0]), best)


@pytest.mark.parametrize(
    ("argument", "value"), [("warmup", -1), ("repeats", 0), ("steps_per_repeat", 0)]
)
def test_measure_interleaved_rejects_bad_counts(argument, value):
    with pytest.raises(ValueError, match=argument):
        measure_interleaved({"a": lambda: None}, device="cpu", **{argument: value})


def test_time_once_measures_one_call():
    assert 0.02 <= time_once(lambda: time.sleep(0.02), "cpu") < 2.0


# --- FLOPs --------------------------------------------------------------------------------------


def matmul_flops(batch: int, fan_in: int, fan_out: int) -> int:
    """A [batch, fan_in] x [fan_in, fan_out] product: one multiply-add (2 FLOPs) per term."""
    return 2 * batch * fan_in * fan_out


def train_step(model: nn.Module, x: torch.Tensor):
    return lambda: model(x).sum().backward()


@pytest.mark.parametrize("bias", [False, True])
def test_linear_flops_are_exact(bias):
    model, x = nn.Linear(64, 32, bias=bias), torch.randn(16, 64)
    forward = matmul_flops(16, 64, 32)
    assert count_forward_flops(model, x) == forward
    # x needs no grad, so backward computes only grad_W = grad_out^T @ x: one more matmul of the
    # same size. The bias add and its gradient (a sum) count 0 FLOPs in FlopCounterMode.
    assert count_step_flops(train_step(model, x)) == 2 * forward
    # Negative control: once the input needs a gradient, backward also computes grad_x.
    x_grad = torch.randn(16, 64, requires_grad=True)
    assert count_step_flops(train_step(model, x_grad)) == 3 * forward


def test_mlp_flops_are_exact():
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    x = torch.randn(16, 64)
    first, second = matmul_flops(16, 64, 128), matmul_flops(16, 128, 10)
    assert count_forward_flops(model, x) == first + second
    # Backward: the first layer gets only its weight gradient (its input needs none); the second
    # gets weight and input gradients. ReLU counts 0.
    assert count_step_flops(train_step(model, x)) == (first + second) + first + 2 * second


def test_conv_flops_are_exact():
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3, padding=1))
    x = torch.randn(2, 3, 8, 8)
    # Per output element: c_in * k * k multiply-adds; 2 * 8 * 8 output positions per channel.
    first, second = 2 * (2 * 8 * 8) * 8 * (3 * 3 * 3), 2 * (2 * 8 * 8) * 4 * (8 * 3 * 3)
    assert count_forward_flops(model, x) == first + second
    assert count_step_flops(train_step(model, x)) == 2 * first + 3 * second


# --- peak and MFU -------------------------------------------------------------------------------


def test_peak_is_measured_once_and_cached():
    first = measured_peak_flops("cpu", torch.float32)
    begin = time.perf_counter()
    second = measured_peak_flops(torch.device("cpu"), torch.float32)
    assert time.perf_counter() - begin < 0.01
    assert second == first > 1e8  # any CPU that runs this test multiplies faster than 0.1 GFLOP/s


def test_mfu_of_a_real_conv_step_is_a_fraction_of_the_measured_peak():
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 4),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 4, (8,))

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    flops = count_step_flops(step)
    seconds = measure_interleaved({"step": step}, device="cpu", repeats=5)["step"].median
    utilisation = mfu(flops, seconds, measured_peak_flops("cpu", torch.float32))
    assert utilisation is not None
    assert 0 < utilisation <= 1


def test_mfu_is_undefined_without_flops_and_not_clamped():
    assert mfu(0, 1.0, 1e9) is None
    assert mfu(10, 0.0, 1e9) is None
    assert mfu(20, 1.0, 10.0) == 2.0  # above 1 is reported, not hidden
    with pytest.raises(ValueError, match="step_seconds"):
        mfu(10, -1.0, 1e9)


def test_dtype_for_precision():
    assert dtype_for_precision("fp32") is torch.float32
    assert dtype_for_precision("tf32") is torch.float32
    assert dtype_for_precision("bf16") is torch.bfloat16
    assert dtype_for_precision("fp16") is torch.float16
    with pytest.raises(ValueError, match=r"'fp8'.*fp32, tf32, bf16, fp16"):
        dtype_for_precision("fp8")


# --- activation bytes ---------------------------------------------------------------------------

B, D, N = 8, 16, 3
ROW_BYTES = B * D * 4  # one [B, D] float32 activation


def mlp_blocks() -> nn.Sequential:
    return nn.Sequential(
        *[
            nn.Sequential(nn.Linear(D, 4 * D), nn.ReLU(), nn.Linear(4 * D, D), nn.ReLU())
            for _ in range(N)
        ]
    )


def checkpoint_each(blocks: nn.Module, *, mark: bool = True) -> None:
    """Checkpoint every block the way the checkpointing technique does, marker included."""
    for block in blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
        if mark:
            setattr(block, CHECKPOINT_MARKER, True)


def test_activation_bytes_counts_what_backward_holds():
    model, x = mlp_blocks(), torch.randn(B, D)
    # Per block: the input (saved by the first Linear for its weight gradient), the [B, 4D]
    # ReLU output (saved by ReLU and the second Linear: one storage) and the [B, D] ReLU output,
    # which is the next block's input. Plus x itself. Weights are excluded.
    expected = ROW_BYTES * (1 + N * (4 + 1))
    assert activation_bytes(lambda: model(x).sum(), model=model) == expected
    assert activation_bytes(lambda: model(x).sum(), exclude=model.parameters()) == expected
    # Negative control: without exclusion the saved (transposed) weights count too; the first
    # Linear's weight is not saved, because its input x needs no gradient.
    weights = [m.weight for m in model.modules() if isinstance(m, nn.Linear)][1:]
    with_weights = expected + sum(w.nbytes for w in weights)
    assert activation_bytes(lambda: model(x).sum()) == with_weights


def test_activation_bytes_with_checkpointing_keeps_only_block_inputs():
    model, x = mlp_blocks(), torch.randn(B, D)
    full = activation_bytes(lambda: model(x).sum(), model=model)
    checkpoint_each(model)
    # Only each block's input is held (x and the outputs of blocks 0..N-2); the last output is
    # not saved by `sum`.
    held = activation_bytes(lambda: model(x).sum(), model=model)
    assert held == N * ROW_BYTES
    assert full / held > 5


class ShiftBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor, *, shift: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.down(torch.relu(self.up(x))) + shift)


class ShiftNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ShiftBlock() for _ in range(N))

    def forward(self, x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, shift=shift)
        return x


@pytest.mark.parametrize("mark", [True, False])
def test_checkpointed_kwargs_are_counted_through_the_marker(mark):
    # Non-reentrant checkpoint keeps keyword inputs alive in a closure, where no saved-tensor hook
    # sees them; only the pre-hooks on marked modules count them (`shift`, one [B, D] tensor
    # shared by every block). Unmarked is the negative control: the count misses `shift`.
    model, x, shift = ShiftNet(), torch.randn(B, D), torch.randn(B, D)
    checkpoint_each(model.blocks, mark=mark)
    held = activation_bytes(lambda: model(x, shift).sum(), model=model)
    assert held == N * ROW_BYTES + (ROW_BYTES if mark else 0)


def test_activation_bytes_releases_the_graph():
    model, x = mlp_blocks(), torch.randn(B, D)
    outputs = []

    def forward() -> torch.Tensor:
        out = model(x)
        outputs.append(weakref.ref(out))
        return out.sum()

    activation_bytes(forward, model=model)
    assert outputs[0]() is None  # no reference cycle keeps the saved output (and graph) alive


# --- peak memory --------------------------------------------------------------------------------

ALLOCATION = 64 * 2**20


def allocate_and_free() -> None:
    block = torch.ones(ALLOCATION // 4)  # ones, not empty: pages must be touched to be resident
    time.sleep(0.05)  # long enough for the sampling fallback to see it
    del block


@pytest.mark.skipif(not memory._reset_hwm(), reason="needs a resettable VmHWM (Linux)")
def test_rss_high_water_mark_sees_a_freed_allocation_and_resets():
    with track_peak_memory("cpu") as peak:
        allocate_and_free()
    assert peak.kind == "cpu_rss_hwm"
    assert peak.peak_bytes - peak.baseline_bytes >= 0.9 * ALLOCATION
    # The mark was reset at entry: a block that allocates nothing does not inherit the peak.
    with track_peak_memory("cpu") as idle:
        pass
    assert idle.peak_bytes - idle.baseline_bytes < 0.5 * ALLOCATION


def test_sampled_rss_fallback_when_hwm_cannot_be_reset(monkeypatch):
    monkeypatch.setattr(memory, "_reset_hwm", lambda: False)
    with track_peak_memory("cpu") as peak:
        allocate_and_free()
    assert peak.kind == "cpu_rss_sampled"
    assert peak.peak_bytes - peak.baseline_bytes >= 0.9 * ALLOCATION


@pytest.mark.cuda
@needs_cuda
def test_cuda_allocator_peak():
    with track_peak_memory("cuda") as peak:
        block = torch.ones(ALLOCATION // 4, device="cuda")
        del block
    assert peak.kind == "cuda_allocator"
    assert peak.peak_bytes - peak.baseline_bytes >= ALLOCATION


@pytest.mark.cuda
@needs_cuda
def test_cuda_peak_and_timing_sync():
    assert measured_peak_flops("cuda", torch.bfloat16) > 1e12
    a = torch.randn(4096, 4096, device="cuda")
    # Without the sync in time_once this would read only the launch time (microseconds).
    assert time_once(lambda: [a @ a for _ in range(10)], "cuda") > 1e-4


# --- phase split --------------------------------------------------------------------------------


def test_phase_recorder_accumulates_per_name(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(breakdown, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    recorder = PhaseRecorder("cpu")
    for _ in range(2):
        with recorder.phase("forward"):
            clock.now += 1.0
        with recorder.phase("backward"):
            clock.now += 2.0
    assert recorder.totals() == {"forward": 2.0, "backward": 4.0}
    assert recorder.counts() == {"forward": 2, "backward": 2}
    recorder.reset()
    assert recorder.totals() == {}


def test_phase_recorder_rejects_unknown_and_nested_phases():
    recorder = PhaseRecorder("cpu")
    with pytest.raises(ValueError, match=r"'forwrd'.*input_wait, forward"):
        recorder.phase("forwrd").__enter__()
    with recorder.phase("backward"), pytest.raises(RuntimeError, match="is open"):
        recorder.phase("optimizer").__enter__()


def test_null_recorder_runs_the_block_and_records_nothing():
    recorder, ran = NullRecorder(), []
    with recorder.phase("forward"):
        ran.append(True)
    assert ran == [True]
    assert recorder.totals() == {}
    recorder.reset()
    with pytest.raises(ValueError):
        recorder.phase("forwrd")
