"""One host of torchturbo with the model on a second device (tests/fake_device.py's ``fakegpu``).

    python on_fake_device.py HOST [--plant]

HOST is a command (train, bench, tune, doctor) or a trainer (transformers, lightning); each runs
what a GPU user runs, on a Hugging Face Llama where the host takes one (packing, bf16, the
chunked loss: the paths that build tensors of their own) and on the built-in workloads. An op
that mixes a CPU tensor into the model's device fails the run, as CUDA does. ``--plant`` leaves
the first tensor of every batch moved to the device on the CPU: the negative control, which
must fail. The last line says how many ops ran on the device (``ops on fakegpu: N``), so a host
whose model silently stayed on the CPU shows it.
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "recipes")]

import fake_device  # noqa: E402
import hf_causal_lm  # noqa: E402

import torchturbo.base.device  # noqa: E402

fake_device.install()
DEVICE = f"{fake_device.NAME}:0"


def _planted(move: Any) -> Any:
    """``to_device`` that leaves the batch's first tensor (its inputs) where it was: one CPU
    tensor. (Labels would not do: Hugging Face's losses move them to the logits' device.)"""

    def to_device(batch: Any, device: Any, **kwargs: Any) -> Any:
        moved = move(batch, device, **kwargs)
        if isinstance(moved, dict) and moved:
            first = next(iter(moved))
            moved[first] = batch[first]
        elif isinstance(moved, (list, tuple)) and moved:
            moved = type(moved)([batch[0], *moved[1:]])
        return moved

    return to_device


def llama() -> Any:
    """The Trainer's recipe with its model built on the device, as a GPU script builds it."""
    recipe = hf_causal_lm.recipe()
    return dataclasses.replace(recipe, model=lambda: recipe.model().to(DEVICE))


LLAMA = f"{__file__}:llama"
GPU_CONFIG = [
    "--device",
    fake_device.NAME,
    "--precision.dtype",
    "bf16",
    "--chunked_loss.enabled",
]


def _cli(*argv: str) -> int:
    from torchturbo.cli import main

    print("$ torchturbo", " ".join(argv), flush=True)
    return main(list(argv))


def train() -> int:
    folder = tempfile.mkdtemp()
    first = _cli(
        *("train", LLAMA, "--steps", "3", "--data.batches", "packed", *GPU_CONFIG),
        *("--checkpoint-dir", folder, "--save-every", "2"),
    )
    resumed = _cli(
        *("train", LLAMA, "--steps", "4", "--data.batches", "packed", *GPU_CONFIG),
        *("--checkpoint-dir", folder, "--resume"),
    )
    vision = _cli(
        *("train", "--workload", "vision", "--device", DEVICE, "--preset", "fast", "--steps", "2")
    )
    return first or resumed or vision


def bench() -> int:
    buckets = _cli(
        *("bench", LLAMA, "--steps", "2", "--data.batches", "buckets", "--data.max_shapes", "4"),
        *GPU_CONFIG,
    )
    return buckets or _cli(
        "bench", "--workload", "segmentation", "--device", DEVICE, "--steps", "2"
    )


def tune() -> int:
    # Compile is left out: inductor has no code generator for this device.
    out = tempfile.mkdtemp()
    return _cli(
        *("tune", LLAMA, "--device", fake_device.NAME, "--skip", "compile"),
        *("--time-budget", "60s", "--memory-budget", "3MiB", "--find-batch", "--out", out),
    )


def doctor() -> int:
    return _cli("doctor", LLAMA, "--device", fake_device.NAME)


def transformers() -> int:
    # The Trainer puts the model and the batches on ACCELERATE_TORCH_DEVICE when it finds no
    # GPU; this device has no pinned host memory to load into.
    import os

    from torchturbo import TurboConfig
    from torchturbo.integrations.transformers import TurboTrainer

    os.environ["ACCELERATE_TORCH_DEVICE"] = DEVICE
    plain = hf_causal_lm.trainer(use_cpu=False, dataloader_pin_memory=False)
    config = TurboConfig().replace(
        data__batches="packed", precision__dtype="bf16", chunked_loss__enabled=True
    )
    trainer = TurboTrainer(
        model=plain.model,
        args=plain.args,
        train_dataset=plain.train_dataset,
        data_collator=plain.data_collator,
        turbo_config=config,
    )
    trainer.train()
    return 0


def lightning() -> int:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from torchturbo import TurboConfig
    from torchturbo.integrations.lightning import TurboLightningCallback

    class Accelerator(pl.accelerators.Accelerator):
        """Lightning's view of the device: one of it, no statistics."""

        @classmethod
        def name(cls) -> str:
            return fake_device.NAME

        def setup_device(self, device: Any) -> None:
            pass

        def teardown(self) -> None:
            pass

        @staticmethod
        def parse_devices(devices: Any) -> Any:
            return devices

        @staticmethod
        def get_parallel_devices(devices: Any) -> list[Any]:
            return [DEVICE]

        @staticmethod
        def auto_device_count() -> int:
            return 1

        @staticmethod
        def is_available() -> bool:
            return True

        def get_device_stats(self, device: Any) -> dict[str, Any]:
            return {}

    class CausalLM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = hf_causal_lm.model()
            self.model.config.use_cache = False  # a cache would let packed documents meet

        def forward(self, input_ids: Any, position_ids: Any = None, **batch: Any) -> Any:
            return self.model(input_ids=input_ids, position_ids=position_ids, **batch)

        def training_step(self, batch: Any, index: int) -> Any:
            return self(**batch).loss

        def configure_optimizers(self) -> Any:
            import torch

            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self) -> DataLoader:
            collate = hf_causal_lm.collator()
            return DataLoader(hf_causal_lm.documents(), batch_size=4, collate_fn=collate)

    config = TurboConfig().replace(
        data__batches="packed", precision__dtype="bf16", chunked_loss__enabled=True
    )
    import torch

    trainer = pl.Trainer(
        accelerator=Accelerator(),
        strategy=pl.strategies.SingleDeviceStrategy(device=torch.device(DEVICE)),
        max_steps=3,
        callbacks=[TurboLightningCallback(config)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(CausalLM())
    return 0


HOSTS = {f.__name__: f for f in (train, bench, tune, doctor, transformers, lightning)}

if __name__ == "__main__":
    if "--plant" in sys.argv:
        torchturbo.base.device.to_device = _planted(torchturbo.base.device.to_device)
    try:
        status = HOSTS[sys.argv[1]]()
    finally:
        print(f"ops on {fake_device.NAME}: {fake_device.OPS_RUN[0]}", flush=True)
    sys.exit(status)
