"""The data loader's settings, measured apart from the trials: the grid of worker counts, pinning
and prefetching (``grid``, public as ``tune_loader``). The tuner's stage that decides whether the
grid is worth its time is ``search.loader_stage``."""
