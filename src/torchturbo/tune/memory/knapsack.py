"""Which blocks to checkpoint: the cheapest set of items whose savings reach a target.

A 0/1 knapsack turned around (minimize the recompute cost subject to freeing at least ``need``
bytes), solved exactly by dynamic programming over the Pareto front of (bytes saved, cost):
savings are capped at ``need``, so a state past the target is just "enough", and a state that
saves less for more cost than another is dropped. With the tens of blocks a model has, the front
stays small. Hand-written because it is a dozen lines, and scipy's ``milp`` would be a
dependency for them.
"""

from __future__ import annotations

from collections.abc import Sequence


def cheapest_cover(
    items: Sequence[tuple[float, int]], need: int
) -> tuple[tuple[int, ...], float] | None:
    """Indices of the ``(cost, saving)`` items with the least total cost whose savings sum to at
    least ``need``, and that cost; ``()`` when ``need <= 0``; None when all of them fall short.
    Among sets of equal cost, the one with fewer items wins."""
    if need <= 0:
        return (), 0.0
    # saved (capped at need) -> (cost, chosen indices)
    front: dict[int, tuple[float, tuple[int, ...]]] = {0: (0.0, ())}
    for index, (cost, saving) in enumerate(items):
        if saving <= 0:
            continue
        grown = dict(front)
        for saved, (spent, chosen) in front.items():
            reach = min(need, saved + saving)
            option = (spent + cost, (*chosen, index))
            if reach not in grown or _better(option, grown[reach]):
                grown[reach] = option
        front = _pareto(grown)
    if need not in front:
        return None
    cost, chosen = front[need]
    return chosen, cost


def _better(a: tuple[float, tuple[int, ...]], b: tuple[float, tuple[int, ...]]) -> bool:
    return (a[0], len(a[1])) < (b[0], len(b[1]))


def _pareto(
    states: dict[int, tuple[float, tuple[int, ...]]],
) -> dict[int, tuple[float, tuple[int, ...]]]:
    """Drop every state that another saves at least as much as, for no more cost."""
    kept: dict[int, tuple[float, tuple[int, ...]]] = {}
    best: tuple[float, tuple[int, ...]] | None = None
    for saved in sorted(states, reverse=True):
        state = states[saved]
        if best is None or _better(state, best):
            kept[saved] = state
            best = state
    return kept
