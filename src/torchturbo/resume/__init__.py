"""Run checkpoints: saving a training run and resuming it exactly (not to be confused with
activation checkpointing, :mod:`torchturbo.techniques.checkpointing`).

``files`` writes and reads checkpoint directories atomically with checksums, ``state`` lays out
what a run's checkpoint holds and puts it back, ``checks`` refuses a checkpoint that does not fit
the run before anything is restored. The engine builds on this package, never the reverse: what
``state`` reads of a run is the :class:`~torchturbo.engine.state.Resumable` protocol.
"""
