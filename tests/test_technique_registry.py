"""Every registered technique, through the same tests (settings: ``technique_settings.py``).

- parity: trained with the technique, a short run matches the fp32 eager baseline within the
  technique's stated tolerance, and the technique took effect;
- negative controls: the baseline does not show the technique's effect (switched off), and the
  same comparison fails when the technique is broken (its model perturbed after composition);
- composition: with every other technique it stacks with, both take effect and the run stays
  within the larger tolerance;
- translation: each trainer's arguments carry it, or its callback applies it through the
  registry, and every field it changes is carried or noted.
"""

from __future__ import annotations

import ast
import dataclasses
import itertools
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from technique_settings import SETTINGS, Run, Setting, model_for, token_batches

from torchturbo import Turbo, TurboConfig
from torchturbo.base.compiler import CACHE_ENV
from torchturbo.config import ConfigError
from torchturbo.config.turbo import sections
from torchturbo.integrations.translate import hf_arguments, lightning_arguments
from torchturbo.techniques import registry
from torchturbo.techniques.framework.spec import Host

ROOT = Path(__file__).resolve().parents[1]
NAMES = [t.name for t in registry.techniques()]
STEPS = 3


@pytest.fixture(autouse=True)
def _own_compile_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts without an inductor cache folder in the environment (compile_cache's
    runs point it at their own; the variable outlives the test otherwise)."""
    monkeypatch.delenv(CACHE_ENV, raising=False)


def _marks(*settings: Setting) -> list[Any]:
    return [pytest.mark.slow] if any(s.slow for s in settings) else []


def _each() -> list[Any]:
    return [pytest.param(n, marks=_marks(SETTINGS[n]), id=n) for n in NAMES if n in SETTINGS]


def _skip_unavailable(*settings: Setting) -> None:
    for setting in settings:
        reason = setting.unavailable()
        if reason:
            pytest.skip(f"cannot take effect here: {reason}")


def _probe(
    model: torch.nn.Module, inputs: torch.Tensor, probes: list[dict[str, Any]], **kw: Any
) -> Any:
    output = model(inputs, **kw)
    probes.append({"output_dtype": output.dtype, "cudnn_benchmark": torch.backends.cudnn.benchmark})
    return output


def train(config: TurboConfig, setting: Setting, *, break_model: bool = False) -> Run:
    """A few steps from the same weights and batches; ``break_model`` perturbs the composed
    model's first parameter, as a technique that corrupted it would."""
    torch.manual_seed(0)
    if config.compile.mode != "off":  # from scratch: a graph an earlier test compiled is reused
        torch.compiler.reset()
    model = model_for(setting)
    if setting.optimizer is not None:
        optimizer = setting.optimizer(model.parameters())
    else:
        optimizer = torch.optim.SGD(
            model.parameters(), lr=0.0 if setting.data else 0.1, momentum=0.9
        )
    turbo = Turbo(config)
    probes: list[dict[str, Any]] = []
    losses: list[float] = []
    if setting.data:
        dataset, lengths = _token_samples()
        model, optimizer, loader = turbo.setup(
            model, optimizer, dataset, batch_size=4, lengths=lengths, shuffle=False
        )
        assert loader is not None
        batches: list[Any] = list(loader)
    elif setting.lm:
        model, optimizer, _ = turbo.setup(model, optimizer)
        batches = token_batches(STEPS)
    else:
        model, optimizer, _ = turbo.setup(model, optimizer)
        generator = torch.Generator().manual_seed(1)
        batches = [
            (torch.randn(8, 3, 16, 16, generator=generator), torch.randint(0, 4, (8,)))
            for _ in range(STEPS)
        ]
    if break_model:
        with torch.no_grad():
            next(iter(model.parameters())).mul_(3.0).add_(0.5)
    elements = 0
    weighted, counted = 0.0, 0.0
    for batch in batches:
        if setting.data:
            elements += batch["input_ids"].numel()

            def loss_fn(m: torch.nn.Module, b: dict[str, torch.Tensor]) -> Any:
                # Each token's logits are its document's: one row per sample, or a packed row
                # whose documents start where their positions restart.
                fields = {k: b[k] for k in ("position_ids", "document_ids") if k in b}
                logits = _probe(m, b["input_ids"], probes, **fields)
                starts = b["position_ids"] == 0 if "position_ids" in b else None
                per_sample = logits[:, 0] if starts is None else logits[starts]
                loss = torch.nn.functional.cross_entropy(per_sample.float(), b["label"])
                return loss, b["label"].numel()
        elif setting.lm:

            def loss_fn(m: torch.nn.Module, b: dict[str, torch.Tensor]) -> Any:
                output = m(**b)
                probes.append({"output_dtype": output.loss.dtype, "logits": output.logits})
                return output.loss
        else:

            def loss_fn(m: torch.nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> Any:
                logits = _probe(m, b[0], probes)
                return torch.nn.functional.cross_entropy(logits.float(), b[1])

        metrics = turbo.step(loss_fn, batch)
        weighted += float(metrics.loss) * float(metrics.count)
        counted += float(metrics.count)
        losses.append(float(metrics.loss))
    if setting.data:  # other batches: compare the epoch's mean over the same samples
        losses = [weighted / counted]
    parameters = [p.detach().float().clone() for p in model.parameters()]
    return Run(turbo, model, losses, parameters, probes, elements, batches[0], loss_fn)


def _token_samples() -> tuple[list[dict[str, Any]], list[int]]:
    rng = random.Random(0)
    lengths = [rng.choice([2, 3, 4, 30, 31, 32]) for _ in range(24)]
    samples = [
        {"input_ids": torch.tensor([rng.randrange(1, 50) for _ in range(n)]), "label": n % 3}
        for n in lengths
    ]
    return samples, lengths


def _difference(run: Run, baseline: Run) -> float:
    """Largest relative difference of the losses, and of each parameter tensor (by its norm)."""
    losses = [
        abs(a - b) / max(abs(b), 1e-8) for a, b in zip(run.losses, baseline.losses, strict=True)
    ]
    parameters = [
        float((a - b).norm() / b.norm().clamp(min=1e-12))
        for a, b in zip(run.parameters, baseline.parameters, strict=True)
    ]
    return max(losses + parameters)


def _compared(config: TurboConfig, setting: Setting, baseline: Run, **kw: Any) -> Run:
    run = train(config, setting, **kw)
    run.baseline, run.difference = baseline, _difference(run, baseline)
    return run


def _baseline(setting: Setting) -> Run:
    run = train(TurboConfig(device="cpu"), setting)
    run.baseline = run
    return run


def _config(*settings: Setting) -> TurboConfig:
    overrides: dict[str, Any] = {}
    for setting in settings:
        overrides |= setting.overrides()
    return TurboConfig(device="cpu").replace(**overrides)


def test_every_registered_technique_has_settings_a_doc_and_a_stage_or_lever_or_reason() -> None:
    assert sorted(SETTINGS) == sorted(NAMES), "add the technique to tests/technique_settings.py"
    for technique in registry.techniques():
        assert (ROOT / technique.doc).is_file(), f"{technique.name}: {technique.doc} is missing"
        assert technique.requested(_config(SETTINGS[technique.name])), technique.name
        assert not technique.requested(TurboConfig(device="cpu")), technique.name


@pytest.mark.parametrize("name", _each())
def test_parity_with_the_baseline_and_it_took_effect(name: str) -> None:
    setting = SETTINGS[name]
    _skip_unavailable(setting)
    baseline = _baseline(setting)
    run = _compared(_config(setting), setting, baseline)
    assert setting.took_effect(run), f"{name} did not take effect: {run.turbo.applied}"
    assert run.difference <= setting.tolerance, (
        f"{name}: differs from the baseline by {run.difference:.3g} > {setting.tolerance:g}"
    )


@pytest.mark.parametrize("name", _each())
def test_negative_controls_switched_off_and_broken(name: str) -> None:
    setting = SETTINGS[name]
    _skip_unavailable(setting)
    baseline = _baseline(setting)
    assert not setting.took_effect(baseline), f"{name}'s observable holds without it"
    broken = _compared(_config(setting), setting, baseline, break_model=True)
    assert broken.difference > setting.tolerance, f"{name}: a broken run passed parity"


def _pairs() -> list[Any]:
    stacking = [n for n in NAMES if n in SETTINGS and SETTINGS[n].stacks is True]
    return [
        pytest.param(a, b, marks=_marks(SETTINGS[a], SETTINGS[b]), id=f"{a}+{b}")
        for a, b in itertools.combinations(stacking, 2)
    ]


@pytest.mark.parametrize(("first", "second"), _pairs())
def test_composition_with_every_technique_it_stacks_with(first: str, second: str) -> None:
    a, b = SETTINGS[first], SETTINGS[second]
    _skip_unavailable(a, b)
    # The pair trains with the optimizer either asks for (an optimizer technique's), baseline too.
    trained = dataclasses.replace(a, optimizer=a.optimizer or b.optimizer)
    baseline = _baseline(trained)
    run = _compared(_config(a, b), trained, baseline)
    refusing = [
        n for n, s, other in ((first, a, second), (second, b, first)) if other in s.excludes
    ]
    if refusing:  # it does not apply beside the other, and must tell the user why
        assert all(run.turbo.applied.get(n) for n in refusing), run.turbo.applied
        return
    assert a.took_effect(run) and b.took_effect(run), run.turbo.applied
    assert run.difference <= max(a.tolerance, b.tolerance)


def test_a_technique_that_does_not_stack_says_why() -> None:
    for name, setting in SETTINGS.items():
        assert setting.stacks is True or len(str(setting.stacks)) > 20, name


_TRANSLATIONS = {"transformers": hf_arguments, "lightning": lightning_arguments}


@pytest.mark.parametrize("host", ["transformers", "lightning"])
@pytest.mark.parametrize("name", _each())
def test_each_trainer_carries_it_or_its_callback_applies_it(name: str, host: Host) -> None:
    """The translation of a config with the technique, against the baseline's: either the
    trainer's own arguments change (it carries it), or the callback's registry calls apply it;
    and every field it changes is carried or noted."""
    technique, setting = registry.technique(name), SETTINGS[name]
    config = _config(setting)
    translate = _TRANSLATIONS[host]
    before, after = translate(TurboConfig(device="cpu")), translate(config)
    new_kwargs = {k: v for k, v in after.kwargs.items() if before.kwargs.get(k) != v}
    noted = {
        key.split("] ", 1)[1] for key in after.notes if key.startswith(f"[{technique.section}]")
    }
    for field in technique.changed_fields(config):
        assert field in noted or new_kwargs, f"[{technique.section}] {field} is lost for {host}"
    if technique.carried(host, config) is not None:
        assert new_kwargs, f"{name}: {host} is said to carry it, but no argument changed"
        return
    if technique.transform is None and technique.switch is None:
        return  # nothing a callback could apply: the notes above tell the user
    _skip_unavailable(setting)
    model = model_for(setting)
    results = registry.compose_model(model, config, torch.device("cpu"), host)
    with registry.held_switches(config, torch.device("cpu"), host, results):
        pass
    assert name in results and results[name].applied, results.get(name)


def test_the_engine_and_the_callbacks_compose_by_one_function_and_one_order() -> None:
    """No model transform is called outside its technique: each ``apply_*`` function is called
    from one module of src/, and the callbacks and the engine call registry.compose_model."""
    callers: dict[str, set[str]] = {}
    composers = set()
    for path in (ROOT / "src" / "torchturbo").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            if name and name.startswith("apply_"):
                callers.setdefault(name, set()).add(path.name)
            if name == "compose_model":
                composers.add(path.relative_to(ROOT / "src" / "torchturbo").as_posix())
    shared = {name: sorted(where) for name, where in callers.items() if len(where) > 1}
    assert not shared, f"apply_* called from several modules: {shared}"
    assert {"compose.py", "integrations/lightning.py", "integrations/transformers.py"} <= {
        Path(c).as_posix().removeprefix("engine/") for c in composers
    }, composers


def test_every_section_refuses_a_bad_value_of_every_field() -> None:
    """Every section, a technique's own too, is validated: a table where a value belongs is
    refused with the section and field named."""
    for section, section_type in sections().items():
        for field in dataclasses.fields(section_type):
            with pytest.raises(ConfigError, match=rf"\[{section}\] {field.name} = "):
                TurboConfig.from_dict({section: {field.name: {"a": 1}}})


def test_every_technique_has_its_own_place_in_the_one_order_and_says_why() -> None:
    techniques = registry.techniques()
    assert [t.order for t in techniques] == sorted(t.order for t in techniques)
    assert len({t.order for t in techniques}) == len(techniques), "two techniques share a place"
    assert all(len(t.order_reason) > 30 for t in techniques)
    transforms = [t.name for t in techniques if t.transform is not None]
    assert transforms == [
        "liger_kernel",
        "float8",
        "channels_last",
        "checkpointing",
        "chunked_loss",
        "compile",
        "regional_compile",
    ]


def test_two_techniques_in_one_place_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchturbo.techniques.framework.spec import Technique

    clash = Technique(
        name="clash",
        section="backend",
        doc="CONTRIBUTING.md",
        requested=lambda config: False,
        order=registry.technique("compile").order,
        order_reason="the same place as compile, which the registry must refuse",
    )
    registry.techniques.cache_clear()
    real = registry.technique_modules()
    monkeypatch.setattr(registry, "technique_modules", lambda: [*real, "clash_module"])
    import sys
    import types

    module = types.ModuleType("torchturbo.techniques.clash_module")
    module.TECHNIQUE = clash  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torchturbo.techniques.clash_module", module)
    try:
        with pytest.raises(RuntimeError, match="the same order"):
            registry.techniques()
    finally:
        registry.techniques.cache_clear()


def test_a_registered_technique_reaches_every_host_without_editing_them(monkeypatch) -> None:
    """A technique added only to the registry is composed by the engine and both callbacks
    and translated for both trainers (the promise CONTRIBUTING.md makes)."""
    from torchturbo.techniques.framework.result import applied
    from torchturbo.techniques.framework.spec import Technique

    seen: list[str] = []

    def transform(model: torch.nn.Module, config: Any, device: torch.device) -> Any:
        seen.append("transform")
        return applied("probe")

    probe = Technique(
        name="probe",
        section="backend",
        doc="CONTRIBUTING.md",
        requested=lambda config: config.backend.cudnn_benchmark,
        transform=transform,
        order=25,
        order_reason="between channels_last and checkpointing, to show the order is the spec's",
    )
    techniques = registry.techniques()
    monkeypatch.setattr(registry, "techniques", lambda: (*techniques, probe))
    config = TurboConfig(device="cpu").replace(backend__cudnn_benchmark=True)
    for host in ("engine", "transformers", "lightning"):
        results = registry.compose_model(
            model_for(SETTINGS["channels_last"]), config, torch.device("cpu"), host
        )
        assert results["probe"].applied, host
    assert seen == ["transform"] * 3


@pytest.mark.parametrize("name", NAMES)
def test_the_tuners_confirmation_replays_every_techniques_change(name: str) -> None:
    """The confirmation rebuilds each adoption from its changes: every field a technique's
    setting changes must be among them, or the adopted technique would be dropped."""
    from torchturbo.tune.search.confirm import _changes

    config = _config(SETTINGS[name])
    changed = _changes(TurboConfig(device="cpu"), config)
    assert set(SETTINGS[name].overrides()) <= set(changed), changed
    assert TurboConfig(device="cpu").replace(**changed) == config
