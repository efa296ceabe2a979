"""What torch.compile keeps: inductor's cache folder on disk, and the graphs built in this process.

A leaf of its own because the compile technique, the tuner (which compiles into a folder beside
the turbo.toml it writes, and reads how many graphs a candidate built) and the benchmarks all
need them, and none of them may reach into another.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

#: The environment variable inductor reads, at each compile, for its cache folder.
CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def use_compile_cache(directory: str) -> str | None:
    """Point inductor's cache at ``directory`` (created if missing) for what this process
    compiles from now on; the folder in use, or None when none is asked for.

    Inductor keeps compiled graphs, AOTAutograd's results and the built C++/Triton kernels
    there, and reuses them when the same graph compiles again, also in a later process: the
    first step after ``tune`` then loads instead of compiling. (torch's portable
    ``torch.compiler.save_cache_artifacts`` carries the graphs but, on CPU, not the built
    kernels, which it recompiles: measured 33 s against 75 s cold, where this folder took 10 s;
    see docs/techniques/compile.md.) A folder the user set in the environment wins.
    """
    if not directory:
        return None
    if _users_folder() is None:
        os.environ[CACHE_ENV] = str(Path(directory).resolve())
        _SET_HERE.add(os.environ[CACHE_ENV])
    Path(os.environ[CACHE_ENV]).mkdir(parents=True, exist_ok=True)
    return os.environ[CACHE_ENV]


#: The folders this process put into the variable: a later config's folder replaces them.
_SET_HERE: set[str] = set()


def cache_set_here() -> bool:
    """Whether the cache folder in the environment is one torchturbo set (not the user's)."""
    return os.environ.get(CACHE_ENV) in _SET_HERE


def _users_folder() -> str | None:
    """The cache folder the user chose, if any. Inductor writes its default into the variable
    the first time it asks (importing torchao does), so a value equal to that default is
    inductor's, not the user's; one set here for an earlier config is ours."""
    current = os.environ.get(CACHE_ENV)
    if current is None or current in _SET_HERE:
        return None
    try:  # TODO: a public API for the default folder, once torch has one
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:
        return current
    return None if os.path.abspath(current) == os.path.abspath(default_cache_dir()) else current


@contextlib.contextmanager
def compile_cache(directory: str) -> Iterator[str | None]:
    """:func:`use_compile_cache` for the duration of a block (the tuner's run), leaving the
    environment as it found it."""
    before = os.environ.get(CACHE_ENV)
    try:
        yield use_compile_cache(directory)
    finally:
        if before is None:
            os.environ.pop(CACHE_ENV, None)
        else:
            os.environ[CACHE_ENV] = before


def compiled_graphs() -> int | None:
    """Graphs torch.compile has built in this process so far (each recompile adds one); None
    before anything was compiled. Read from dynamo's counters, which have no public API yet.
    TODO: use a public counter once torch.compiler exposes one."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return None
    return int(utils.counters["stats"]["unique_graphs"])
