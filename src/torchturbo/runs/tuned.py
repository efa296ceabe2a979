"""What tuning inside a run decided, kept as ``tune`` keeps it: ``results.json`` with the start
and every verdict, and ``turbo.toml``, the decided config, which the next run trains with as
it is (its ``[tune] in_run`` off: the measuring is done)."""

from __future__ import annotations

from pathlib import Path

from torchturbo.config import TurboConfig
from torchturbo.engine.in_run import InRunTuner
from torchturbo.output.results_file import write_atomic, write_results

RESULTS = "results.json"
CONFIG = "turbo.toml"


def write_decided(tuner: InRunTuner, directory: str | Path) -> Path:
    """Write ``results.json`` and ``turbo.toml`` into ``directory`` (made if missing);
    returns the config's path."""
    directory = Path(directory)
    decided: TurboConfig = tuner.config.replace(tune__in_run=False)
    write_results(directory / RESULTS, {**tuner.results(), "config": decided.to_dict()})
    path = directory / CONFIG
    write_atomic(path, decided.to_toml().encode())
    return path
