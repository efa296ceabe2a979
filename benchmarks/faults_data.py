"""Rows of benchmarks/faults.py about the data and the files an operator hands over: a resume
onto changed data, a stream under torchrun, a bad sample, an empty or BOM-led config, a loop of
links, a model_init Trainer packed. Each from fresh processes, on benchmarks/fault_recipes.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fault_runs import (
    PY,
    ROOT,
    TORCHRUN,
    TORCHTURBO,
    Bench,
    Row,
    equal,
    micro_steps,
    newest,
    run,
    state,
)

RECIPES = ROOT / "benchmarks" / "fault_recipes.py"


def _train(recipe: str, ckpt: Path, steps: int, *more: Any) -> list[Any]:
    argv = ["train", f"{RECIPES}:{recipe}", "--device", "cpu", "--steps", steps]
    return [*TORCHTURBO, *argv, "--checkpoint-dir", ckpt, *more]


def grown_data(bench: Bench) -> Row:
    """Saved after 3 batches of 6, resumed on 28 samples instead of 24."""
    ckpt = bench.dir("grown")
    assert run(_train("rows", ckpt, 3, "--save-every", 3)).process.returncode == 0
    grown = {"FAULTS_SAMPLES": "28"}
    refused = run(_train("rows", ckpt, 10, "--resume"), env=grown)
    again = run(_train("rows", ckpt, 10, "--resume", "--next-epoch"), env=grown)
    return Row(
        "resumed mid-epoch on data grown from 24 to 28 samples",
        refused.process.returncode,
        3,
        3,
        None,
        refused.last_line() + f" | --next-epoch: exit {again.process.returncode}",
    )


def changed_plan(bench: Bench) -> Row:
    ckpt = bench.dir("plan")
    assert run(_train("rows", ckpt, 3, "--save-every", 3)).process.returncode == 0
    proc = run(_train("rows", ckpt, 6, "--resume", "--data.batches", "buckets"))
    return Row(
        "resumed mid-epoch with [data] batches = 'buckets'",
        proc.process.returncode,
        3,
        3,
        None,
        proc.last_line(),
    )


def stream_under_torchrun(bench: Bench) -> Row:
    ckpt = bench.dir("stream")
    argv = ["train", f"{RECIPES}:stream", "--device", "cpu", "--steps", 4, "--checkpoint-dir", ckpt]
    proc = run([*TORCHRUN, "-m", "torchturbo", *argv])
    return Row(
        "an IterableDataset recipe under torchrun (2 ranks)",
        proc.process.returncode,
        newest(ckpt),
        4,
        None,
        proc.last_line(r"trained to|error:"),
    )


def float64_sample(bench: Bench) -> Row:
    """Sample 17 is float64 (in the 3rd batch of the seeded shuffle): the run stops there and
    keeps its 2 steps; fixed, the resume must end where a run on the fixed data ends."""
    reference = bench.dir("float64-reference")
    assert run(_train("float64_sample", reference, 6)).process.returncode == 0
    ckpt = bench.dir("float64")
    proc = run(_train("float64_sample", ckpt, 6), env={"FAULTS_FLOAT64": "1"})
    kept = newest(ckpt)
    resumed = run(_train("float64_sample", ckpt, 6, "--resume"))
    identical = resumed.process.returncode == 0 and equal(state(ckpt), state(reference))
    return Row(
        "one float64 sample among float32 ones",
        proc.process.returncode,
        kept,
        micro_steps(proc) or (kept or 0),
        identical,
        proc.last_line(),
    )


def config_file(bench: Bench, content: bytes, fault: str) -> Row:
    folder = bench.dir(f"config-{len(content)}")
    folder.mkdir()
    config = folder / "turbo.toml"
    config.write_bytes(content)
    proc = run(_train("rows", folder / "ckpt", 2, "--config", config))
    return Row(fault, proc.process.returncode, None, None, None, proc.last_line(r"error:|trained"))


def link_loop(bench: Bench) -> Row:
    folder = bench.dir("loop")
    folder.mkdir()
    (folder / "a").symlink_to(folder / "b")
    (folder / "b").symlink_to(folder / "a")
    proc = run(_train("rows", folder / "a", 2))
    return Row(
        "--checkpoint-dir in a loop of symbolic links",
        proc.process.returncode,
        None,
        0,
        None,
        proc.last_line(),
    )


MODEL_INIT = """
import tempfile, torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments
from torchturbo import TurboConfig
from torchturbo.data.collate import pad_collate
from torchturbo.integrations.transformers import TurboTrainer, recipe_from_trainer
from torchturbo.techniques.tools.packing_isolation import check_isolation, isolation_documents
def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
rows = [{"input_ids": torch.arange(2 + i % 9) % 64} for i in range(32)]
rows = [{**r, "labels": r["input_ids"].clone()} for r in rows]
args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4,
    report_to="none", use_cpu=True, max_steps=2, save_strategy="no")
trainer = TurboTrainer(model_init=model, args=args, train_dataset=rows, data_collator=pad_collate,
    turbo_config=TurboConfig(device="cpu").replace(data__batches="packed"))
tuner = check_isolation(recipe_from_trainer(trainer).model(), isolation_documents(rows)).ok
trainer.train()
print(f"tuner packs: {tuner}; TurboTrainer trained packed to step {trainer.state.global_step}")
"""


def model_init_packing(bench: Bench) -> Row | None:
    try:
        __import__("transformers")
    except ImportError:
        return None
    proc = run([*PY, "-c", MODEL_INIT])
    return Row(
        "packing a model_init Trainer's Llama (use_cache on)",
        proc.process.returncode,
        None,
        None,
        None,
        proc.last_line(r"tuner packs|error|Error"),
    )


DATA_FAULTS = {
    "grown-data": grown_data,
    "changed-plan": changed_plan,
    "stream-torchrun": stream_under_torchrun,
    "float64-sample": float64_sample,
    "empty-config": lambda b: config_file(b, b"", "an empty --config file"),
    "bom-config": lambda b: config_file(
        b, "\ufeff[accumulation]\nsteps = 1\n".encode(), "a --config starting with a BOM"
    ),
    "link-loop": link_loop,
    "model-init-packing": model_init_packing,
}
