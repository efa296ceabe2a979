"""What a training step's memory is made of: the types of a memory estimate (``memory_estimate``).

A leaf module (it imports nothing of the project), so that the tuner's stage context can carry an
estimate to the memory planner without importing the estimator, which builds trials.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

#: Activation compression leaves saved tensors under this many bytes alone (its default).
COMPRESS_MIN_BYTES = 2**20


@dataclass(frozen=True)
class Line:
    """Bytes as ``fixed + per_sample * samples``, fitted from two slice sizes."""

    fixed: float
    per_sample: float

    def at(self, samples: float) -> int:
        return max(0, round(self.fixed + self.per_sample * samples))


@dataclass(frozen=True)
class BlockMemory:
    """What one block's forward leaves saved for backward.

    ``held``: every storage it is the first to save; ``freeable``: what checkpointing the block
    frees (saved by it alone and not one of its inputs, which checkpoint keeps);
    ``compressible``: each float32 non-leaf tensor it saves (which activation compression stores
    at half size once it has ``min_bytes``), as bytes per sample and whether checkpointing the
    block frees it. ``checkpointable``: a block ``find_blocks`` names (a repeated block),
    not a top-level module such as a stem or a head. ``forward_s``: its forward on the real
    batch, the cost of recomputing it (None where it was not timed).
    """

    name: str
    type_name: str
    checkpointable: bool
    held: Line
    freeable: Line
    compressible: tuple[tuple[float, bool], ...] = ()
    forward_s: float | None = None

    def compressible_at(
        self, samples: float, checkpointed: bool = False, min_bytes: int = COMPRESS_MIN_BYTES
    ) -> int:
        """Bytes activation compression would halve at ``samples`` per micro-batch (what a
        checkpointed block still saves, when ``checkpointed``)."""
        return round(
            sum(
                per_sample * samples
                for per_sample, frees in self.compressible
                if per_sample * samples >= min_bytes and not (checkpointed and frees)
            )
        )


@dataclass(frozen=True)
class TensorRecord:
    """One saved tensor as measured on the larger slice, and its bytes scaled to the batch."""

    block: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int


@dataclass(frozen=True)
class MemoryEstimate:
    """A step's footprint at ``batch_size`` samples, estimated from slices of ``slices``."""

    batch_size: int
    slices: tuple[int, int]
    weights_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    blocks: tuple[BlockMemory, ...]
    largest: tuple[TensorRecord, ...] = field(default_factory=tuple)

    @property
    def persistent_bytes(self) -> int:
        return self.weights_bytes + self.gradients_bytes + self.optimizer_bytes

    def activation_bytes(self, samples: float | None = None) -> int:
        """Bytes saved for backward at ``samples`` per micro-batch (default: the batch)."""
        n = self.batch_size if samples is None else samples
        return sum(block.held.at(n) for block in self.blocks)

    @property
    def total_bytes(self) -> int:
        return self.persistent_bytes + self.activation_bytes()

    def to_dict(self) -> dict[str, Any]:
        n = self.batch_size
        return {
            "batch_size": n,
            "slices": list(self.slices),
            "total_bytes": self.total_bytes,
            "weights_bytes": self.weights_bytes,
            "gradients_bytes": self.gradients_bytes,
            "optimizer_bytes": self.optimizer_bytes,
            "activation_bytes": self.activation_bytes(),
            "blocks": [
                {
                    "name": b.name,
                    "type": b.type_name,
                    "checkpointable": b.checkpointable,
                    "bytes": b.held.at(n),
                    "fixed_bytes": max(0, round(b.held.fixed)),
                    "freeable_bytes": b.freeable.at(n),
                    "compressible_bytes": b.compressible_at(n),
                    "forward_s": b.forward_s,
                }
                for b in self.blocks
            ],
            "largest": [
                {"block": t.block, "shape": list(t.shape), "dtype": t.dtype, "bytes": t.bytes}
                for t in self.largest
            ],
        }


def describe(estimate: MemoryEstimate, *, top: int = 8) -> Iterator[str]:
    """The estimate as lines of text: the split, the biggest blocks, the largest tensors."""
    n, small, mib = estimate.batch_size, estimate.slices[1], 2**20
    yield (
        f"memory estimate: {estimate.total_bytes / mib:.1f} MiB a step (fp32 eager, batch {n}, "
        f"from slices of {estimate.slices[0]} and {estimate.slices[1]})"
    )
    yield (
        f"  weights {estimate.weights_bytes / mib:.1f}, gradients "
        f"{estimate.gradients_bytes / mib:.1f}, optimizer state "
        f"{estimate.optimizer_bytes / mib:.1f}, activations "
        f"{estimate.activation_bytes() / mib:.1f} MiB"
    )
    rows = sorted(estimate.blocks, key=lambda b: -b.held.at(n))
    shown = [b for b in rows[:top] if b.held.at(n)]
    if shown:
        yield "  activations by block:"
    for block in shown:
        cost = "" if block.forward_s is None else f", forward {block.forward_s * 1e3:.1f} ms"
        yield f"    {block.name} ({block.type_name}): {block.held.at(n) / mib:.1f} MiB{cost}"
    if len(rows) > len(shown):
        rest = sum(b.held.at(n) for b in rows[len(shown) :])
        yield f"    {len(rows) - len(shown)} more: {rest / mib:.1f} MiB"
    if estimate.largest:
        yield "  largest saved tensors:"
    for tensor in estimate.largest:
        shape = "x".join(str(d) for d in tensor.shape)
        where = f"[{shape} at {small}] in {tensor.block}"
        yield f"    {tensor.bytes / mib:.1f} MiB {tensor.dtype} {where}"
