"""The report's output folder, checked up front so that hours of tuning are not lost to it, and
the trainer settings written into it beside turbo.toml.

Files go into it through :func:`torchturbo.output.results_file.write_atomic` (temporary name, then
rename). hf_trainer.py and lightning_trainer.py carry turbo.toml over to the Hugging Face and
Lightning trainers (``integrations.translate``), as Python a user pastes or imports.
"""

from __future__ import annotations

import errno
import os
import textwrap
from pathlib import Path
from typing import Any

from torchturbo.config import TurboConfig
from torchturbo.integrations.translate import DDPSpec, hf_arguments, lightning_arguments
from torchturbo.output.results_file import write_atomic


def prepare_dir(out_dir: Path) -> None:
    """Create ``out_dir`` if missing; fail naming it when it is a file or cannot be written."""
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(
            errno.ENOTDIR, "the report's output path exists and is not a folder", str(out_dir)
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise PermissionError(
            errno.EACCES, "the report's output folder is not writable", str(out_dir)
        )


#: Files written beside turbo.toml: the same settings for the Hugging Face and Lightning trainers.
HF_SETTINGS = "hf_trainer.py"
LIGHTNING_SETTINGS = "lightning_trainer.py"

#: torchturbo comm hook name -> (hook, wrapper) as code (``distributed.ddp.COMM_HOOKS``' hooks).
_HOOK_CODE = {
    "fp16": ("default_hooks.fp16_compress_hook", None),
    "bf16": ("default_hooks.bf16_compress_hook", None),
    "powersgd": ("powerSGD_hook.powerSGD_hook", None),
    "powersgd_fp16": ("powerSGD_hook.powerSGD_hook", "default_hooks.fp16_compress_wrapper"),
    "powersgd_bf16": ("powerSGD_hook.powerSGD_hook", "default_hooks.bf16_compress_wrapper"),
}


def write_trainer_settings(out_dir: Path, config: TurboConfig) -> dict[str, Path]:
    """Write hf_trainer.py and lightning_trainer.py into ``out_dir``: Python a user can paste or
    import, needing neither torchturbo nor (for the Trainer's) anything beyond transformers.
    Returns their paths under the keys ``"hf_trainer"`` and ``"lightning"``."""
    paths = {"hf_trainer": out_dir / HF_SETTINGS, "lightning": out_dir / LIGHTNING_SETTINGS}
    write_atomic(paths["hf_trainer"], render_hf_settings(config).encode())
    write_atomic(paths["lightning"], render_lightning_settings(config).encode())
    return paths


def render_hf_settings(config: TurboConfig) -> str:
    """hf_trainer.py: ``TRAINING_ARGUMENTS`` and, in its docstring, how to use it and what a
    plain Trainer does not get."""
    translation = hf_arguments(config)
    usage = (
        "Hugging Face Trainer settings equivalent to turbo.toml, written by torchturbo tune.\n\n"
        "    args = TrainingArguments(output_dir=..., per_device_train_batch_size=...,\n"
        "                             **TRAINING_ARGUMENTS)\n\n"
        "torchturbo's TurboTrainer applies the rest of turbo.toml (see the notes below):\n\n"
        "    from torchturbo import TurboConfig\n"
        "    from torchturbo.integrations.transformers import TurboTrainer\n"
        "    trainer = TurboTrainer(model=model, args=args, train_dataset=dataset,\n"
        '                           turbo_config=TurboConfig.load("turbo.toml"))\n'
    )
    body = f"TRAINING_ARGUMENTS = {_literal(translation.kwargs)}\n"
    return _module(usage, translation.notes, [], body)


def render_lightning_settings(config: TurboConfig) -> str:
    """lightning_trainer.py: ``TRAINER_KWARGS`` (with a DDPStrategy when [distributed] asks for
    one) and, in its docstring, how to use it and what Lightning does not get."""
    translation = lightning_arguments(config)
    kwargs = dict(translation.kwargs)
    imports: list[str] = []
    strategy = kwargs.pop("strategy", None)
    if isinstance(strategy, DDPSpec):
        imports.append("from lightning.pytorch.strategies import DDPStrategy")
        code, needed = _ddp_code(strategy)
        imports += needed
        kwargs["strategy"] = _Code(code)
    usage = (
        "Lightning Trainer settings equivalent to turbo.toml, written by torchturbo tune.\n\n"
        "    trainer = L.Trainer(max_epochs=..., callbacks=callbacks, **TRAINER_KWARGS)\n\n"
        "The model transforms (channels_last, checkpointing, compile) come from torchturbo's\n"
        "callback:\n\n"
        "    from torchturbo import TurboConfig\n"
        "    from torchturbo.integrations.lightning import TurboLightningCallback\n"
        '    callbacks = [TurboLightningCallback(TurboConfig.load("turbo.toml"))]\n'
    )
    body = f"TRAINER_KWARGS = {_literal(kwargs)}\n"
    return _module(usage, translation.notes, imports, body)


class _Code(str):
    """Source text that goes into a rendered literal as is (not quoted)."""

    def __repr__(self) -> str:
        return str(self)


def _ddp_code(spec: DDPSpec) -> tuple[str, list[str]]:
    arguments = [
        f"bucket_cap_mb={spec.bucket_cap_mb!r}",
        f"gradient_as_bucket_view={spec.gradient_as_bucket_view!r}",
        f"static_graph={spec.static_graph!r}",
    ]
    imports: list[str] = []
    if spec.comm_hook in _HOOK_CODE:
        imports.append(
            "from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook"
        )
        hook, wrapper = _HOOK_CODE[spec.comm_hook]
        arguments.append(f"ddp_comm_hook={hook}")
        if wrapper is not None:
            arguments.append(f"ddp_comm_wrapper={wrapper}")
        if spec.comm_hook.startswith("powersgd"):
            arguments.append(
                "ddp_comm_state=powerSGD_hook.PowerSGDState(\n"
                "            process_group=None,\n"
                f"            matrix_approximation_rank={spec.powersgd_rank},\n"
                f"            start_powerSGD_iter={spec.powersgd_warmup},\n"
                "        )"
            )
    inner = "".join(f"        {argument},\n" for argument in arguments)
    return f"DDPStrategy(\n{inner}    )", imports


def _literal(mapping: dict[str, Any]) -> str:
    """A dict literal, one key per line, that ``ast.literal_eval`` (or Python) reads back."""
    lines = "".join(f"    {key!r}: {value!r},\n" for key, value in mapping.items())
    return "{\n" + lines + "}"


def _module(usage: str, notes: dict[str, str], imports: list[str], body: str) -> str:
    if notes:
        listed = "".join(
            textwrap.fill(f"- {key}: {note}", width=96, initial_indent="", subsequent_indent="  ")
            + "\n"
            for key, note in notes.items()
        )
        usage += f"\nWhat these keywords do not carry, and where it goes instead:\n\n{listed}"
    header = f'"""{usage}"""\n'
    return header + ("\n" + "\n".join(imports) + "\n" if imports else "") + "\n" + body
