"""The process's random state (torch CPU and CUDA, numpy, Python ``random``): captured with a
checkpoint and put back on resume, so that dropout and shuffles continue as if uninterrupted.

Everything is kept as tensors and plain data, so ``torch.load(weights_only=True)`` reads it.
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import numpy as np
import torch


def capture_random_state() -> dict[str, Any]:
    """This process's random state, as tensors (``torch``, ``cuda``, ``numpy_keys``) and plain
    data (``numpy``: the rest of numpy's state, ``python``)."""
    _, keys, *rest = np.random.get_state(legacy=True)
    version, internal, gauss_next = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy_keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
        "numpy": list(rest),
        "python": [version, list(internal), gauss_next],
    }


def restore_random_state(state: dict[str, Any]) -> None:
    """Put back what :func:`capture_random_state` returned (in this process or another)."""
    torch.set_rng_state(state["torch"])
    cuda = state["cuda"]
    if cuda and torch.cuda.is_available():
        if len(cuda) != torch.cuda.device_count():
            warnings.warn(
                f"the checkpoint holds CUDA RNG states of {len(cuda)} devices, this process "
                f"sees {torch.cuda.device_count()}: CUDA random numbers will differ",
                RuntimeWarning,
                stacklevel=3,
            )
        else:
            torch.cuda.set_rng_state_all(cuda)
    keys = state["numpy_keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, *state["numpy"]))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
