"""The batch finder under torchrun, 2 CPU processes over gloo (tests/test_batch_finder.py).

    python -m torch.distributed.run --standalone --nproc-per-node 2 batch_finder_ranks.py OUT_DIR

Each rank measures the tiny recipe's step footprint at micro-batches of 2 and 4 (DDP trials),
then runs the finder with a budget of its own: rank 0's holds a micro-batch of 4, rank 1's only
2. Each writes OUT_DIR/rank{r}.json with its budget, those footprints and the plan it ended with.
"""

from __future__ import annotations

import faulthandler
import json
import sys
from pathlib import Path

from torchturbo import TurboConfig
from torchturbo.distributed import launched
from torchturbo.tune.batch.probe import find_batch, step_footprint

sys.path.insert(0, str(Path(__file__).parents[1] / "recipes"))
from tiny import recipe  # the recipes folder is not a package


def main(out_dir: Path) -> None:
    faulthandler.enable()
    with launched("cpu") as env:
        tiny, config = recipe(), TurboConfig(device="cpu")
        two, four = step_footprint(tiny, config, 2), step_footprint(tiny, config, 4)
        assert two is not None and four is not None
        budget = four if env.rank == 0 else two
        chosen = find_batch(tiny, budget, config=config)
        result = {"rank": env.rank, "budget": budget, "two": two, "four": four}
        result["plan"] = chosen.to_dict()
        (out_dir / f"rank{env.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
