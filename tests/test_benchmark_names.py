"""A benchmark run as ``python benchmarks/NAME.py`` puts benchmarks/ first on ``sys.path``, so
a file there named like a package the trainers probe for shadows it: transformers 5.25 found
``benchmarks/kernels.py`` where it looks for Hugging Face's ``kernels`` package and every
benchmark that builds a Llama failed at import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"

# What the benchmarks import from the trainers: their optional-package probes run at import.
IMPORTS = """
import sys
sys.path.insert(0, sys.argv[1])
from transformers import LlamaConfig, LlamaForCausalLM, Trainer
import lightning
LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, vocab_size=32))
"""


def _imports_with_first_on_path(folder: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-c", IMPORTS, str(folder)]
    return subprocess.run(command, capture_output=True, text=True, timeout=240, check=False)


@pytest.mark.slow
def test_the_trainers_import_with_the_benchmarks_first_on_the_path():
    done = _imports_with_first_on_path(BENCHMARKS)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.slow
def test_a_benchmark_named_like_a_probed_package_breaks_the_import(tmp_path):
    # The negative control: the file name that broke transformers 5.25.
    (tmp_path / "kernels.py").write_text('"""A benchmark of custom kernels."""\n')
    done = _imports_with_first_on_path(tmp_path)
    if done.returncode == 0:
        import transformers

        pytest.skip(f"transformers {transformers.__version__} does not probe for `kernels`")
    assert "kernels" in done.stderr
