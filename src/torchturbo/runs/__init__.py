"""A training run of a recipe, as ``torchturbo train`` and :func:`torchturbo.train` run it.

``train`` is the checkpointed loop, ``step_meter`` measures each optimizer step (throughput, MFU,
memory), ``metrics_log`` sends those metrics to the loggers and ``tracking`` to W&B or MLflow.
"""
