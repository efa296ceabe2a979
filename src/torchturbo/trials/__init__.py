"""Configurations measured on a recipe, above the engine that trains them.

- ``trial.py``: :class:`Trial`, one configuration training a fresh model on the batches its
  config's batch plan draws (``data/batch_plan.py``), as training would;
- ``variants.py``: :func:`compare_configs`, configurations timed side by side, interleaved;
- ``memory_estimate.py``: what one fp32 eager step's memory is made of, per part and per block.

The tuner, the doctor, ``bench`` and the benchmarks measure through here.
"""
