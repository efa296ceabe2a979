"""What each lever is expected to buy on this model and machine, before anything is trained.

The tuner measures candidates in order of expected gain per second of measuring, and the doctor
ranks the same levers by the same numbers (each technique names its levers: ``Technique.levers``,
ranked by ``techniques.registry.ranked_levers``), so the two never disagree about what to try
first. The expectations are priors built from facts measured in seconds (``framework.facts``): the
rate of a matrix product in each precision against fp32 on this device, the padding that length
buckets would remove, the share of the FLOPs in convolutions, whether batch shapes vary. They
order the work and explain it; only the tuner's paired measurement decides what is adopted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torchturbo.techniques.framework.facts import Facts

#: Share of a training step spent in dense maths (matmuls, convolutions) that a faster precision
#: speeds up, where it was not measured (``Facts.dense_share``); the rest (elementwise ops,
#: norms, the optimizer) is assumed unchanged. From the built-in workloads' profiles (55-75% on
#: CPU).
DENSE_SHARE = 0.6
#: Expected compile gains, from the built-in workloads on CPU (1.1-1.3x): less where shapes vary,
#: since every new shape recompiles or runs a dynamic-shape graph.
COMPILE_GAIN = 1.15
COMPILE_GAIN_VARYING_SHAPES = 1.05
#: channels_last gains up to this fraction on a model whose FLOPs are all in 2-D convolutions.
CHANNELS_LAST_GAIN = 0.25
#: The gain assumed for a lever with no better prior (DDP bucket sizes).
SMALL_GAIN = 1.03
#: Of a launch-bound step's idle device time, the share CUDA graphs leave: a replay launches a
#: step's kernels at once, but the host still runs the loader, the loss's Python and what the
#: graph does not hold. Published CUDA-graph gains on small models are 1.12-1.7x.
CUDA_GRAPH_RESIDUAL = 0.4
#: float8 Linear layers on top of bf16: fp8 GEMMs run ~2x bf16 on Hopper tensor cores, less end
#: to end (casts, the layers left in bf16); torchao reports 1.2-1.5x on large Transformers.
FLOAT8_GAIN = 1.2
#: How many times faster the optimizer step itself runs rebuilt, from benchmarks/fused_optimizer.py
#: on the 2-core CPU (Adam/AdamW: foreach 1.2-1.4x, fused 3.2-4.9x; SGD less).
OPTIMIZER_STEP_SPEEDUP = {"foreach": 1.3, "fused": 3.0}
#: torchao's low-bit optimizer steps over torch's AdamW (as built) on the 2-core CPU, a 4.5M
#: parameter Llama (benchmarks/optimizer_state.py, load 5-6): per-parameter compiled graphs
#: that (de)quantise run far slower than AdamW's loop there.
OPTIMIZER_STATE_CPU_SPEED = {"8bit": 0.13, "4bit": 0.08, "fp8": 0.2}
#: Bytes a fused AdamW step moves per parameter (read p, g, m, v; write p, m, v: 28) over what
#: the state's step moves (8-bit and fp8 moments: 16; 4-bit: 14): the most a bandwidth-bound
#: step could gain, not a measurement.
OPTIMIZER_STATE_BYTES_BOUND = {"8bit": 1.75, "fp8": 1.75, "4bit": 2.0}


@dataclass(frozen=True)
class Expectation:
    """A lever's expected speed-up, or why it cannot help here, with the fact behind either."""

    gain: float | None
    evidence: str

    @property
    def applicable(self) -> bool:
        return self.gain is not None


def precision(facts: Facts, dtype: str) -> Expectation:
    """bf16, fp16 or tf32: Amdahl's law over the measured GEMM speed-up of that precision."""
    if dtype in facts.emulated:
        return Expectation(None, f"{dtype} cannot pay off here: {facts.emulated[dtype]}")
    speedup = facts.gemm_speedup.get(dtype)
    if speedup is None:
        return Expectation(None, f"{dtype} matrix products were not measured on {facts.device}")
    dense = DENSE_SHARE if facts.dense_share is None else facts.dense_share
    gain = 1 / ((1 - dense) + dense / max(speedup, 1e-9))
    share = "" if facts.dense_share is None else f", and dense maths is ~{dense:.0%} of a step"
    return Expectation(
        gain,
        f"a {dtype} matrix product runs at {speedup:.2f}x the fp32 rate on {facts.device}{share}",
    )


def channels_last(facts: Facts) -> Expectation:
    if not facts.has_convolutions:
        return Expectation(None, "the model has no 2-D convolutions: channels_last changes nothing")
    gain = 1 + CHANNELS_LAST_GAIN * facts.conv_share
    return Expectation(gain, f"{facts.conv_share:.0%} of the forward FLOPs are 2-D convolutions")


def compile_(facts: Facts) -> Expectation:
    if facts.shapes_vary:
        return Expectation(
            COMPILE_GAIN_VARYING_SHAPES,
            "batch shapes vary: compiled graphs recompile or run with dynamic shapes",
        )
    return Expectation(COMPILE_GAIN, "fuses elementwise ops and removes Python overhead")


