"""The tuner: stage by stage, measure candidates against the current best on the user's recipe and
keep what makes the whole job faster (``search``), then write the report (``report``).

:func:`tune_loader`, the data stage's grid search of loader settings, is public: it also tunes a
loader on its own, on any dataset.
"""

from torchturbo.tune.loader_search import LoaderTrial, LoaderTuning, tune_loader

__all__ = ["LoaderTrial", "LoaderTuning", "tune_loader"]
