"""The tuner, in subpackages by job, lowest first: the batch finder (``batch``), the memory
planner (``memory``), the loader grid (``loader``), the search that measures candidates stage by
stage and keeps what makes the whole job faster (``search``), and the report (``report``).

:func:`tune` (with :class:`TuneOptions`) is the tuner as ``torchturbo tune`` runs it on a recipe.
:func:`tune_loader`, the data stage's grid search of loader settings, is public: it also tunes a
loader on its own, on any dataset. So is :func:`find_batch` (``tune --find-batch``): the largest
micro-batch of a recipe that fits a memory budget, agreed across ranks, as a
:class:`BatchChoice`.
"""

from torchturbo import lazy_exports

_EXPORTS = {
    "tune": "torchturbo.tune.search.run",
    "TuneOptions": "torchturbo.tune.search.state",
    "LoaderTrial": "torchturbo.tune.loader.grid",
    "LoaderTuning": "torchturbo.tune.loader.grid",
    "tune_loader": "torchturbo.tune.loader.grid",
    "BatchChoice": "torchturbo.tune.batch.choice",
    "find_batch": "torchturbo.tune.batch.probe",
}

__all__ = [
    "BatchChoice",
    "LoaderTrial",
    "LoaderTuning",
    "TuneOptions",
    "find_batch",
    "tune",
    "tune_loader",
]

__getattr__ = lazy_exports(__name__, _EXPORTS)
