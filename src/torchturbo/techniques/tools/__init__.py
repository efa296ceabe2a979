"""Techniques that are not registered: a command, the engine or the user calls them directly.

Exact gradient accumulation (the engine's step), the chunked linear cross-entropy and the
packing isolation check (the mechanics of the ``chunked_loss`` and ``packing`` techniques),
TensorCore alignment, BatchNorm folding and ``torch.export`` for inference, and a buffer pool.
None of them changes a training run's composition, so none has a place in the registry's order.
"""
