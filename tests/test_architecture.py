"""The package's shape: no import cycles, a root that holds only the public API, public names.

The import graph is read from the source (AST), not from ``sys.modules``: every ``import`` and
``from ... import`` anywhere in a module counts, inside ``if TYPE_CHECKING:`` and inside function
bodies too, because a type-only or deferred import that closes a cycle is still a cycle in the
design (it only moves the failure to another import order or to the type checker).
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "torchturbo"

# The modules the package root may hold besides __init__.py and __main__.py, and why each one
# is there rather than in a subpackage.
ROOT_MODULES = {
    "recipe": "public: Recipe, load_recipe and RecipeError, what users write (`file.py:recipe`)",
}


def _module_names(root: Path) -> dict[str, Path]:
    """Every module of the package, by dotted name (a package by its ``__init__``)."""
    names = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _imported(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``module`` imports, anywhere in its source.

    Importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first, so it depends on them
    too, except on the packages that hold ``module`` itself: they are being imported already.
    """
    is_package = path.name == "__init__.py"
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets.add(base)
            targets.update(f"{base}.{alias.name}" for alias in node.names)
    own = {*_ancestors(module), module}
    found = set()
    for target in targets:
        for name in [*_ancestors(target), target]:
            if name in modules and name not in own:
                found.add(name)
    return found


