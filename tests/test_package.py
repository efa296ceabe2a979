"""The package a user installs: build the sdist and wheel, install the wheel outside the checkout.

A source checkout hides packaging mistakes (a C++ source left out of the wheel still compiles from
``src/``), so the wheel is built from a clean copy of the checkout, as from a fresh clone, and
installed into a fresh venv in a temporary directory. The venv borrows its dependencies (torch
above all) from the environment running the tests, through a ``.pth`` line, in the spirit of
``venv --system-site-packages``: installing torch again would cost a download of gigabytes and
prove nothing about torchturbo. The wheel itself is installed by pip, offline, with its declared
dependencies checked against what that path provides.

A second venv borrows everything but the packages of the extras (matplotlib, ninja): the lean
install a plain ``pip install torchturbo`` gives, in which ``tune`` must still work and say that
the report's plots were left out.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# What a fresh clone does not have (the .gitignore's list): builds must not depend on it.
_NOT_IN_A_CLONE = (".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "*.pyc")
_NOT_IN_A_CLONE += (".pytest_cache", ".ruff_cache", "out", "turbo-report")


def _run(command: list[str], cwd: Path, timeout: float, env: dict | None = None) -> str:
    result = subprocess.run(
        command,
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{' '.join(map(str, command))} failed:\n{output[-6000:]}"
    return output


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path | str]:
    """sdist and wheel built from a clean copy of the checkout, and the build's output."""
    pytest.importorskip("build", reason="the test extras' `build` builds the sdist and wheel")
    base = tmp_path_factory.mktemp("package")
    source = base / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*_NOT_IN_A_CLONE))
    # distutils warns that it cannot byte-compile when PYTHONDONTWRITEBYTECODE is set: that is
    # this environment's choice, not a packaging problem, and the check below reads warnings.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    command = [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(base / "dist")]
    log = _run([*command, str(source)], cwd=base, timeout=300, env=env)
    (wheel,) = (base / "dist").glob("*.whl")
    (sdist,) = (base / "dist").glob("*.tar.gz")
    return {"base": base, "source": source, "wheel": wheel, "sdist": sdist, "log": log}


@pytest.mark.slow
def test_the_build_prints_no_warning(built: dict) -> None:
    warnings = [line for line in built["log"].splitlines() if "warn" in line.lower()]
    assert not warnings, "\n".join(warnings)


@pytest.mark.slow
def test_wheel_and_sdist_carry_every_package_file_and_the_license(built: dict) -> None:
    src = built["source"] / "src"
    expected = {
        p.relative_to(src).as_posix()
        for p in (src / "torchturbo").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert "torchturbo/kernels/bias_gelu.cpp" in expected
    wheel = set(zipfile.ZipFile(built["wheel"]).namelist())
    assert expected <= wheel, sorted(expected - wheel)
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in wheel)
    metadata = zipfile.ZipFile(built["wheel"]).read(
        next(n for n in wheel if n.endswith(".dist-info/METADATA"))
    )
    assert b"License-Expression: Apache-2.0" in metadata
    with tarfile.open(built["sdist"]) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    for path in ("LICENSE", "src/torchturbo/kernels/bias_gelu.cpp", "tests/conftest.py"):
        assert path in names


_KERNEL_CHECK = """
import sys
from pathlib import Path

import torch
import torchturbo
from torchturbo.kernels import _build, bias_gelu, bias_gelu_reference, cpu_kernel_error

installed = Path(sys.prefix)
for path in (Path(torchturbo.__file__), _build._SOURCE):
    assert path.is_relative_to(installed), f"{path} is not inside the venv {installed}"
error = cpu_kernel_error()
assert error is None, error
assert any(_build.build_directory().rglob("*.so")), "no shared library was built"
x, bias = torch.randn(64, 256), torch.randn(256)
# fp32: the kernel and the composite differ by rounding only (see tests/test_kernels.py).
tol = {"rtol": 1e-5, "atol": 4e-6}
expected = bias_gelu_reference(x, bias)
torch.testing.assert_close(torch.ops.torchturbo_cpu.bias_gelu_forward(x, bias), expected, **tol)
torch.testing.assert_close(bias_gelu(x, bias), expected, **tol)
print("custom op built from", _build._SOURCE)
"""


