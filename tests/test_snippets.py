"""The Python that README.md and the tuner's report tell users to write, run as written on
variable-length data (the text workload: dict samples of long-tailed lengths)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import torchturbo
from torchturbo.tune.document import usage_snippet
from torchturbo.workloads import get_workload

README = Path(__file__).parents[1] / "README.md"


def _namespace(tmp_path: Path, config: torchturbo.TurboConfig, monkeypatch) -> dict:
    """What the snippets assume exists: model, optimizer, dataset, loss_fn, lengths, and a
    turbo.toml in the working directory."""
    recipe = get_workload("text", num_samples=96, d_model=64, num_layers=1)
    model, optimizer = recipe.build()
    (tmp_path / "turbo.toml").write_text(config.to_toml())
    monkeypatch.chdir(tmp_path)
    return {
        "model": model,
        "optimizer": optimizer,
        "dataset": recipe.dataset,
        "loss_fn": recipe.loss_fn,
        "lengths": recipe.lengths,
    }


def _readme_snippets() -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    return [block for block in blocks if "turbo.setup(" in block]


def test_the_readme_has_a_setup_snippet():
    assert _readme_snippets()


def test_the_readme_snippet_runs_on_variable_length_data(tmp_path, monkeypatch):
    config = torchturbo.TurboConfig(device="cpu")
    for snippet in _readme_snippets():
        namespace = _namespace(tmp_path, config, monkeypatch)
        exec(compile(snippet, "README.md", "exec"), namespace)
        assert torch.isfinite(namespace["metrics"].loss)


def test_with_length_buckets_the_readme_snippet_asks_for_the_lengths(tmp_path, monkeypatch):
    config = torchturbo.TurboConfig(device="cpu").replace(data__bucketing=True)
    for snippet in _readme_snippets():
        namespace = _namespace(tmp_path, config, monkeypatch)
        if "lengths=" in snippet:
            exec(compile(snippet, "README.md", "exec"), namespace)
            continue
        with pytest.raises(
            ValueError, match=r"needs per-sample lengths: pass setup\(\.\.\., lengths="
        ):
            exec(compile(snippet, "README.md", "exec"), namespace)


@pytest.mark.parametrize("bucketing", [False, True])
def test_the_report_snippet_runs_as_written(tmp_path, monkeypatch, bucketing):
    config = torchturbo.TurboConfig(device="cpu").replace(data__bucketing=bucketing)
    results = {
        "adopted": ["length buckets"] if bucketing else [],
        "candidates": [
            {"name": "length buckets", "verdict": "adopted", "config": config.to_dict()}
        ],
        "fingerprint": {"batch_size": 16},
    }
    snippet = usage_snippet(results)
    assert ("lengths=lengths" in snippet) == bucketing
    namespace = _namespace(tmp_path, config, monkeypatch)
    exec(compile(snippet, "report.md", "exec"), namespace)
    assert torch.isfinite(namespace["metrics"].loss)
