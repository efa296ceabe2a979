"""The Python that README.md and the tuner's report tell users to write, run as written on
variable-length data (the text workload: dict samples of long-tailed lengths)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

import torchturbo
from torchturbo.tune.report.document import usage_snippet
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
    config = torchturbo.TurboConfig(device="cpu").replace(data__batches="buckets")
    for snippet in _readme_snippets():
        namespace = _namespace(tmp_path, config, monkeypatch)
        if "lengths=" in snippet:
            exec(compile(snippet, "README.md", "exec"), namespace)
            continue
        with pytest.raises(
            ValueError, match=r"needs per-sample lengths: pass setup\(\.\.\., lengths="
        ):
            exec(compile(snippet, "README.md", "exec"), namespace)


def _causal_lm_namespace(tmp_path: Path, config: torchturbo.TurboConfig, monkeypatch) -> dict:
    """The snippet's names for a causal LM a packed plan can train (tests/recipes)."""
    sys.path.insert(0, str(Path(__file__).parent / "recipes"))
    import hf_causal_lm

    model = hf_causal_lm.model()
    model.config.use_cache = False  # as the Trainer sets it: a cache would let documents meet
    documents = hf_causal_lm.documents()
    (tmp_path / "turbo.toml").write_text(config.to_toml())
    monkeypatch.chdir(tmp_path)
    return {
        "model": model,
        "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-3),
        "dataset": documents,
        "loss_fn": lambda m, batch: m(**batch).loss,
        "lengths": [len(d["input_ids"]) for d in documents],
    }


@pytest.mark.parametrize("plan", ["rows", "buckets", "packed"])
def test_the_report_snippet_runs_as_written_for_every_batch_plan(tmp_path, monkeypatch, plan):
    """The report's setup snippet passes what the adopted plan needs (lengths for buckets and
    packed rows): when packing won, the snippet it printed used to raise."""
    config = torchturbo.TurboConfig(device="cpu").replace(data__batches=plan)
    name = {"rows": "bf16", "buckets": "length buckets", "packed": "packing"}[plan]
    results = {
        "adopted": [name],
        "candidates": [{"name": name, "verdict": "adopted", "config": config.to_dict()}],
        "fingerprint": {"batch_size": 4},
    }
    snippet = usage_snippet(results)
    assert ("lengths=lengths" in snippet) == (plan != "rows")
    build = _causal_lm_namespace if plan == "packed" else _namespace
    namespace = build(tmp_path, config, monkeypatch)
    exec(compile(snippet, "report.md", "exec"), namespace)
    assert torch.isfinite(namespace["metrics"].loss)


# --- the README's three ways in: each recipe file, run through the CLI as a user would -----

#: What each recipe snippet imports from "my_training", written as a user's module would be.
_MY_TRAINING = {
    "Recipe(": """
import torch
from torch import nn


class MyModel(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, width, 3, padding=1)
        self.head = nn.Linear(width, 2)

    def forward(self, x):
        return self.head(self.conv(x).mean(dim=(2, 3)))


class MyDataset(torch.utils.data.Dataset):
    def __init__(self, root: str) -> None:
        self.images = torch.randn(128, 3, 8, 8, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i):
        return self.images[i], int(self.images[i, 0].mean() > 0)
""",
    "recipe_from_trainer": """
import torch
from transformers import BertConfig, BertForTokenClassification, Trainer, TrainingArguments


def make_trainer():
    ids = torch.randint(1, 64, (32, 12), generator=torch.Generator().manual_seed(0))
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=64, num_labels=4)
    args = TrainingArguments(output_dir="out", per_device_train_batch_size=8, max_steps=4,
                             report_to="none", save_strategy="no", use_cpu=True)
    samples = [{"input_ids": row, "labels": row % 4} for row in ids]
    return Trainer(model=BertForTokenClassification(config), args=args, train_dataset=samples)
""",
    "recipe_from_lightning": """
import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class MyModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(),
                                 nn.Linear(8 * 8 * 8, 2))

    def training_step(self, batch, batch_idx):
        images, labels = batch
        return F.cross_entropy(self.net(images), labels)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class MyDataModule(L.LightningDataModule):
    def train_dataloader(self):
        images = torch.randn(64, 3, 8, 8, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(images, (images[:, 0].mean((1, 2)) > 0).long()),
                          batch_size=8)
""",
}


def _recipe_snippets() -> dict[str, str]:
    blocks = re.findall(r"```python\n(# my_recipe\.py.*?)```", README.read_text(), re.DOTALL)
    return {next(k for k in _MY_TRAINING if k in block): block for block in blocks}


def test_the_readme_shows_the_three_ways_in():
    assert set(_recipe_snippets()) == set(_MY_TRAINING)
    first_screen = README.read_text().split("## What it is")[0]
    for way in ("Recipe(", "recipe_from_trainer", "recipe_from_lightning", "git clone"):
        assert way in first_screen
    assert (
        "docs/integrations.md" in first_screen and "docs/tuner.md#writing-a-recipe" in first_screen
    )


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning")
@pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)`:FutureWarning")
@pytest.mark.parametrize("way", list(_MY_TRAINING))
def test_each_readme_recipe_trains_through_the_command_line(way, tmp_path, monkeypatch, capsys):
    from torchturbo.cli import main

    pytest.importorskip("transformers" if way == "recipe_from_trainer" else "torch")
    pytest.importorskip("lightning" if way == "recipe_from_lightning" else "torch")
    (tmp_path / "my_training.py").write_text(_MY_TRAINING[way])
    (tmp_path / "my_recipe.py").write_text(_recipe_snippets()[way])
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # undone after the test: the recipe adds it too
    monkeypatch.delitem(sys.modules, "my_training", raising=False)
    assert main(["train", "my_recipe.py:recipe", "--device", "cpu", "--steps", "2"]) == 0
    assert "trained to optimizer step 2" in capsys.readouterr().out
    sys.modules.pop("my_training", None)


def test_the_readme_library_snippet_runs_on_a_model():
    import textwrap

    from torchturbo.workloads import get_workload

    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    (snippet,) = [textwrap.dedent(b) for b in blocks if "apply_channels_last(model)" in b]
    model = get_workload("vision", batch_size=4).build()[0]
    exec(compile(snippet, "README.md", "exec"), {"model": model})
    conv = next(m for m in model.modules() if isinstance(m, torch.nn.Conv2d))
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
