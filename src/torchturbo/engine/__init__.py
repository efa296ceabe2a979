"""The engine: :class:`Turbo` composes the configured techniques around a model, an optimizer
and data, and runs the training step (``turbo.py``).

What keeps a run alive and exact lives below it in :mod:`torchturbo.reliability` (out-of-memory
micro-batching, the non-finite guard, the resumable loader, preemption), and what a checkpoint
holds in :mod:`torchturbo.resume`; neither imports the engine, so this package may re-export it.
"""

from torchturbo.engine.turbo import LossFn, LossOutput, StepMetrics, Turbo, resolve_device

__all__ = ["LossFn", "LossOutput", "StepMetrics", "Turbo", "resolve_device"]
