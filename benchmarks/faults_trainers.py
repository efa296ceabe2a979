"""A Hugging Face or Lightning training run for benchmarks/faults.py to signal: one process.

    python benchmarks/faults_trainers.py hf|lightning --out DIR --steps N [--resume]

Trains a tiny model with dropout (a BERT tagger through ``TurboTrainer``; a conv classifier
through Lightning with ``TurboLightningCallback``) for ``--steps`` optimizer steps, printing
``step K`` as each begins and sleeping ``FAULTS_STEP_S`` (0.1 s) in it, so that a signal can
land mid-run; at the end it writes the weights to ``DIR/final.pt``. ``--resume`` continues from
the trainer's own checkpoint in ``DIR``. A stop signal exits 75 (``TrainerStopped``).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchturbo import TurboConfig

CPU = TurboConfig(device="cpu")
STEP_S = float(os.environ.get("FAULTS_STEP_S", "0.1"))


def _mark(step: int) -> None:
    print(f"step {step}", flush=True)
    time.sleep(STEP_S)


def hf(out: Path, steps: int, resume: bool) -> nn.Module:
    from transformers import (
        BertConfig,
        BertForTokenClassification,
        TrainerCallback,
        TrainingArguments,
        default_data_collator,
    )

    from torchturbo.integrations.transformers import TurboTrainer

    class Mark(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs) -> None:
            _mark(state.global_step + 1)

    torch.manual_seed(0)
    model = BertForTokenClassification(
        BertConfig(
            vocab_size=64,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=32,
            num_labels=4,
        )
    )
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 64, (96, 16), generator=generator)
    samples = [{"input_ids": row, "labels": row % 4} for row in ids]
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=8,
        max_steps=steps,
        learning_rate=1e-3,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
    )
    trainer = TurboTrainer(
        model=model,
        args=args,
        train_dataset=samples,
        data_collator=default_data_collator,
        turbo_config=CPU,
        callbacks=[Mark()],
    )
    trainer.train(resume_from_checkpoint=True if resume else None)
    return model


def lightning(out: Path, steps: int, resume: bool) -> nn.Module:
    import lightning.pytorch as pl

    from torchturbo.integrations.lightning import TurboLightningCallback

    class Classifier(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
            self.head = nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            pooled = self.features(x).mean(dim=(2, 3))
            return self.head(F.dropout(pooled, 0.3, self.training))

        def training_step(self, batch, batch_idx):
            _mark(self.trainer.global_step + 1)
            images, labels = batch
            return F.cross_entropy(self(images), labels)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    class ResumableLoader(DataLoader):
        """Shuffled, and resumable mid-epoch through Lightning's state_dict interface (what
        torchdata's StatefulDataLoader gives): Lightning restarts any other loader's epoch."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, generator=torch.Generator().manual_seed(0), **kwargs)
            self.yielded, self.skip, self.start = 0, 0, self.generator.get_state()

        def __iter__(self):
            self.start, skip, self.skip = self.generator.get_state(), self.skip, 0
            for index, batch in enumerate(super().__iter__()):
                self.yielded = index + 1
                if index >= skip:
                    yield batch

        def state_dict(self) -> dict:
            return {"start": self.start, "yielded": self.yielded}

        def load_state_dict(self, state: dict) -> None:
            self.generator.set_state(state["start"])
            self.skip = state["yielded"]

    generator = torch.Generator().manual_seed(0)
    images = torch.randn(96, 3, 12, 12, generator=generator)
    data = TensorDataset(images, (images[:, 0].mean(dim=(1, 2)) > 0).long())
    module = Classifier()
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        default_root_dir=out,
        callbacks=[TurboLightningCallback(CPU)],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
    )
    loader = ResumableLoader(data, batch_size=8, shuffle=True)
    trainer.fit(module, loader, ckpt_path="hpc" if resume else None)
    return module


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trainer", choices=("hf", "lightning"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = (hf if args.trainer == "hf" else lightning)(args.out, args.steps, args.resume)
    torch.save(model.state_dict(), args.out / "final.pt")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
