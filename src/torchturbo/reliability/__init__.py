"""What keeps a training run alive and exact, under the engine and the run checkpoints.

``oom`` splits a batch into micro-batches when it does not fit, ``guard`` skips non-finite steps
and refuses to save non-finite weights, ``epochs`` is the resumable loader, ``random_state``
captures and restores every generator, ``preemption`` turns a signal into a clean stop, and
``nested`` walks the tensors of a batch. These modules import neither :mod:`torchturbo.engine`
nor :mod:`torchturbo.resume`: both build on them.
"""
