"""Every bad input the CLI meets ends in one line on stderr, exit code 2 and no traceback.

One table of cases, each a class of bad input a new user types: config values and files,
arguments, recipe code and data that fail, non-finite training, incompatible or hand-edited
checkpoints, paths that cannot be written. The cases run through ``main()`` in this process
(a traceback would surface as the exception itself); the tests after the table run the real
command in a subprocess where only a subprocess can: a file-size limit that makes a checkpoint
write fail, and the exit code and stderr of the installed entry point.
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import edit_checkpoint_json

from torchturbo import Turbo, TurboConfig
from torchturbo.cli import main
from torchturbo.cli.errors import error_line
from torchturbo.config import DataConfig
from torchturbo.data.loader import build_loader
from torchturbo.recipe import UserCodeError
from torchturbo.resume.files import MANIFEST
from torchturbo.workloads import get_workload

RECIPES = Path(__file__).parent / "recipes"
TINY = f"{RECIPES / 'tiny.py'}:recipe"


def broken(name: str) -> str:
    return f"{RECIPES / 'broken.py'}:{name}"


def train(recipe: str, *more: str) -> list[str]:
    return ["train", recipe, "--device", "cpu", "--steps", "2", *more]


def toml(tmp: Path, text: str) -> Path:
    path = tmp / "turbo.toml"
    path.write_text(text)
    return path


def file_at(tmp: Path, name: str, data: bytes = b"") -> Path:
    path = tmp / name
    path.write_bytes(data)
    return path


def checkpointed(tmp: Path, recipe: str = TINY, steps: int = 4) -> Path:
    """A checkpoint directory holding a run of ``recipe`` to ``steps`` (made through the CLI)."""
    ckpt = tmp / "ckpt"
    argv = ["train", recipe, "--device", "cpu", "--steps", str(steps), "--checkpoint-dir", ckpt]
    assert main([str(a) for a in argv]) == 0
    return ckpt


def edited(ckpt: Path, name: str, edit: Callable[[dict], None]) -> Path:
    """``ckpt`` with a JSON file of its newest checkpoint edited by hand."""
    edit_checkpoint_json(sorted(ckpt.glob("ckpt-*"))[-1], name, edit)
    return ckpt


def resume(ckpt: Path, recipe: str = TINY, steps: int = 6) -> list[str]:
    return [
        "train",
        recipe,
        "--device",
        "cpu",
        "--checkpoint-dir",
        ckpt,
        "--resume",
        "--steps",
        str(steps),
    ]


# Each case: tmp_path -> (argv, a part of the one line it must print).
CASES: dict[str, Callable[[Path], tuple[list, str]]] = {
    # --- config values ---------------------------------------------------------------------
    "max_norm nan": lambda t: (
        [*train(TINY), "--config", toml(t, "[clipping]\nmax_norm = nan")],
        "[clipping] max_norm = nan is invalid: expected a finite number > 0",
    ),
    "max_norm inf": lambda t: (
        [*train(TINY), "--config", toml(t, "[clipping]\nmax_norm = inf")],
        "max_norm = inf is invalid",
    ),
    "norm_type negative": lambda t: (
        [*train(TINY), "--config", toml(t, "[clipping]\nnorm_type = -3.0")],
        "norm_type = -3.0 is invalid: expected a finite number >= 1, or inf",
    ),
    "bucket_cap_mb nan": lambda t: (
        [*train(TINY), "--config", toml(t, "[distributed]\nbucket_cap_mb = nan")],
        "bucket_cap_mb = nan is invalid",
    ),
    "accumulation beyond int64": lambda t: (
        [*train(TINY), "--config", toml(t, "[accumulation]\nsteps = 99999999999999999999")],
        "<= 2**63 - 1",
    ),
    "accumulation beyond an epoch": lambda t: (
        [*train(TINY), "--config", toml(t, "[accumulation]\nsteps = 1000000000000")],
        "is more than the 8 batches of an epoch",
    ),
    "num_workers huge": lambda t: (
        [*train(TINY), "--config", toml(t, "[data]\nnum_workers = 1000000")],
        "num_workers = 1000000 is invalid",
    ),
    "device cuda:banana in a file": lambda t: (
        ["train", TINY, "--steps", "2", "--config", toml(t, 'device = "cuda:banana"')],
        "device = 'cuda:banana' is invalid",
    ),
    "wrong type": lambda t: (
        [*train(TINY), "--config", toml(t, '[accumulation]\nsteps = "4"')],
        "steps = '4' is invalid: expected int",
    ),
    "typo in a key": lambda t: (
        [*train(TINY), "--config", toml(t, '[precision]\ndtyp = "bf16"')],
        "did you mean 'dtyp' -> 'dtype'?",
    ),
    "every problem of a file": lambda t: (
        [
            *train(TINY),
            "--config",
            toml(t, "[clipping]\nmax_norm = nan\n[data]\nnum_workers = -1\n[x]\ny = 1"),
        ],
        "3 problems: ",
    ),
    "contradictory config": lambda t: (
        [
            *["train", TINY, "--steps", "2"],
            "--config",
            toml(
                t,
                'device = "cuda"\n[compile]\nmode = "reduce-overhead"\n'
                '[checkpointing]\nmode = "full"\n[distributed]\nstrategy = "fsdp"\n',
            ),
        ],
        "2 problems: device = 'cuda' needs CUDA; this machine has no CUDA device; [distributed]",
    ),
    "keep_last zero": lambda t: (
        [*train(TINY), "--config", toml(t, "[reliability]\nkeep_last = 0")],
        "[reliability] keep_last = 0 is invalid: expected an int >= 1",
    ),
    "prefetch without workers": lambda t: (
        [*train(TINY), "--config", toml(t, "[data]\nprefetch_factor = 4")],
        "prefetch_factor = 4 needs num_workers > 0",
    ),
    # --- config files ----------------------------------------------------------------------
    "empty config file": lambda t: (
        [*train(TINY), "--config", file_at(t, "x.toml", b"")],
        "is empty, so it sets nothing",
    ),
    "binary config": lambda t: (
        [*train(TINY), "--config", file_at(t, "x.toml", b"\xd0\xcf\x11\xe0\x00binary")],
        "is not UTF-8 text (byte 0xd0 at offset 0)",
    ),
    "directory as config": lambda t: ([*train(TINY), "--config", t], "is a directory"),
    "/dev/null as config": lambda t: (
        [*train(TINY), "--config", "/dev/null"],
        "'/dev/null' is a character device, not a file (--config)",
    ),
    "missing config": lambda t: ([*train(TINY), "--config", t / "no.toml"], "does not exist"),
    "invalid TOML": lambda t: ([*train(TINY), "--config", toml(t, "[precision")], "valid TOML"),
    "nested too deeply": lambda t: (
        [*train(TINY), "--config", toml(t, "x = " + "[" * 3000 + "]" * 3000)],
        "too deeply",
    ),
    # --- arguments -------------------------------------------------------------------------
    "memory budget inf": lambda t: (
        ["tune", TINY, "--memory-budget", "inf"],
        "argument --memory-budget: 'inf' is not a size",
    ),
    "activation budget negative": lambda t: (
        [*train(TINY), "--activation-budget=-1G"],
        "argument --activation-budget: '-1G' is negative: a size is at least 1 byte",
    ),
    "activation budget overflow": lambda t: (
        [*train(TINY), "--activation-budget", "99999999999999999999T"],
        "too large",
    ),
    "time budget inf": lambda t: (
        ["tune", TINY, "--time-budget", "inf"],
        "'inf' is not a duration",
    ),
    "time budget negative": lambda t: (
        ["tune", TINY, "--time-budget=-5m"],
        "must be positive",
    ),
    "time budget nan": lambda t: (["tune", TINY, "--time-budget", "nan"], "not a duration"),
    "device banana": lambda t: (
        ["bench", TINY, "--device", "banana"],
        "argument --device: 'banana' is invalid",
    ),
    "device cuda:banana": lambda t: (
        ["doctor", TINY, "--device", "cuda:banana"],
        "argument --device: 'cuda:banana' is invalid",
    ),
    "device absent": lambda t: (["bench", TINY, "--device", "cuda:7"], "no CUDA device"),
    "device index beyond torch's": lambda t: (
        [*train(TINY), "--device", "cuda:128"],
        "with N from 0 to 127",
    ),
    "activation budget zero": lambda t: (
        [*train(TINY), "--activation-budget", "0"],
        "at least 1 byte",
    ),
    "time budget too long": lambda t: (
        ["tune", TINY, "--time-budget", "400d"],
        "too long: at most 31536000 s",
    ),
    "loss tolerance nan": lambda t: (
        ["tune", TINY, "--loss-tolerance", "nan", "--out", t / "report"],
        "argument --loss-tolerance: 'nan' is out of range: expected a fraction between 0 and 1",
    ),
    "doctor steps zero": lambda t: (
        ["doctor", TINY, "--steps", "0"],
        "argument --steps: 0 is out of range: expected an int >= 1 (profiled steps)",
    ),
    "steps zero": lambda t: (
        [*train(TINY)[:-1], "0"],
        "argument --steps: 0 is out of range: expected an int >= 1 (optimizer steps)",
    ),
    "steps not a number": lambda t: (
        [*train(TINY)[:-1], "ten"],
        "argument --steps: 'ten' is not an int: expected an int >= 1",
    ),
    "steps beyond int64": lambda t: ([*train(TINY)[:-1], str(2**63)], "is out of range"),
    "save-every negative": lambda t: (
        [*train(TINY), "--save-every", "-1"],
        "argument --save-every: -1 is out of range: expected an int >= 0",
    ),
    "save-every without a directory": lambda t: (
        [*train(TINY), "--save-every", "2"],
        "--save-every needs --checkpoint-dir",
    ),
    "resume without a directory": lambda t: (
        [*train(TINY), "--resume"],
        "--resume needs --checkpoint-dir",
    ),
    "unknown option": lambda t: ([*train(TINY), "--fast"], "unknown option --fast"),
    "unknown method": lambda t: (
        ["export", TINY, "--out", t / "m.pt2", "--method", "onnx"],
        "argument --method: invalid choice: 'onnx'",
    ),
    "bench steps": lambda t: (
        ["bench", TINY, "--steps", "1"],
        "argument --steps: 1 is out of range: expected an int >= 2",
    ),
    # --- misspelt options and values: the closest one, before anything else is checked ----
    "misspelt option, dash for dot": lambda t: (
        ["bench", TINY, "--precision-dtype", "bf16"],
        "unknown option --precision-dtype (did you mean --precision.dtype?)",
    ),
    "misspelt option before a missing required one": lambda t: (
        ["train", TINY, "--stpes", "3"],
        "unknown option --stpes (did you mean --steps?)",
    ),
    "misspelt global option": lambda t: (
        ["--debgu", "bench"],
        "unknown option --debgu (did you mean --debug?)",
    ),
    "misspelt command": lambda t: (["bnech", TINY], "(did you mean 'bench'?)"),
    "misspelt preset": lambda t: (["bench", TINY, "--preset", "fsat"], "(did you mean 'fast'?)"),
    "misspelt size": lambda t: (["bench", TINY, "--size", "lage"], "(did you mean 'large'?)"),
    "misspelt config value": lambda t: (
        ["bench", TINY, "--precision.dtype", "bf61"],
        "expected one of 'fp32', 'tf32', 'bf16', 'fp16' (did you mean 'bf16'?)",
    ),
    "misspelt config value in a file": lambda t: (
        ["bench", TINY, "--config", toml(t, '[compile]\nmode = "max_autotune"')],
        "(did you mean 'max-autotune'?)",
    ),
    "misspelt workload": lambda t: (
        ["bench", "--workload", "visoin"],
        "unknown workload 'visoin' (did you mean 'vision'?)",
    ),
    "misspelt stage": lambda t: (
        ["tune", TINY, "--only", "precison", "--out", t / "report"],
        "--only precison: no such stage (did you mean 'precision'?)",
    ),
    "misspelt logger": lambda t: (
        [*train(TINY), "--logger", "csv,wandbb"],
        "'csv,wandbb' (did you mean 'wandb'?)",
    ),
    "misspelt device": lambda t: (["bench", TINY, "--device", "cdua"], "(did you mean 'cuda'?)"),
    "an older flag": lambda t: (
        [*train(TINY), "--data.bucketing"],
        "--data.bucketing is now --data.batches buckets",
    ),
    "an older file": lambda t: (
        [*train(TINY), "--config", toml(t, "[data]\npacking = true")],
        "[data] packing = true is now [data] batches = 'packed'",
    ),
    "a flag given a word it does not take": lambda t: (
        [*train(TINY), "--resume=maybe"],
        "--resume=maybe: a flag takes true or false",
    ),
    "a config flag given a word it does not take": lambda t: (
        [*train(TINY), "--chunked_loss.enabled=maybe"],
        "argument --chunked_loss.enabled/--no-chunked_loss.enabled: 'maybe' is not one of true, "
        "false",
    ),
    "a negative size after a space": lambda t: (
        ["tune", TINY, "--memory-budget", "-1GiB"],
        "argument --memory-budget: '-1GiB' is negative",
    ),
    "planned steps zero": lambda t: (
        ["tune", TINY, "--planned-steps", "0"],
        "argument --planned-steps: 0 is out of range: expected an int >= 1",
    ),
    # --- recipe code and data --------------------------------------------------------------
    "missing recipe file": lambda t: (train("missing.py:recipe"), "does not exist"),
    "missing recipe function": lambda t: (train(broken("nope")), "has no 'nope'"),
    "recipe without a function": lambda t: (train(str(RECIPES / "tiny.py")), "expected 'path/to"),
    "recipe that does not import": lambda t: (
        train(f"{file_at(t, 'bad.py', b'def recipe(:')}:recipe"),
        "failed to import: SyntaxError: invalid syntax (bad.py, line 1)",
    ),
    "recipe returns an int": lambda t: (
        train(TINY.replace(":recipe", ":not_a_recipe")),
        "returned int, expected torchturbo.Recipe",
    ),
    "recipe raises": lambda t: (
        train(broken("raises")),
        "the recipe function raises (broken.py:",
    ),
    "model factory raises": lambda t: (
        train(broken("model_raises")),
        "the model factory model_raises.<locals>.make_model (broken.py:",
    ),
    "model factory returns a str": lambda t: (
        train(broken("model_not_a_module")),
        "returned str, expected a torch.nn.Module",
    ),
    "optimizer factory raises": lambda t: (
        train(broken("optimizer_raises")),
        "raised ValueError: Invalid learning rate: -1.0",
    ),
    "optimizer factory returns a list": lambda t: (
        train(broken("optimizer_not_an_optimizer")),
        "returned list, expected a torch.optim.Optimizer",
    ),
    "dict sample missing a key": lambda t: (
        train(broken("missing_key")),
        "torchturbo's default collate pad_collate raised ValueError: pad_collate: sample",
    ),
    "dict sample missing a key, in a worker": lambda t: (
        [*train(broken("missing_key")), "--config", toml(t, "[data]\nnum_workers = 1")],
        "torchturbo's default collate pad_collate raised ValueError: pad_collate: sample",
    ),
    "None in samples": lambda t: (
        train(broken("none_in_samples")),
        "pad_collate raised TypeError: default_collate: batch must contain tensors",
    ),
    "None in samples, torch's collate": lambda t: (
        train(broken("none_in_samples_torch_collate")),
        "torch's default_collate raised TypeError: default_collate: batch must contain tensors",
    ),
    "strings in samples": lambda t: (
        train(broken("strings_in_samples")),
        "loss_fn failed on a batch of structure list(Tensor[8, 4] float32, tuple(str",
    ),
    "loss count is a string": lambda t: (
        train(broken("loss_count_is_a_string")),
        "it returned tuple(Tensor[] float32, str)",
    ),
    "model forward fails": lambda t: (
        train(broken("model_shape_mismatch")),
        "raised RuntimeError: mat1 and mat2 shapes cannot be multiplied",
    ),
    "the model cannot take the batch's shapes": lambda t: (
        train(broken("model_shape_mismatch")),
        "the model cannot take a batch of structure list(Tensor[8, 4] float32, Tensor[8] int64)",
    ),
    "dataset item raises": lambda t: (
        train(broken("dataset_raises")),
        "the dataset's FlakyDataset.__getitem__ (broken.py:",
    ),
    "collate raises": lambda t: (
        train(broken("collate_raises")),
        "the collate function collate_raises.<locals>.collate (broken.py:",
    ),
    "empty dataset": lambda t: (train(broken("empty_dataset")), "the dataset is empty"),
    "samples all of length 0": lambda t: (
        train(broken("empty_texts")),
        "all 16 samples have length 0 (lengths): there is no token to train on",
    ),
    # --- porting a training loop: each line names the fix ---------------------------------
    "loss_fn runs backward": lambda t: (
        train(broken("backward_in_loss_fn")),
        "loss_fn calls backward() itself: return the loss",
    ),
    "loss_fn runs backward, doctor": lambda t: (
        ["doctor", broken("backward_in_loss_fn"), "--steps", "1"],
        "loss_fn calls backward() itself: return the loss",
    ),
    "loss_fn runs backward, bench": lambda t: (
        ["bench", broken("backward_in_loss_fn"), "--steps", "2"],
        "loss_fn calls backward() itself: return the loss",
    ),
    "a model instance": lambda t: (
        train(broken("model_instance")),
        "model is a Linear instance, and a recipe takes a factory (the tuner builds a fresh "
        "model for every trial): pass model=Linear or model=lambda: Linear(...)",
    ),
    "an optimizer instance": lambda t: (
        train(broken("optimizer_instance")),
        "pass optimizer=lambda params: torch.optim.SGD(params, lr=0.1)",
    ),
    "a loss module as loss_fn": lambda t: (
        train(broken("loss_module")),
        "loss_fn is a CrossEntropyLoss module, which takes (output, target)",
    ),
    "a DataLoader as dataset": lambda t: (
        train(broken("data_loader_as_dataset")),
        "dataset=loader.dataset, batch_size=loader.batch_size",
    ),
    "a model class that needs arguments": lambda t: (
        train(broken("model_class_needs_arguments")),
        "cannot be called with no arguments: pass model=lambda: Classifier(classes=...)",
    ),
    "loss_fn of the batch alone": lambda t: (
        train(broken("loss_fn_of_the_batch_only")),
        "cannot be called as loss_fn(model, batch)",
    ),
    "a loss per sample": lambda t: (
        train(broken("loss_per_sample")),
        "it returned Tensor[8] float32: reduce it to the batch's mean",
    ),
    "loss.item()": lambda t: (
        train(broken("loss_item")),
        "return the loss tensor itself, not loss.item()",
    ),
    "tokens counted, a bare loss returned": lambda t: (
        train(broken("tokens_counted_without_a_count")),
        "count_unit='tokens', but loss_fn returned the loss alone, so each step would count its "
        "samples as tokens: return (loss, the number of tokens the mean is over)",
    ),
    "the model given the whole batch": lambda t: (
        train(broken("model_given_the_whole_batch")),
        "loss_fn passed the whole batch (a list): unpack it, e.g. inputs, targets = batch",
    ),
    # --- non-finite training ---------------------------------------------------------------
    "NaN inputs, run shorter than the patience": lambda t: (
        train(broken("nan_inputs")),
        "the run ended with 2 non-finite optimizer step(s) in a row",
    ),
    "NaN inputs, patience exhausted": lambda t: (
        [*train(broken("nan_inputs"))[:-1], "6"],
        "non-finite for 3 consecutive optimizer steps",
    ),
    "weights blow up": lambda t: (
        [*train(broken("infinite_learning_rate"))[:-1], "20"],
        "non-finite for 3 consecutive optimizer steps (up to optimizer step 4)",
    ),
    "weights blow up, saved every step": lambda t: (
        [*train(broken("infinite_learning_rate")), "--checkpoint-dir", t, "--save-every", "1"],
        "refusing to save a checkpoint of non-finite weights: model['weight']",
    ),
    # --- resume ----------------------------------------------------------------------------
    "steps below the checkpoint's": lambda t: (
        resume(checkpointed(t, steps=4), steps=2),
        "cannot train to optimizer step 2 (--steps)",
    ),
    "another architecture": lambda t: (
        resume(checkpointed(t, broken("sgd")), broken("wider")),
        "'0.weight' is [6, 4] in the checkpoint and [8, 4] in the model",
    ),
    "another optimizer type": lambda t: (
        resume(checkpointed(t, broken("adam")), broken("sgd")),
        "the checkpoint's optimizer is Adam, this run's is SGD",
    ),
    "manifest missing an entry": lambda t: (
        resume(edited(checkpointed(t), MANIFEST, lambda m: m["files"].pop("state.json"))),
        "no checkpoint verifies: checkpoint '",
    ),
    "counter is a string": lambda t: (
        resume(edited(checkpointed(t), "state.json", lambda s: s.update(skipped_steps="0"))),
        "skipped_steps = '0' is invalid",
    ),
    "loader position beyond the data": lambda t: (
        resume(edited(checkpointed(t, steps=4), "state.json", lambda s: s.update(loader=[0, 99]))),
        "epoch 0, batch 99 is out of range: this run's loader has 8 batches per epoch",
    ),
    "micro_batch_split zero": lambda t: (
        resume(edited(checkpointed(t), "state.json", lambda s: s.update(micro_batch_split=0))),
        "micro_batch_split = 0 is invalid",
    ),
    "no checkpoint to resume": lambda t: (resume(t), "holds no checkpoint"),
    # --- paths -----------------------------------------------------------------------------
    "checkpoint dir is a file": lambda t: (
        [*train(TINY), "--checkpoint-dir", file_at(t, "file")],
        "is not a directory (--checkpoint-dir)",
    ),
    "checkpoint dir under a file": lambda t: (
        [*train(TINY), "--checkpoint-dir", file_at(t, "file") / "ckpt"],
        "cannot create checkpoint directory '",
    ),
    "checkpoint dir is /dev/null": lambda t: (
        [*train(TINY), "--checkpoint-dir", "/dev/null"],
        "'/dev/null' is not a directory",
    ),
    "tune --out is a file": lambda t: (
        ["tune", TINY, "--out", file_at(t, "file")],
        "--out '",
    ),
    "export --out unwritable": lambda t: (
        ["export", TINY, "--out", "/proc/torchturbo/model.pt2"],
        "cannot be written",
    ),
    "export --out is a directory": lambda t: (["export", TINY, "--out", t], "is a directory"),
    "bench --json under a file": lambda t: (
        ["bench", TINY, "--json", file_at(t, "file") / "out.json"],
        "is not a directory",
    ),
    "doctor --trace is a file": lambda t: (
        ["doctor", TINY, "--trace", file_at(t, "file")],
        "--trace '",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_prints_one_line_and_exits_2(case, tmp_path, capsys):
    argv, expected = CASES[case](tmp_path)
    capsys.readouterr()  # what a setup run printed
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("torchturbo") and expected in lines[0], lines[0]


def test_nothing_non_finite_is_saved(tmp_path, capsys):
    """With the guard off, NaN reaches the weights; the save after that step is refused, and
    the checkpoints saved before (of finite weights) are all that the directory holds."""
    ckpt = tmp_path / "ckpt"
    config = toml(tmp_path, "[reliability]\nnonfinite_patience = 0")
    argv = [*train(broken("nan_inputs")), "--checkpoint-dir", ckpt, "--save-every", "1"]
    assert main([str(a) for a in [*argv, "--config", config]]) == 2
    assert "refusing to save a checkpoint" in capsys.readouterr().err
    assert not ckpt.exists() or not any(ckpt.iterdir())


def test_debug_shows_the_traceback_of_a_user_error():
    with pytest.raises(UserCodeError, match="recipe exploded") as caught:
        main(["--debug", *train(broken("raises"))])
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_negative_control_an_error_of_torchturbo_itself_is_not_a_line():
    """A ValueError that torch raised on a call torchturbo made (no ``raise`` of torchturbo's, no
    user code) is torchturbo's bug, as is a RuntimeError a ``raise`` of torchturbo's threw:
    both must show their traceback, not hide behind one line."""
    args = argparse.Namespace(command="train")
    dataset = torch.utils.data.TensorDataset(torch.zeros(4, 2))
    overflow = _raised(
        build_loader, dataset, batch_size=2, config=DataConfig(), device="cpu", seed=2**64
    )
    assert "Overflow" in str(overflow) and error_line(overflow, args) is None
    not_set_up = _raised(Turbo(TurboConfig(device="cpu")).step, None, None)
    assert "before Turbo.step" in str(not_set_up) and error_line(not_set_up, args) is None
    # The control's control: a ValueError that a raise of torchturbo's threw is one line.
    unknown = _raised(get_workload, "imagenet")
    assert error_line(unknown, args) == str(unknown)


def _raised(function: Callable, *args, **kwargs) -> Exception:
    """What ``function`` raises, with the traceback main() would see (without this frame, of a
    file outside torchturbo, which would count as the user's)."""
    try:
        function(*args, **kwargs)
    except Exception as err:
        return err.with_traceback(err.__traceback__.tb_next)
    raise AssertionError(f"{function} did not raise")


def _run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torchturbo", *argv],
        capture_output=True,
        text=True,
        timeout=180,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
        **kwargs,
    )


