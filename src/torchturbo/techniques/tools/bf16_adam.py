"""Adam and AdamW with their two moments stored in bfloat16, stochastically rounded.

Half the bytes of float32 moments. Round-to-nearest would not do: bf16 keeps 8 bits of
mantissa, so ``exp_avg_sq``'s step with beta2 = 0.999 (a change of 0.1% of the gap to the new
squared gradient) rounds back to the old value whenever the gap is under ~40% of it, and the
second moment freezes. Stochastic rounding rounds up with the probability of the lost fraction,
so every stored moment is right in expectation (torchao's ``_fp32_to_bf16_sr`` does the same for
bf16 *parameters*; its optimizers keep a float32 parameter's moments in float32, hence this
module). The update is computed in float32 from the moments widened back, as torch's AdamW
computes it, and written to the parameter in its own dtype.

The rounding noise comes from the optimizer's own generator (seeded, per device), so that
training draws the same dropout masks and data order with it as without; a resumed run restarts
that stream (the noise, not the moments, which the state dict holds).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

#: The generator's seed: any fixed value, so that two runs round alike.
SEED = 0x5EED


def stochastic_round_bf16(value: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``value`` (float32) in bfloat16, rounded up or down with the probability of the 16 low
    bits it loses: add 16 random bits to the float32 pattern, then drop them (a carry into the
    kept bits is the rounding up; the sign bit is apart, so negative values round alike)."""
    bits = value.contiguous().view(torch.int32)
    noise = torch.randint(
        0, 1 << 16, bits.shape, dtype=torch.int32, device=bits.device, generator=generator
    )
    rounded = (bits + noise).bitwise_and_(-65536)  # 0xFFFF0000: the bf16 part of the pattern
    return rounded.view(torch.float32).to(torch.bfloat16)  # exact: the low bits are zero


class AdamBf16(torch.optim.Optimizer):
    """Adam (``decoupled=False``, L2 weight decay) or AdamW (``decoupled=True``) with bf16
    moments; the other hyper-parameters are torch's."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        decoupled: bool = True,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(
                f"AdamBf16(lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}): "
                "expected lr, eps, weight_decay >= 0 and betas in [0, 1)"
            )
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            # A group setting, so that a copy built from the groups (the tuner's per-trial
            # rebuild, ``integrations.optimizers``) keeps it.
            "decoupled": decoupled,
        }
        super().__init__(params, defaults)
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(SEED)
        return self._generators[device]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._update(param, group)
        return loss

    def _update(self, param: torch.Tensor, group: dict[str, Any]) -> None:
        assert param.grad is not None  # step() updates only parameters with a gradient
        if param.grad.is_sparse:
            raise RuntimeError("AdamBf16 does not support sparse gradients")
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(param, dtype=torch.bfloat16)
            state["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.bfloat16)
        state["step"] += 1
        step = float(state["step"])
        lr, (beta1, beta2) = group["lr"], group["betas"]
        eps, decay = group["eps"], group["weight_decay"]
        value = param.float()
        grad = param.grad.float()
        if decay and group["decoupled"]:
            value.mul_(1 - lr * decay)
        elif decay:
            grad = grad.add(value, alpha=decay)
        exp_avg = state["exp_avg"].float().lerp_(grad, 1 - beta1)
        exp_avg_sq = state["exp_avg_sq"].float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias1, bias2 = 1 - beta1**step, 1 - beta2**step
        denominator = (exp_avg_sq.sqrt() / math.sqrt(bias2)).add_(eps)
        value.addcdiv_(exp_avg, denominator, value=-lr / bias1)
        param.copy_(value)
        generator = self._generator(param.device)
        state["exp_avg"].copy_(stochastic_round_bf16(exp_avg, generator))
        state["exp_avg_sq"].copy_(stochastic_round_bf16(exp_avg_sq, generator))