#: What only the extras bring (torchturbo[plots], torchturbo[kernels]): absent from a lean venv.
_EXTRAS_ONLY = {"matplotlib", "mpl_toolkits", "pylab", "ninja"}


def _install_wheel(built: dict, name: str, borrowed: list[str]) -> Path:
    """A fresh venv outside the checkout, the wheel installed, dependencies from ``borrowed``."""
    venv = built["base"] / name
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=built["base"], timeout=60)
    python = venv / "bin" / "python"
    site = _run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        cwd=built["base"],
        timeout=60,
    ).strip()
    Path(site, "_borrowed_dependencies.pth").write_text("\n".join(borrowed) + "\n")
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index"]
    _run([*pip, str(built["wheel"])], cwd=built["base"], timeout=300)
    return venv


def _ours() -> list[str]:
    return list(dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib")))


@pytest.fixture(scope="module")
def venv(built: dict) -> Path:
    """The wheel in a fresh venv with every dependency and extra borrowed."""
    return _install_wheel(built, "venv", _ours())


@pytest.fixture(scope="module")
def lean_venv(built: dict) -> Path:
    """The wheel in a fresh venv without the extras' packages: every entry of this environment's
    site-packages linked into a directory of its own, but for theirs (and their metadata, so
    that pip sees them missing too)."""
    lean = built["base"] / "lean-dependencies"
    lean.mkdir()
    for site in map(Path, _ours()):
        for entry in site.iterdir():
            if re.split(r"[-.]", entry.name)[0].lower() not in _EXTRAS_ONLY:
                (lean / entry.name).symlink_to(entry)
    return _install_wheel(built, "lean-venv", [str(lean)])


@pytest.mark.slow
def test_installed_wheel_runs_outside_the_checkout(venv: Path, built: dict) -> None:
    cwd = built["base"]  # not the checkout: nothing can be imported from src/ by accident
    import torchturbo

    version = _run([str(venv / "bin" / "torchturbo"), "--version"], cwd=cwd, timeout=60)
    assert version.strip() == f"torchturbo {torchturbo.__version__}"

    env = os.environ | {"TORCHTURBO_KERNEL_DIR": str(cwd / "kernels")}
    output = _run(
        [str(venv / "bin" / "python"), "-c", _KERNEL_CHECK], cwd=cwd, timeout=300, env=env
    )
    assert str(venv) in output


@pytest.mark.slow
def test_without_extras_tune_works_and_says_the_plots_were_left_out(
    lean_venv: Path, built: dict
) -> None:
    cwd = built["base"]
    python = str(lean_venv / "bin" / "python")
    missing = subprocess.run([python, "-c", "import matplotlib"], capture_output=True, cwd=cwd)
    assert missing.returncode != 0, "the lean venv can import matplotlib: the test tests nothing"
    where = _run([python, "-c", "import torchturbo; print(torchturbo.__file__)"], cwd, 60)
    assert Path(where.strip()).is_relative_to(lean_venv), where  # the wheel's, not the checkout's
    out = cwd / "report"
    tune = [str(lean_venv / "bin" / "torchturbo"), "tune", "--workload", "text", "--device", "cpu"]
    said = _run([*tune, "--time-budget", "15s", "--out", str(out)], cwd=cwd, timeout=300)
    assert (out / "report.html").is_file() and (out / "turbo.toml").is_file()
    how = "matplotlib is not installed; pip install 'torchturbo[plots]'"
    assert f"plots left out of the report: {how}" in " ".join(said.split())
    assert f"The plots were left out: {how}" in (out / "report.md").read_text()
    assert not list(out.glob("*.png"))
