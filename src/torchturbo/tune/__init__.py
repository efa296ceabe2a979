"""The tuner: stage by stage, measure candidates against the current best on the user's recipe and
keep what makes the whole job faster (``search``), then write the report (``report``).

:func:`tune_loader`, the data stage's grid search of loader settings, is public: it also tunes a
loader on its own, on any dataset. So is :func:`find_batch` (``tune --find-batch``): the largest
micro-batch of a recipe that fits a memory budget, agreed across ranks.
"""

from torchturbo import lazy_exports

_EXPORTS = {
    "LoaderTrial": "torchturbo.tune.loader_search",
    "LoaderTuning": "torchturbo.tune.loader_search",
    "tune_loader": "torchturbo.tune.loader_search",
    "BatchPlan": "torchturbo.tune.batch_size",
    "find_batch": "torchturbo.tune.batch_probe",
}

__all__ = ["BatchPlan", "LoaderTrial", "LoaderTuning", "find_batch", "tune_loader"]

__getattr__ = lazy_exports(__name__, _EXPORTS)
