"""Compile the C++ CPU kernels on first use with ``torch.utils.cpp_extension.load``.

Compilation takes tens of seconds, so it happens lazily (the first call of a custom op on CPU,
never at import) and once per process (``functools.cache``); the object files are cached on disk,
keyed by torch version and CPU, so later processes load in well under a second. ``load_inline``
itself rebuilds when the source or the flags change. Set ``TORCHTURBO_KERNEL_DIR`` to move the
cache (e.g. to a shared or scratch disk).

``load`` on a source file rather than ``load_inline``: ``load_inline`` always prepends
``#include <torch/extension.h>`` (all of ATen plus pybind11), which doubles the cold build. The
source registers its operators with ``TORCH_LIBRARY`` (no Python binding needed), so loading the
shared library is enough to make ``torch.ops.torchturbo_cpu.*`` callable.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
from pathlib import Path

_SOURCE = Path(__file__).with_name("bias_gelu.cpp")
#: How to get the build tool where it is missing (torch.utils.cpp_extension builds with it).
NINJA_EXTRA = "pip install 'torchturbo[kernels]' (or pip install ninja)"


def _cpu_tag() -> str:
    """A short hash of the CPU's feature flags: -march=native objects must not travel to an older
    CPU (e.g. a build directory carried to another machine)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        flags = next(line for line in lines if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return hashlib.sha1(flags.encode()).hexdigest()[:8]


def build_directory() -> Path:
    """Where the compiled extension is cached."""
    import torch

    root = os.environ.get("TORCHTURBO_KERNEL_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "torchturbo" / "kernels"
    return base / f"torch{torch.__version__.replace('+', '_')}-{platform.machine()}-{_cpu_tag()}"


def _cflags() -> list[str]:
    flags = ["-O3", "-fno-math-errno"]
    # Native tuning lets gcc use AVX-512 (or AVX2) for the erf/exp loops; the cache key carries
    # the CPU flags so this is safe.
    if platform.machine() in ("x86_64", "AMD64"):
        flags.append("-march=native")
    return flags


@functools.cache
def cpu_kernel_error() -> str | None:
    """Build (first time) and load the C++ kernels, registering ``torch.ops.torchturbo_cpu.*``.

    Returns None on success, or why the build failed (no compiler, no ninja, a compile error);
    the outcome is cached, so a failing build is tried once per process, not once per call.
    """
    from torch.utils.cpp_extension import is_ninja_available, load

    if not is_ninja_available():  # an extra since ninja left the dependencies: say how to get it
        return f"ninja is not installed; {NINJA_EXTRA} builds the C++ op"

    directory = build_directory()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        load(
            name="torchturbo_cpu_kernels",
            sources=[str(_SOURCE)],
            extra_cflags=_cflags(),
            build_directory=str(directory),
            is_python_module=False,
            verbose=False,
        )
    except (OSError, RuntimeError) as error:  # cpp_extension reports build failures as these
        return f"{type(error).__name__}: {error}"
    return None


def load_cpu_kernels() -> None:
    """Build (first time) and load the C++ kernels; raise RuntimeError if they cannot be built."""
    error = cpu_kernel_error()
    if error is not None:
        raise RuntimeError(
            f"torchturbo C++ kernels could not be built in {build_directory()} "
            f"(needs g++ and ninja): {error}"
        )
