"""Regional compile under FSDP2 on 2 processes (tests/test_regional_compile.py).

    python -m torch.distributed.run --standalone --nproc-per-node 2 regional_fsdp.py OUT_DIR

Trains a stack of identical residual blocks with FSDP, eager and with ``[compile] scope =
"blocks"`` (compiled, then sharded block by block: the engine's one order), from the same weights
on the same per-rank batches; each rank writes the losses, the full parameters' largest
difference, whether every block ran compiled and the graphs dynamo built.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from torchturbo.base.compiler import compiled_graphs
from torchturbo.config import TurboConfig
from torchturbo.distributed import init_distributed, shutdown
from torchturbo.engine import Turbo


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    # The squeeze outside the model: an FSDP root returning a view warns (in-place ops on it).
    return torch.nn.functional.mse_loss(model(batch[0]).squeeze(-1), batch[1])


def run(config: TurboConfig, rank: int) -> dict:
    torch.manual_seed(0)
    model = Stack()
    blocks = list(model.layers)
    turbo = Turbo(config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    turbo.setup(model, optimizer)
    generator = torch.Generator().manual_seed(10 + rank)
    losses = []
    for _ in range(3):
        batch = (torch.randn(4, 8, generator=generator), torch.randn(4, generator=generator))
        losses.append(float(turbo.step(loss_fn, batch).loss))
    params = []
    for p in turbo.model.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        params.append(full.detach().clone())
    return {
        "losses": losses,
        "params": params,
        "applied": turbo.applied,
        "compiled": all(b._compiled_call_impl is not None for b in blocks),
    }


def main() -> None:
    out_dir = Path(sys.argv[1])
    torch.set_num_threads(1)
    env = init_distributed("cpu")
    fsdp = TurboConfig(device="cpu").replace(distributed__strategy="fsdp")
    eager = run(fsdp, env.rank)
    regional = run(fsdp.replace(compile__mode="default", compile__scope="blocks"), env.rank)
    difference = max(
        float((a - b).abs().max()) for a, b in zip(eager["params"], regional["params"], strict=True)
    )
    result = {
        "eager_losses": eager["losses"],
        "regional_losses": regional["losses"],
        "param_difference": difference,
        "applied": regional["applied"],
        "compiled": regional["compiled"],
        "graphs": compiled_graphs(),
    }
    dist.barrier()
    (out_dir / f"rank{env.rank}.json").write_text(json.dumps(result, indent=1))
    shutdown()


if __name__ == "__main__":
    main()