def import_graph(root: Path = SRC) -> dict[str, set[str]]:
    modules = _module_names(root)
    return {name: _imported(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle as ``[a, b, ..., a]``, or ``[]`` when the graph has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return []

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return []


def test_the_package_has_no_import_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def _reachable(graph: dict[str, set[str]], package: str) -> set[str]:
    """Every module that importing any module of ``package`` imports, directly or not."""
    pending = [m for m in graph if m == package or m.startswith(package + ".")]
    seen: set[str] = set()
    while pending:
        for imported in graph[pending.pop()] - seen:
            seen.add(imported)
            pending.append(imported)
    return seen


#: Every package and root module, lowest first: a module imports only from its own package and
#: from those before it (type-only and function-level imports included). The reason for each
#: floor is the package's docstring; the README's "Layout" block lists them in this order.
LAYERS = [
    "base",  # leaf helpers: nested batches, saved-tensor hooks, NHWC, stop signals
    "kernels",  # custom ops: need nothing of torchturbo
    "measure",  # timing, FLOPs, memory, the machine: read by everything above
    "output",  # units, tables, live lines, results files (with the machine's summary)
    "config",  # every section of turbo.toml (sizes in output's units, machine checks)
    "data",  # samplers, collates, the batch plan's types and token rule
    "recipe",  # what a user hands over (its collate and lengths are data's)
    "workloads",  # the built-in recipes
    "resume",  # checkpoint files on disk and their checks
    "techniques",  # framework, tools, the registered techniques, the registry
    "distributed",  # strategies (FSDP wraps checkpointing's blocks), launch, comm
    "reliability",  # OOM micro-batching, guard, resumable loader, preemption
    "engine",  # Turbo: setup, step, its loader and the run's state
    "trials",  # configs measured on a recipe through the engine
    "integrations",  # the Hugging Face and Lightning trainers
    "tune",  # the tuner (writes the trainers' settings)
    "doctor",  # the checklist (uses the tuner's comparison)
    "runs",  # torchturbo.train and its loggers
    "cli",
    "__main__",
]
#: Floors inside a package, lowest first ("" is the package's own modules). In ``techniques``:
#: what a technique declares, the unregistered tools, the registered techniques, and the registry
#: that finds them. In ``tune``: the memory planner, the batch finder, the loader grid, the search
#: that uses all three, and the report that reads the search's outcome.
INNER_FLOORS = {
    "techniques": ["framework", "tools", "", "registry"],
    "tune": ["memory", "batch", "loader", "", "search", "report"],
}
TECHNIQUE_FLOORS = INNER_FLOORS["techniques"]


def _floor(module: str) -> int:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else -1


def _inner_floor(module: str) -> tuple[str, int] | None:
    """(the package, the floor inside it) of a module of a package with inner floors."""
    parts = module.split(".")
    if len(parts) < 3 or parts[0] != PACKAGE or parts[1] not in INNER_FLOORS:
        return None
    floors = INNER_FLOORS[parts[1]]
    return parts[1], floors.index(parts[2] if parts[2] in floors else "")


def _technique_floor(module: str) -> int | None:
    inner = _inner_floor(module)
    return inner[1] if inner is not None and inner[0] == "techniques" else None


def test_every_package_has_a_floor() -> None:
    graph = import_graph()
    floors = {m.split(".")[1] for m in graph if m.count(".")}
    assert sorted(floors - set(LAYERS)) == [], "add the new package to LAYERS"
    assert sorted(set(LAYERS) - floors) == [], "stale entries in LAYERS"


@pytest.mark.parametrize("package", sorted(INNER_FLOORS))
def test_every_inner_package_has_a_floor(package: str) -> None:
    root = SRC / PACKAGE / package
    folders = {p.name for p in root.iterdir() if (p / "__init__.py").is_file()}
    listed = set(INNER_FLOORS[package]) - {""}
    assert sorted(folders - listed) == [], f"add the folder to INNER_FLOORS[{package!r}]"
    stale = {name for name in listed if name not in folders and not (root / f"{name}.py").exists()}
    assert sorted(stale) == [], f"stale entries in INNER_FLOORS[{package!r}]"


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a module on a higher floor, of the package or inside one of its packages."""
    found = []
    for module, imported in sorted(graph.items()):
        for target in sorted(imported):
            if _floor(target) > _floor(module):
                found.append(f"{module} -> {target}")
            mine, theirs = _inner_floor(module), _inner_floor(target)
            if (
                mine is not None
                and theirs is not None
                and mine[0] == theirs[0]
                and theirs[1] > mine[1]
            ):
                found.append(f"{module} -> {target}")
    return found


def test_a_lower_floor_never_imports_a_higher_one() -> None:
    assert upward_imports(import_graph()) == []


def test_the_floor_check_sees_an_upward_import(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "__init__.py": "",
            "data/__init__.py": "",
            "data/loader.py": "def f():\n    from torchturbo.engine.turbo import Turbo\n",
            "engine/__init__.py": "",
            "engine/turbo.py": "",
            "techniques/__init__.py": "",
            "techniques/framework/__init__.py": "",
            "techniques/framework/spec.py": "import torchturbo.techniques.registry\n",
            "techniques/registry.py": "",
            "tune/__init__.py": "",
            "tune/memory/__init__.py": "",
            "tune/memory/plan.py": "from torchturbo.tune.search.run import tune\n",
            "tune/search/__init__.py": "",
            "tune/search/run.py": "from torchturbo.tune.memory.plan import plan\n",
        },
    )
    assert upward_imports(import_graph(tmp_path)) == [
        "torchturbo.data.loader -> torchturbo.engine",
        "torchturbo.data.loader -> torchturbo.engine.turbo",
        "torchturbo.techniques.framework.spec -> torchturbo.techniques.registry",
        "torchturbo.tune.memory.plan -> torchturbo.tune.search",
        "torchturbo.tune.memory.plan -> torchturbo.tune.search.run",
    ]


def test_the_techniques_folder_holds_one_technique_per_module() -> None:
    """The package's own modules are techniques (each declares one); the framework and the
    tools are in their subfolders, and none of them declares one."""
    from torchturbo.techniques import registry

    root = SRC / PACKAGE / "techniques"
    for name in registry.technique_modules():
        module = importlib.import_module(f"torchturbo.techniques.{name}")
        assert hasattr(module, "TECHNIQUE") or hasattr(module, "TECHNIQUES"), name
    for folder in ("framework", "tools"):
        for path in (root / folder).glob("*.py"):
            text = path.read_text()
            assert "\nTECHNIQUE = " not in text and "\nTECHNIQUES = " not in text, path


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / PACKAGE / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.mark.parametrize(
    "files",
    [
        # type-only
        {
            "__init__.py": "",
            "a.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from torchturbo.b import B\n"
            ),
            "b.py": "import torchturbo.a\n",
        },
        # function-level, relative
        {
            "__init__.py": "",
            "a.py": "def f():\n    from . import b\n",
            "b.py": "from .a import f\n",
        },
        # through a package's __init__
        {
            "__init__.py": "",
            "p/__init__.py": "from torchturbo.p.inner import X\n",
            "p/inner.py": "from torchturbo.q import Y\n",
            "q.py": "from torchturbo.p.other import Z\n",
            "p/other.py": "",
        },
    ],
    ids=["type-only", "function-level-relative", "via-package-init"],
)
def test_the_cycle_check_sees_the_cycles_it_forbids(tmp_path: Path, files: dict[str, str]) -> None:
    _write(tmp_path, files)
    cycle = find_cycle(import_graph(tmp_path))
    assert cycle and cycle[0] == cycle[-1]


def test_the_cycle_check_accepts_a_package_importing_its_own_modules(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "__init__.py": "",
            "p/__init__.py": "from torchturbo.p.a import A\n",
            "p/a.py": "from torchturbo.p.b import B\nfrom . import b\n",
            "p/b.py": "",
        },
    )
    assert find_cycle(import_graph(tmp_path)) == []


def test_the_package_root_holds_only_the_public_api() -> None:
    present = {path.stem for path in (SRC / PACKAGE).glob("*.py")} - {"__init__", "__main__"}
    assert sorted(present - ROOT_MODULES.keys()) == [], "move these into a subpackage"
    assert sorted(ROOT_MODULES.keys() - present) == [], "stale entries in ROOT_MODULES"


PUBLIC_NAMES = {
    "torchturbo": [
        "__version__",
        "Turbo",
        "StepMetrics",
        "TurboConfig",
        "ConfigError",
        "Recipe",
        "load_recipe",
        "RecipeError",
        "train",
        "CheckpointError",
        "NonFiniteError",
        "MemoryBudgetError",
    ],
    "torchturbo.cli": ["main", "full_parser"],
    # The loader grid search joined the tuner (issue 23); it was `torchturbo.data.tune_loader`.
    "torchturbo.tune": ["tune", "TuneOptions", "tune_loader", "LoaderTuning", "LoaderTrial"],
    "torchturbo.techniques": [
        "apply_activation_checkpointing",
        "apply_channels_last",
        "apply_compile",
        "apply_float8_training",
        "rebuild_optimizer",
    ],
    "torchturbo.config": ["TurboConfig", "ConfigError", "DataConfig", "DistributedConfig"],
}


def _declared(module: str) -> list[str]:
    return list(importlib.import_module(module).__all__)


@pytest.mark.parametrize(
    "module",
    [
        *PUBLIC_NAMES,
        "torchturbo.data",
        "torchturbo.distributed",
        "torchturbo.integrations.transformers",
        "torchturbo.integrations.lightning",
    ],
)
def test_the_public_names_resolve(module: str) -> None:
    names = PUBLIC_NAMES.get(module) or _declared(module)
    imported = importlib.import_module(module)
    missing = [name for name in names if getattr(imported, name, None) is None]
    assert names and missing == []


def test_the_public_names_are_the_classes_users_know() -> None:
    import torchturbo
    from torchturbo.config import TurboConfig

    assert torchturbo.TurboConfig is TurboConfig
    assert torchturbo.Turbo.__name__ == "Turbo" and callable(torchturbo.train)
    assert issubclass(torchturbo.ConfigError, ValueError)
    for error in ("CheckpointError", "NonFiniteError", "MemoryBudgetError", "RecipeError"):
        assert issubclass(getattr(torchturbo, error), Exception), error
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = torchturbo.nope


def test_the_integrations_declare_their_public_names() -> None:
    assert {"TurboCallback", "TurboTrainer"} <= set(
        _declared("torchturbo.integrations.transformers")
    )
    assert "TurboLightningCallback" in _declared("torchturbo.integrations.lightning")


def _layout_entries(readme: Path) -> list[str]:
    """The modules and packages the README's layout block lists under src/torchturbo/, in
    order."""
    text = readme.read_text()
    start = text.index("```\nsrc/torchturbo/")
    entries = []
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("  "):
            break
        if line.startswith("   "):  # the description's second line
            continue
        names = line.strip().split("  ")[0]  # two spaces end the names, the description follows
        entries.extend(name.strip() for name in names.split(",") if name.strip())
    return entries


@pytest.mark.parametrize("readme", ["README.md", "README.zh-CN.md"])
def test_the_readme_layout_is_the_package(readme: str) -> None:
    root = SRC / PACKAGE
    present = {p.name for p in root.glob("*.py") if p.name != "__main__.py"} | {
        f"{p.name}/" for p in root.iterdir() if (p / "__init__.py").is_file()
    }
    listed = _layout_entries(SRC.parent / readme)
    assert sorted(present - set(listed)) == [], f"{readme}'s layout leaves these out"
    assert sorted(set(listed) - present) == [], f"{readme}'s layout lists what does not exist"
    floors = [entry.removesuffix("/").removesuffix(".py") for entry in listed[1:]]
    assert floors == LAYERS[: len(floors)], f"{readme} lists the floors out of order"


#: The registered techniques are reached through the registry and their framework only: a host
#: that imports one directly is a second route to it, which the registry's order and tests miss.
#: The tools (unregistered building blocks) may be used directly.
def technique_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a registered technique module from outside ``techniques``."""
    registered = TECHNIQUE_FLOORS.index("")
    return [
        f"{module} -> {target}"
        for module, imported in sorted(graph.items())
        if not module.startswith(f"{PACKAGE}.techniques")
        for target in sorted(imported)
        if _technique_floor(target) == registered
    ]


def test_nothing_outside_the_techniques_imports_a_technique_module() -> None:
    assert technique_imports(import_graph()) == []


def test_the_technique_import_check_sees_a_planted_import(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "__init__.py": "",
            "engine/__init__.py": "",
            "engine/turbo.py": "from torchturbo.techniques.precision import Precision\n",
            "techniques/__init__.py": "",
            "techniques/precision.py": "",
            "techniques/registry.py": "",
            "techniques/tools/__init__.py": "",
            "techniques/tools/accumulation.py": "",
            "doctor/__init__.py": "from torchturbo.techniques import registry\n"
            "from torchturbo.techniques.tools import accumulation\n",
        },
    )
    assert technique_imports(import_graph(tmp_path)) == [
        "torchturbo.engine.turbo -> torchturbo.techniques.precision"
    ]


def engine_names(root: Path = SRC) -> list[str]:
    """Technique names the engine's source spells out as strings: a technique named by the
    engine is driven by it rather than through the registry. ("optimizer" is the engine's own
    word too: the torch optimizer it steps, and the phase of the step so named.)"""
    from torchturbo.techniques import registry

    names = {t.name for t in registry.techniques()} - {"optimizer"}
    return [
        f"{path.name}:{node.lineno} {node.value!r}"
        for path in sorted((root / PACKAGE / "engine").glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and node.value in names
    ]


def test_the_engine_names_no_technique(tmp_path: Path) -> None:
    assert engine_names() == []
    # Negative control: the engine of a year ago, which asked for precision by name.
    _write(tmp_path, {"engine/turbo.py": 'result = results.get("precision")\n'})
    assert engine_names(tmp_path) == ["turbo.py:1 'precision'"]


def benchmark_imports(folder: Path) -> dict[str, set[str]]:
    """Which benchmark scripts each one imports (they import one another by bare name, as
    scripts run from the folder), anywhere in its source."""
    names = {path.stem for path in folder.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in folder.glob("*.py"):
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.add(node.module)
        graph[path.stem] = imported & names - {path.stem}
    return graph


def test_the_benchmarks_import_no_circle(tmp_path: Path) -> None:
    folder = SRC.parent / "benchmarks"
    cycle = find_cycle(benchmark_imports(folder))
    assert not cycle, "import cycle: " + " -> ".join(cycle)
    # Negative control: two scripts that import each other, one inside a function.
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from a import g\n")
    assert find_cycle(benchmark_imports(tmp_path)) == ["a", "b", "a"]
