"""The largest micro-batch that fits a memory budget, and the plan that keeps the global batch.

Given ``fits(size) -> (fits, bytes)`` (one measured step's footprint at a micro-batch of
``size`` samples, agreed across ranks by the caller), :func:`largest_fit` finds the largest size
that fits with few measurements, among the sizes a recipe batch can be cut into
(:func:`micro_sizes`: a batch of 8 runs as pieces of 8, 4, 3, 2 or 1): the recipe's batch first
(it usually fits), then a micro-batch of 1 (if even that does not fit, nothing will), then the
size the straight line through the two predicts (a step's memory is a fixed part, weights,
gradients and optimizer state, plus activations that grow with the samples), checked by
measuring it and the size above it, and bisection where the line was wrong (allocator rounding,
workspaces). Each size is measured once.

:func:`plan` turns the fit into what training runs. Kept global batch (``keep``): each batch of
the recipe is cut into ``micro_batches`` pieces of at most the fit, accumulated exactly (count
weighting, ``techniques/tools/accumulation.py``), so micro x pieces x ranks is the recipe's batch x
ranks; a batch that does not divide keeps its samples in pieces that differ by one. ``max``: the
global batch may grow to the largest that fits, and the learning rate's relation is said, not
applied. Hand-written: Lightning's ``scale_batch_size`` and transformers'
``auto_find_batch_size`` search by running until out-of-memory, change the global batch, and do
not agree across DDP ranks.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from torchturbo.output.tables import format_bytes
from torchturbo.reliability.oom import MemoryBudgetError

BatchMode = Literal["keep", "max"]

#: One measurement: micro-batch size -> (fits on every rank, footprint in bytes or None).
Fits = Callable[[int], tuple[bool, int | None]]


@dataclass(frozen=True)
class Probe:
    """One measured micro-batch size."""

    size: int
    bytes: int | None
    fits: bool


@dataclass(frozen=True)
class Fit:
    """The largest size that fits (0: not even one sample), and every size measured."""

    size: int
    probes: tuple[Probe, ...]


def micro_sizes(recipe_batch: int) -> list[int]:
    """The micro-batch sizes a batch of ``recipe_batch`` can run as, ascending: the largest
    piece when it is cut into 1, 2, ... ``recipe_batch`` nearly equal pieces."""
    return sorted({math.ceil(recipe_batch / pieces) for pieces in range(1, recipe_batch + 1)})


def largest_fit(fits: Fits, sizes: Sequence[int], budget_bytes: int, *, start: int) -> Fit:
    """The largest of ``sizes`` (ascending) that ``fits``, measuring ``start`` first.

    Sizes above ``start`` (the ``max`` mode) are tried by doubling while they fit. ``fits``
    must be monotone (a larger micro-batch never needs less memory); ``budget_bytes`` is only
    used to predict where the line through two figures crosses it.
    """
    if not sizes or start not in sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
        raise ValueError(f"largest_fit needs ascending positive sizes holding {start}")
    measured: dict[int, Probe] = {}

    def probe(index: int) -> Probe:
        size = sizes[index]
        if size not in measured:
            ok, used = fits(size)
            measured[size] = Probe(size, used, ok)
        return measured[size]

    def at_most(size: float) -> int:
        return bisect.bisect_right(sizes, size) - 1

    def found(index: int | None) -> Fit:
        return Fit(0 if index is None else sizes[index], tuple(measured.values()))

    low = sizes.index(start)
    if probe(low).fits:
        top = len(sizes) - 1
        while low < top and probe(next_up := max(low + 1, at_most(2 * sizes[low]))).fits:
            low = next_up
        if low == top:
            return found(low)
        above = next_up
    elif low == 0 or not probe(0).fits:
        return found(None)
    else:
        low, above = 0, low
    guess = _on_the_line(measured[sizes[low]], measured[sizes[above]], budget_bytes)
    if guess is not None:
        # Check the line's answer and the size above it: two measurements when it is right.
        index = min(max(at_most(guess), low), above - 1)
        if index > low and not probe(index).fits:
            above = index
        else:
            low = index
            if low + 1 < above and not probe(low + 1).fits:
                above = low + 1
    while above - low > 1:
        middle = (low + above) // 2
        if probe(middle).fits:
            low = middle
        else:
            above = middle
    return found(low)


def _on_the_line(low: Probe, high: Probe, budget_bytes: int) -> int | None:
    """The largest size whose footprint, on the straight line through two measurements, is
    within the budget; None without both figures (a compiled model's CPU footprint) or when
    the line does not rise."""
    if low.bytes is None or high.bytes is None:
        return None
    per_sample = (high.bytes - low.bytes) / (high.size - low.size)
    if per_sample <= 0:
        return None
    return low.size + math.floor((budget_bytes - low.bytes) / per_sample)


@dataclass(frozen=True, kw_only=True)
class BatchChoice:
    """What the batch finder chose, and the sentences that say what is kept and what changes."""

    mode: BatchMode
    budget_bytes: int
    #: The recipe's batch per process, the processes, the batches the config already
    #: accumulates per optimizer step, and the largest micro-batch that fits.
    recipe_batch: int
    world_size: int
    accumulation_steps: int = 1
    fit: int
    #: What training runs: pieces per batch and the largest piece's samples (with ``max``, the
    #: grown batch, in one piece).
    micro_batches: int
    micro_batch: int
    #: Samples per optimizer step, all processes together: the user's and the plan's.
    global_batch: int
    planned_global_batch: int
    probes: tuple[Probe, ...]
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def micro_bytes(self) -> int | None:
        """The measured footprint of the chosen micro-batch (None where none was read)."""
        return next((p.bytes for p in self.probes if p.size == self.micro_batch), None)

    def summary(self) -> str:
        """One line for the headline: micro x pieces x accumulation x ranks = global batch."""
        larger, uneven = divmod(self.recipe_batch, self.micro_batches)
        if self.micro_batches == 1:
            line = f"micro-batch {self.micro_batch}, whole"
        elif uneven:
            line = (
                f"micro-batches {larger + 1} x {uneven} + {larger} x "
                f"{self.micro_batches - uneven} accumulated = batch {self.recipe_batch}"
            )
        else:
            line = f"micro-batch {larger} x {self.micro_batches} accumulated"
        if self.accumulation_steps > 1:
            line += f" x {self.accumulation_steps} batches"
        if self.world_size > 1:
            line += f" x {self.world_size} processes"
        kept = self.planned_global_batch == self.global_batch
        return (
            f"Batch for {format_bytes(self.budget_bytes)}: {line} = global batch "
            f"{self.planned_global_batch} ({'kept' if kept else f'was {self.global_batch}'}); "
            f"largest micro-batch that fits: {self.fit}"
        )

    def to_dict(self) -> dict[str, object]:
        return {
            "mode": self.mode,
            "budget_bytes": self.budget_bytes,
            "recipe_batch": self.recipe_batch,
            "world_size": self.world_size,
            "accumulation_steps": self.accumulation_steps,
            "fit": self.fit,
            "micro_batches": self.micro_batches,
            "micro_batch": self.micro_batch,
            "micro_bytes": self.micro_bytes,
            "global_batch": self.global_batch,
            "planned_global_batch": self.planned_global_batch,
            "probes": [{"size": p.size, "bytes": p.bytes, "fits": p.fits} for p in self.probes],
            "notes": list(self.notes),
            "summary": self.summary(),
        }


def plan(
    fits: Fits,
    *,
    recipe_batch: int,
    budget_bytes: int,
    world_size: int = 1,
    mode: BatchMode = "keep",
    grow: int = 16,
    optimizer: str = "",
    accumulation_steps: int = 1,
) -> BatchChoice:
    """Measure through ``fits`` and choose the micro-batch and accumulation (see the module).

    ``grow`` bounds how far ``max`` grows the batch (x the recipe's); ``optimizer`` is the
    optimizer's class name, which picks the learning-rate rule ``max`` notes;
    ``accumulation_steps`` are the batches per optimizer step the config already accumulates.
    """
    sizes = micro_sizes(recipe_batch)
    if mode == "max":
        sizes += list(range(recipe_batch + 1, recipe_batch * grow + 1))
    found = largest_fit(fits, sizes, budget_bytes, start=recipe_batch)
    if found.size == 0:
        raise MemoryBudgetError(_no_fit(found, recipe_batch, budget_bytes))
    per_step = world_size * accumulation_steps

    def chosen(pieces: int, micro: int, per_process: int, notes: tuple[str, ...]) -> BatchChoice:
        return BatchChoice(
            mode=mode,
            budget_bytes=budget_bytes,
            recipe_batch=recipe_batch,
            world_size=world_size,
            accumulation_steps=accumulation_steps,
            fit=found.size,
            micro_batches=pieces,
            micro_batch=micro,
            global_batch=recipe_batch * per_step,
            planned_global_batch=per_process * per_step,
            probes=found.probes,
            notes=notes,
        )

    if mode == "max" and found.size > recipe_batch:
        grown = _grown_notes(found.size, recipe_batch, per_step, optimizer)
        return chosen(1, found.size, found.size, grown)
    pieces = math.ceil(recipe_batch / found.size)
    micro = math.ceil(recipe_batch / pieces)
    return chosen(pieces, micro, recipe_batch, _kept_notes(recipe_batch, pieces, mode))


def _no_fit(found: Fit, recipe_batch: int, budget_bytes: int) -> str:
    one = next((p for p in found.probes if p.size == 1), None)
    needs = (
        f" needs {format_bytes(one.bytes)}" if one is not None and one.bytes else " does not fit"
    )
    what = (
        "the recipe's batch of 1 sample cannot be split, and it"
        if recipe_batch == 1
        else "a micro-batch of 1 sample"
    )
    return (
        f"--memory-budget {format_bytes(budget_bytes)} is below one sample: {what}{needs}; "
        "raise the budget, or lower the memory per sample (smaller samples or model; "
        "[checkpointing] mode = 'full' in the config measured, find_batch(config=...))"
    )


def _kept_notes(recipe_batch: int, pieces: int, mode: BatchMode) -> tuple[str, ...]:
    notes = []
    if mode == "max":
        notes.append(
            f"max: the recipe's batch of {recipe_batch} does not fit, so the global batch is "
            "kept by micro-batching rather than shrunk (the learning rate stays right)"
        )
    if pieces == 1:
        notes.append(f"the recipe's batch of {recipe_batch} fits: nothing to change")
        return tuple(notes)
    larger, uneven = divmod(recipe_batch, pieces)
    if uneven:
        notes.append(
            f"{recipe_batch} samples do not divide by {pieces}: each batch runs as {uneven} "
            f"micro-batch(es) of {larger + 1} and {pieces - uneven} of {larger}; the global "
            "batch and the gradient are kept (count-weighted accumulation), only the pieces' "
            "sizes differ"
        )
    notes.append(
        f"each batch of {recipe_batch} runs as {pieces} micro-batches, accumulated: "
        f"[accumulation] micro_batches = {pieces}"
    )
    return tuple(notes)


#: Optimizers whose step size does not scale with the gradient's size (Adam-style): the
#: square-root rule applies; SGD-style ones follow the linear rule.
_ADAPTIVE = ("Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adafactor", "RMSprop")


def _grown_notes(fit: int, recipe_batch: int, world_size: int, optimizer: str) -> tuple[str, ...]:
    ratio = fit / recipe_batch
    linear = f"linear rule (SGD-style): lr x {ratio:.3g}"
    root = f"square-root rule (Adam-style): lr x {math.sqrt(ratio):.3g}"
    if optimizer in _ADAPTIVE:
        rule = f"for {optimizer}, the {root}"
    elif optimizer == "SGD":
        rule = f"for SGD, the {linear}"
    else:
        rule = f"the {linear}; the {root}"
    return (
        f"max: the global batch grows from {recipe_batch * world_size} to {fit * world_size} "
        f"({ratio:.3g}x): set the recipe's batch_size = {fit} (turbo.toml has no batch size: "
        "the recipe's is yours)",
        f"learning rate, not applied: {rule}; warm it up over the first steps",
    )
