"""MFU that means something: one stated peak per row (datasheet for known GPUs, measured
elsewhere, fp32 where a format is emulated), the emulation check on both kinds of CPU, and the
notes that say which peak a row is against and when an MFU above 100% needs explaining."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from torchturbo.cli import main
from torchturbo.config import TurboConfig
from torchturbo.measure.datasheet import TABLE, datasheet_peak_flops, known_gpu
from torchturbo.measure.native import (
    CPU_INSTRUCTIONS,
    NATIVE_SPEEDUP,
    emulated,
    emulation_notice,
    gemm_speedup,
    native_dtypes,
)
from torchturbo.measure.peak import measured_peak_flops, mfu, stated_peak
from torchturbo.measure.system import cpu_flags
from torchturbo.output.tables import OVER_PEAK_NOTE, format_mfu, peak_notes
from torchturbo.trials.variants import compare_configs

native = importlib.import_module("torchturbo.measure.native")
peak = importlib.import_module("torchturbo.measure.peak")
TINY = str(Path(__file__).parent / "recipes" / "tiny.py") + ":recipe"
#: What an AVX2-only CPU looks like to PyTorch: oneDNN and ATen capped below AVX-512.
AVX2_ONLY = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


@pytest.fixture
def fresh_checks():
    """Emulation checks and GEMM ratios are cached per process: clear them around tests that
    fake the hardware."""
    caches = (native._emulated, native._speedup, native._gemm_speedup)
    for cached in caches:
        cached.cache_clear()
    yield
    for cached in caches:
        cached.cache_clear()


def _fake_gemm_rates(monkeypatch, flags: set[str], gflops: dict[torch.dtype, float]) -> None:
    """This CPU as the decision sees it: its flag list and the GEMM rate of each dtype."""
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(native, "gemm_rate", lambda device, dtype, n, **_: gflops[dtype] * 1e9)


# --- the datasheet table -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("device_name", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA H200", "H200 SXM"),
        ("NVIDIA H200 NVL", "H200 NVL"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA A100 80GB PCIe", "A100"),
        ("NVIDIA A10", "A10"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA GeForce RTX 4090", "RTX 4090"),
        ("Tesla V100-SXM2-16GB", "V100 SXM2"),
        ("Tesla V100S-PCIE-32GB", "V100S PCIe"),
        ("Tesla T4", "T4"),
    ],
)
def test_device_names_find_their_gpu(device_name, expected) -> None:
    assert known_gpu(device_name).name == expected


def test_unknown_gpus_and_missing_units_have_no_datasheet_peak() -> None:
    assert known_gpu("NVIDIA A10G") is None and known_gpu("NVIDIA L40") is None
    assert datasheet_peak_flops("NVIDIA B200", "bf16") is None
    assert datasheet_peak_flops("NVIDIA A100-SXM4-80GB", "fp8") is None  # Ampere has no fp8
    assert datasheet_peak_flops("NVIDIA H200", "bf16") == pytest.approx(989.5e12)
    with pytest.raises(ValueError, match=r"fmt='int8'\) is invalid: expected one of fp32"):
        datasheet_peak_flops("NVIDIA H200", "int8")


@pytest.mark.parametrize(("pattern", "gpu"), TABLE, ids=[gpu.name for _, gpu in TABLE])
def test_datasheet_rows_are_dense_figures(pattern, gpu) -> None:
    # A sparse figure copied by mistake is 2x off; dense tensor-core rates keep fixed ratios:
    # fp16 = bf16, tf32 = bf16 / 2 and fp8 = 2 x bf16 (within the datasheets' rounding).
    if gpu.bf16 is not None:
        assert gpu.fp16 == gpu.bf16
        assert gpu.tf32 == pytest.approx(gpu.bf16 / 2, rel=0.02)
        if gpu.fp8 is not None:
            assert gpu.fp8 == pytest.approx(2 * gpu.bf16, rel=0.02)
    assert gpu.fp32 < (gpu.fp16 or gpu.fp32 + 1)  # tensor cores beat CUDA cores everywhere


# --- which formats are emulated ------------------------------------------------------------------


def test_fp32_is_native_and_tf32_fp8_have_no_cpu_units() -> None:
    assert emulated("cpu", "fp32") is None
    assert "no TF32 units" in emulated("cpu", "tf32")
    assert "compute capability >= 8.9" in emulated("cpu", "fp8")
    assert set(native_dtypes("cpu")) == {"fp32", "tf32", "bf16", "fp16", "fp8"}
    with pytest.raises(ValueError, match=r"fmt='int4'\) is invalid"):
        emulated("cpu", "int4")


def test_a_cpu_flag_list_without_bf16_instructions_decides_without_measuring(
    monkeypatch, fresh_checks
) -> None:
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    monkeypatch.setattr(native, "gemm_rate", pytest.fail)  # no micro-benchmark needed
    assert emulated("cpu", "bf16") == "no avx512_bf16 or amx_bf16 instructions"


#: GEMM rates (GFLOP/s, fp32 then the low format) of the CPUs seen so far: an EPYC with native
#: bf16 (4x), an Intel VM whose flags list avx512_bf16 and avx512_fp16 while bf16 runs at half the
#: fp32 rate and fp16 at its rate, and emulation with AVX-512 conversions (just above fp32's).
@pytest.mark.parametrize(
    ("fmt", "flags", "fp32", "low", "reason"),
    [
        ("bf16", {"avx512_bf16"}, 100.0, 400.0, None),
        ("bf16", {"amx_bf16"}, 100.0, 1500.0, None),
        ("bf16", {"avx512_bf16", "avx_vnni"}, 319.0, 166.0, "a bf16 matmul ran at 0.52x"),
        ("fp16", {"avx512_fp16"}, 319.0, 315.0, "a fp16 matmul ran at 0.99x"),
        ("bf16", {"avx512_bf16"}, 100.0, 110.0, "a bf16 matmul ran at 1.10x"),
        ("bf16", {"avx512_bf16"}, 220.0, 1.3, "a bf16 matmul ran at 0.0059x"),
    ],
    ids=[
        "native-avx512",
        "native-amx",
        "flags-but-slow",
        "fp16-at-fp32-rate",
        "conversions",
        "capped",
    ],
)
def test_present_instructions_are_confirmed_by_a_gemm_against_fp32(
    monkeypatch, fresh_checks, fmt, flags, fp32, low, reason
) -> None:
    # A flag says the instructions exist, not that oneDNN uses them or that they are fast here:
    # the measured ratio decides, and the reason quotes it.
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[fmt]
    _fake_gemm_rates(monkeypatch, flags, {torch.float32: fp32, dtype: low})
    verdict = emulated("cpu", fmt)
    if reason is None:
        assert verdict is None
    else:
        assert verdict == f"{reason} the fp32 rate"
    assert gemm_speedup("cpu", fmt) == pytest.approx(low / fp32)


def test_no_flag_list_at_all_is_decided_by_the_gemm(monkeypatch, fresh_checks) -> None:
    # ARM and macOS give no x86 flags: the probe alone decides, both ways.
    _fake_gemm_rates(monkeypatch, set(), {torch.float32: 100.0, torch.bfloat16: 300.0})
    assert emulated("cpu", "bf16") is None
    for cached in (native._emulated, native._speedup):
        cached.cache_clear()
    _fake_gemm_rates(monkeypatch, set(), {torch.float32: 100.0, torch.bfloat16: 40.0})
    assert emulated("cpu", "bf16") == "a bf16 matmul ran at 0.40x the fp32 rate"


def test_this_cpus_bf16_verdict_agrees_with_the_ratio_it_measured(fresh_checks) -> None:
    # Whatever this machine is: no instructions means emulated without measuring; otherwise the
    # verdict is native exactly when the ratio it measured (cached, so the same measurement
    # gemm_speedup reads) reaches the threshold, and an emulated verdict quotes that ratio.
    flags = cpu_flags()
    verdict = emulated("cpu", "bf16")
    if flags and not flags & set(CPU_INSTRUCTIONS["bf16"]):
        assert verdict == "no avx512_bf16 or amx_bf16 instructions"
        return
    ratio = gemm_speedup("cpu", "bf16")
    assert (verdict is None) is (ratio >= NATIVE_SPEEDUP), (verdict, ratio)
    if verdict is not None:
        shown = f"{ratio:.2f}" if ratio >= 0.1 else f"{ratio:.2g}"
        assert verdict == f"a bf16 matmul ran at {shown}x the fp32 rate"


def test_the_flag_list_can_be_replaced_for_the_whole_process(monkeypatch) -> None:
    system = importlib.import_module("torchturbo.measure.system")
    monkeypatch.setenv("TORCHTURBO_CPU_FLAGS", "avx2 fma avx512_bf16")
    system.cpu_flags.cache_clear()
    try:
        assert system.cpu_flags() == {"avx2", "fma", "avx512_bf16"}
    finally:
        monkeypatch.delenv("TORCHTURBO_CPU_FLAGS")
        system.cpu_flags.cache_clear()


@pytest.mark.slow
def test_an_avx2_capped_cpu_really_runs_bf16_emulated_and_is_detected() -> None:
    # The premise (bf16 GEMMs crawl under the cap) and the verdict, in one fresh process.
    script = (
        "import torch\n"
        "from torchturbo.measure.gemm import gemm_rate\n"
        "from torchturbo.measure.native import emulated\n"
        "cpu = torch.device('cpu')\n"
        "torch.set_num_threads(1)  # robust to load, as the check itself\n"
        "ratio = gemm_rate(cpu, torch.bfloat16, 256) / gemm_rate(cpu, torch.float32, 256)\n"
        "print(f'{ratio:.4f}')\n"
        "print(emulated(cpu, 'bf16'))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=os.environ | AVX2_ONLY,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    ratio, reason = done.stdout.strip().splitlines()[-2:]
    assert float(ratio) < 0.5, ratio  # emulated: far below fp32 (measured 0.01-0.02x here)
    assert reason != "None" and ("fp32 rate" in reason or "instructions" in reason)


def test_cuda_formats_follow_the_compute_capability(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    cuda = torch.device("cuda", 0)
    assert native._cuda_reason(cuda, "bf16") is None
    assert native._cuda_reason(cuda, "fp8") == (
        "NVIDIA A100-SXM4-80GB has compute capability 8.0; fp8 tensor cores need >= 8.9"
    )
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert native._cuda_reason(cuda, "fp8") is None


def test_the_notice_names_each_emulated_format_once_with_its_reason(monkeypatch) -> None:
    reasons = {"bf16": "no avx512_bf16 or amx_bf16 instructions", "fp32": None, "tf32": "none"}
    monkeypatch.setattr(native, "emulated", lambda device, fmt: reasons[fmt])
    assert emulation_notice("cpu", ["fp32"]) is None
    notice = emulation_notice("cpu", ["bf16", "fp32", "bf16"])
    assert notice.splitlines() == [
        "note: this cpu emulates bf16: expect no speedup from it;",
        "  MFU in it is stated against the fp32 peak",
        "  bf16: no avx512_bf16 or amx_bf16 instructions",
    ]
    assert all(len(line) <= 80 for line in emulation_notice("cpu", ["bf16", "tf32"]).split("\n"))


# --- the stated peak -----------------------------------------------------------------------------


def test_an_emulated_format_is_stated_against_the_fp32_peak(monkeypatch) -> None:
    monkeypatch.setattr(
        peak, "emulated", lambda device, fmt: "no bf16 units" if fmt == "bf16" else None
    )
    fp32, bf16 = stated_peak("cpu", "fp32"), stated_peak("cpu", "bf16")
    assert bf16.unit == "fp32" and bf16.flops == fp32.flops and bf16.emulated == "no bf16 units"
    assert bf16.describe().endswith("measured (bf16 emulated)")
    # The table: a bf16 variant 20x slower than fp32 showed a 5x *higher* MFU against its
    # own emulated peak; against the one stated peak it shows 20x lower, as it should.
    flops, seconds = 1e9, 0.01
    assert mfu(flops, seconds, fp32.flops) / mfu(flops, 20 * seconds, bf16.flops) == pytest.approx(
        20
    )


def test_a_native_format_is_stated_against_its_own_measured_peak(monkeypatch) -> None:
    monkeypatch.setattr(peak, "emulated", lambda device, fmt: None)
    bf16 = stated_peak("cpu", "bf16")
    assert bf16.unit == "bf16" and bf16.source == "measured" and bf16.emulated is None
    assert bf16.flops == measured_peak_flops("cpu", torch.bfloat16)


def test_fp32_is_measured_as_fp32_while_a_tf32_session_is_open() -> None:
    # A live Turbo session with tf32 holds float32 matmul precision at "high" process-wide; the
    # fp32 peak must not be measured under it, and the session's setting must survive.
    torch.set_float32_matmul_precision("high")
    try:
        fp32 = stated_peak("cpu", "fp32")
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision("highest")
    assert fp32.flops == measured_peak_flops("cpu", torch.float32)


def test_a_known_gpu_is_stated_against_its_datasheet(monkeypatch) -> None:
    monkeypatch.setattr(peak, "emulated", lambda device, fmt: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    bf16 = stated_peak("cuda:0", "bf16")
    assert (bf16.flops, bf16.source) == (989.5e12, "datasheet H200 SXM")
    assert stated_peak("cuda:0", "fp8").flops == 1979e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA B200")
    unknown = stated_peak("cuda:0", "fp8")
    assert unknown.flops is None and unknown.describe().startswith("no fp8 peak (")


# --- rows and their notes ------------------------------------------------------------------------


def _row(variant, value, peak_text="fp32 peak 0.2 TFLOP/s, measured", flops=2e11):
    return SimpleNamespace(variant=variant, mfu=value, mfu_peak=peak_text, mfu_peak_flops=flops)


def test_mfu_above_100_percent_is_marked_and_explained_once() -> None:
    assert format_mfu(0.42) == "42.0%" and format_mfu(None) == "n/a"
    assert format_mfu(1.36) == "136.0%*"
    rows = [
        _row("baseline", 0.4),
        _row("tf32", 1.36),
        _row("bf16", 1.2, "bf16 peak 1 TFLOP/s", 1e12),
    ]
    assert peak_notes(rows) == [
        "MFU of baseline, tf32: against fp32 peak 0.2 TFLOP/s, measured",
        "MFU of bf16: against bf16 peak 1 TFLOP/s",
        OVER_PEAK_NOTE,
    ]
    assert OVER_PEAK_NOTE not in peak_notes(rows[:1])
    none = _row("float8", None, "no fp8 peak (not in the table)", None)
    assert peak_notes([none]) == ["MFU of float8: n/a, no fp8 peak (not in the table)"]


def test_bench_rows_carry_their_stated_peak(monkeypatch) -> None:
    from conftest import ConvNet, classification_loss

    from torchturbo.recipe import Recipe

    monkeypatch.setattr(
        peak, "emulated", lambda device, fmt: "no bf16 units" if fmt == "bf16" else None
    )
    x = torch.randn(32, 3, 8, 8)
    recipe = Recipe(
        name="tiny",
        model=ConvNet,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        loss_fn=classification_loss,
        dataset=torch.utils.data.TensorDataset(x, (x[:, 0].mean((1, 2)) > 0).long()),
        batch_size=8,
    )
    base = TurboConfig(device="cpu")
    configs = {"baseline": base, "bf16": base.replace(precision__dtype="bf16")}
    rows = compare_configs(recipe, configs, baseline="baseline", warmup=1, repeats=2)
    assert rows[0].mfu_peak_flops == rows[1].mfu_peak_flops  # one unit does both rows' maths
    assert rows[1].mfu_peak.endswith("(bf16 emulated)")
    assert rows[0].to_dict()["mfu_peak"] == rows[0].mfu_peak


@pytest.mark.slow
def test_bench_on_an_avx2_capped_cpu_says_once_up_front_that_bf16_is_emulated() -> None:
    command = [sys.executable, "-m", "torchturbo", "bench", TINY, "--device", "cpu", "--steps", "2"]
    done = subprocess.run(
        command, env=os.environ | AVX2_ONLY, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("note: this cpu emulates bf16:")  # before the table
    assert done.stdout.count("emulates bf16") == 1
    assert "MFU of fast: against fp32 peak" in done.stdout
    assert "(bf16 emulated)" in done.stdout


def test_doctor_says_once_up_front_that_bf16_is_emulated(monkeypatch, capsys) -> None:
    monkeypatch.setattr(native, "emulated", lambda device, fmt: f"{fmt} is slow here")
    assert main(["doctor", TINY, "--device", "cpu", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("note: this cpu emulates bf16") and out.count("emulates") == 1


def test_tune_names_the_emulated_candidate_formats_before_measuring(monkeypatch, capsys, tmp_path):
    search = importlib.import_module("torchturbo.tune.search.run")

    def stop(*args, **kwargs):
        raise ValueError("stopped before measuring")

    monkeypatch.setattr(native, "emulated", lambda device, fmt: None if fmt == "bf16" else "slow")
    monkeypatch.setattr(search, "tune", stop)
    assert main(["tune", TINY, "--device", "cpu", "--out", str(tmp_path)]) == 2
    out = capsys.readouterr().out
    assert "note: this cpu emulates tf32, fp16: expect no speedup from them" in out


def test_the_row_format_is_the_unit_doing_most_of_the_maths(monkeypatch) -> None:
    from conftest import MLP, ConvNet

    from torchturbo.trials.variants import row_format

    def trial(model, device="cuda", applied=None, **config):
        turbo = SimpleNamespace(applied=applied or {}, device=torch.device(device))
        return SimpleNamespace(turbo=turbo, config=TurboConfig().replace(**config), model=model)

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)  # torch's default
    assert row_format(trial(ConvNet()))[0] == "tf32"  # cuDNN convolutions in TF32 on CUDA
    assert row_format(trial(MLP()))[0] == "fp32"  # fp32 matmuls stay on CUDA cores
    assert row_format(trial(ConvNet(), device="cpu")) == ("fp32", "")
    assert row_format(trial(MLP(), applied={"float8": None}))[0] == "fp8"
    assert row_format(trial(MLP(), applied={"float8": "no GPU"}))[0] == "fp32"
    assert row_format(trial(ConvNet(), precision__dtype="bf16"))[0] == "bf16"
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    assert row_format(trial(ConvNet()))[0] == "fp32"
