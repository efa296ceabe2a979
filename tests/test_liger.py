"""Liger-Kernel (``[liger_kernel] enabled``): not applicable, with the reason, where it cannot
run (this CPU machine: no CUDA, no liger-kernel); on a GPU with the package, parity with eager.

The registry's tests skip it (their runs are on the CPU); its translation to the Trainer's
``use_liger_kernel=True`` is checked by them and below.
"""

from __future__ import annotations

import pytest
import torch
from conftest import cpu_stage_context
from technique_settings import tiny_llama, token_batches

from torchturbo import Turbo, TurboConfig
from torchturbo.integrations.translate import hf_arguments, lightning_arguments
from torchturbo.recipe import Recipe
from torchturbo.techniques import registry
from torchturbo.techniques.liger import apply_liger_kernel, liger_stage, liger_unavailable

ON = TurboConfig(device="cpu").replace(liger_kernel__enabled=True)


def _recipe() -> Recipe:
    return Recipe(
        name="llama",
        model=tiny_llama,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        loss_fn=lambda model, batch: model(**batch).loss,
        dataset=token_batches(2),  # type: ignore[arg-type]
        batch_size=1,
    )


def test_on_a_cpu_it_is_not_applicable_and_says_why():
    reason = liger_unavailable("cpu")
    assert reason is not None and "CUDA" in reason
    result = apply_liger_kernel(tiny_llama(), "cpu")
    assert not result.applied and result.reason == reason
    assert liger_stage(cpu_stage_context(_recipe())) == reason  # the tuner: "not applicable"


def test_the_doctor_ranks_it_not_applicable_with_the_reason():
    facts = cpu_stage_context(_recipe()).facts
    lever = next(lever for lever in registry.ranked_levers(facts) if lever.name == "Liger-Kernel")
    assert lever.expectation.gain is None and "CUDA" in lever.expectation.evidence


def test_the_engine_reports_it_not_applied_and_trains_as_before():
    model = tiny_llama()
    turbo = Turbo(ON)
    turbo.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert "CUDA" in str(turbo.applied["liger_kernel"])


def test_the_trainer_gets_use_liger_kernel_and_lightning_the_callback():
    assert hf_arguments(ON).kwargs["use_liger_kernel"] is True
    assert "use_liger_kernel" not in lightning_arguments(ON).kwargs
    assert registry.technique("liger_kernel").carried("lightning", ON) is None


def test_without_the_package_a_gpu_says_how_to_install_it(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "liger_kernel" else real(name, *a),
    )
    assert "pip install 'torchturbo[liger]'" in str(liger_unavailable("cuda"))


@pytest.mark.skipif(liger_unavailable("cuda") is not None, reason=str(liger_unavailable("cuda")))
def test_on_a_gpu_it_patches_the_model_and_keeps_the_losses():
    def train(config: TurboConfig) -> tuple[list[float], torch.nn.Module]:
        torch.manual_seed(0)
        model = tiny_llama()
        turbo = Turbo(config)
        model, _, _ = turbo.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        losses = [float(turbo.step(lambda m, b: m(**b).loss, b).loss) for b in token_batches(3)]
        assert all(reason is None for reason in turbo.applied.values()), turbo.applied
        return losses, model

    cuda = TurboConfig(device="cuda")
    eager, _ = train(cuda)
    liger, model = train(cuda.replace(liger_kernel__enabled=True))
    assert any("Liger" in type(m).__name__ for m in model.modules())
    # Triton's float32 kernels (RMSNorm, SwiGLU, fused cross-entropy) sum in other orders.
    assert liger == pytest.approx(eager, rel=1e-4)