def cuda_graphs(facts: Facts) -> Expectation:
    """CUDA graphs (compile mode reduce-overhead): what they can buy is the device's idle time
    (``Facts.device_busy``), of which they remove all but :data:`CUDA_GRAPH_RESIDUAL`."""
    busy = facts.device_busy
    if busy is None:
        return Expectation(
            None, f"no device busy share measured on {facts.device}: CUDA graphs are a GPU's"
        )
    gain = 1 / (busy + CUDA_GRAPH_RESIDUAL * (1 - busy))
    shapes = "; batch shapes vary: a graph per shape" if facts.shapes_vary else ""
    return Expectation(
        gain, f"the device computes {busy:.0%} of a step: the rest is launch overhead{shapes}"
    )


def regional_compile(facts: Facts) -> Expectation:
    """Compiling each repeated block once: compile's gain where the blocks are the work."""
    if facts.block_leaf_modules is None:
        return Expectation(
            None,
            "the model repeats no block (no nn.ModuleList of two or more modules of one "
            "class): there is nothing to compile once and reuse",
        )
    whole = compile_(facts)
    return Expectation(
        whole.gain,
        f"one block of each kind traced ({facts.block_leaf_modules} of {facts.leaf_modules} "
        f"leaf modules), the other blocks reuse its code; {whole.evidence}",
    )


def length_buckets(facts: Facts) -> Expectation:
    if facts.padding is None:
        return Expectation(None, "the recipe gives no per-sample lengths")
    random, bucketed = facts.padding
    gain = (1 - bucketed) / (1 - random)
    return Expectation(
        gain,
        f"padding {random:.0%} in random batches, {bucketed:.0%} in length buckets: "
        f"{gain:.2f}x more real tokens per padded token",
    )


def comm_hook(facts: Facts, byte_ratio: float, name: str) -> Expectation:
    """A compressing DDP hook: the communication share shrinks by ``byte_ratio``."""
    if facts.comm_share is None:
        return Expectation(None, "single process: no gradient communication to compress")
    saved = facts.comm_share * (1 - byte_ratio)
    gain = 1 / (1 - min(saved, 0.9))
    return Expectation(
        gain,
        f"communication is {facts.comm_share:.0%} of the step; {name} sends "
        f"{byte_ratio:.0%} of the bytes",
    )


def bucket_size(facts: Facts) -> Expectation:
    if facts.comm_share is None:
        return Expectation(None, "single process: no DDP buckets")
    return Expectation(SMALL_GAIN, f"communication is {facts.comm_share:.0%} of the step")


def float8(facts: Facts) -> Expectation:
    """The prior where fp8 units exist (the float8 technique asks that first)."""
    return Expectation(FLOAT8_GAIN, "fp8 matmuls in the Linear layers, on top of bf16")


def optimizer(facts: Facts, implementation: str) -> Expectation:
    """foreach or fused: Amdahl's law over the optimizer's share of the step."""
    speedup = OPTIMIZER_STEP_SPEEDUP.get(implementation)
    if speedup is None or facts.optimizer_share is None:
        return Expectation(SMALL_GAIN, f"a {implementation} optimizer step")
    gain = 1 / (1 - facts.optimizer_share * (1 - 1 / speedup))
    return Expectation(
        gain,
        f"the optimizer step is {facts.optimizer_share:.0%} of a step; {implementation} runs it "
        f"~{speedup:g}x faster",
    )


def optimizer_state(facts: Facts, state: str) -> Expectation:
    """A torchao state's optimizer step. On a CPU it was measured slower than torch's AdamW
    (not applicable); on a GPU, Amdahl's law over the optimizer's share with the bytes the
    step moves as the bound (an AdamW step is memory-bound: unmeasured here, hence a bound)."""
    measured = OPTIMIZER_STATE_CPU_SPEED.get(state)
    if facts.device.startswith("cpu") and measured is not None:
        return Expectation(
            None,
            f"torchao's compiled {state} step ran at {measured:g}x torch's AdamW step on a "
            "2-core CPU (benchmarks/optimizer_state.py): a smaller state saves memory here, "
            "never time",
        )
    bound = OPTIMIZER_STATE_BYTES_BOUND.get(state)
    if bound is None or facts.optimizer_share is None:
        return Expectation(SMALL_GAIN, f"the optimizer's moments kept as {state}")
    gain = 1 / (1 - facts.optimizer_share * (1 - 1 / bound))
    return Expectation(
        gain,
        f"the optimizer step is {facts.optimizer_share:.0%} of a step; {state} moments move "
        f"1/{bound:g} of its bytes, an upper bound on its gain",
    )


def priority(gain: float | None, cost_s: float) -> float:
    """Expected gain per second of measuring: log-gain, so that gains compose by adding."""
    if gain is None or gain <= 1:
        return 0.0
    return math.log(gain) / max(cost_s, 1e-3)


@dataclass(frozen=True)
class RankedLever:
    name: str
    expectation: Expectation