@pytest.mark.slow
def test_the_installed_command_prints_one_line_and_exits_2():
    result = _run(train(broken("model_raises")))
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "Traceback" not in result.stderr and "no weights here" in result.stderr


def _file_size_limit(limit: int) -> Callable[[], None]:
    def apply() -> None:
        # Past the limit write() fails with EFBIG, as it fails with ENOSPC on a full disk;
        # SIGXFSZ would kill the process instead of letting it report.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


@pytest.mark.slow
def test_a_failed_checkpoint_write_names_the_path_and_keeps_the_earlier_ones(tmp_path):
    ckpt = checkpointed(tmp_path, steps=2)
    before = {p.name: (p / "model.pt").read_bytes() for p in ckpt.iterdir()}
    # The tiny model's optimizer.pt (Adam: two moments per weight) is ~25 kB.
    argv = [*resume(ckpt, steps=4), "--save-every", "1"]
    result = _run(argv, preexec_fn=_file_size_limit(16_000))
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert "File too large" in result.stderr and "(--checkpoint-dir)" in result.stderr
    assert "the newest checkpoint kept is '" in result.stderr and "ckpt-0000000002', intact" in (
        result.stderr
    )
    after = {p.name: (p / "model.pt").read_bytes() for p in ckpt.iterdir()}
    assert after == before  # no temporary left, the earlier checkpoint untouched


@pytest.mark.slow
def test_an_export_that_cannot_be_written_names_the_file(tmp_path):
    """torch's archive writer, given a path, aborts the process when a write fails; the artefact
    is serialized in memory and written by torchturbo, so the failure is one line."""
    out = tmp_path / "model.pt2"
    result = _run(["export", TINY, "--out", str(out)], preexec_fn=_file_size_limit(4_000))
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr == f"torchturbo export: error: File too large: {str(out)!r} (--out)\n"
    assert list(tmp_path.iterdir()) == []  # no partial file, no temporary


@pytest.mark.parametrize(
    "argv",
    [
        [TINY, "--only", "precison"],
        [TINY, "--planned-steps", "0"],
        [TINY, "--memory-budget", "-1GiB"],
        [TINY, "--precision-dtype", "bf16"],
        [broken("model_instance")],
        [broken("backward_in_loss_fn"), "--device", "cpu"],
    ],
    ids=["stage", "range", "negative size", "option", "recipe shape", "loss_fn contract"],
)
def test_a_refused_tune_leaves_nothing_behind(argv, tmp_path, capsys):
    out = tmp_path / "report"
    assert main(["tune", *argv, "--out", str(out)]) == 2
    assert not out.exists(), sorted(out.rglob("*"))
