"""DDP on 2 CPU processes over gloo, fed by BucketBatchSampler: the epoch finishes (equal batch
counts on both ranks, so no rank waits forever in an all-reduce) and token-weighted gradients
match a single process on the union of both ranks' batches."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "ddp_bucketing.py"
TIMEOUT_S = 120  # a DDP hang must fail the test, not stall the suite


def run_two_ranks(out_dir: Path) -> list[dict]:
    # --standalone makes torchrun pick a free port on localhost itself, so parallel runs do not
    # collide.
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(SCRIPT), str(out_dir)]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    # A new session so that on timeout the whole group (torchrun and its workers) is killed.
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"2-rank DDP run hung for {TIMEOUT_S}s:\n{output.decode()[-8000:]}")
    assert process.returncode == 0, output.decode()[-8000:]
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_ddp_epoch_over_bucketed_batches(tmp_path):
    rank0, rank1 = run_two_ranks(tmp_path)

    # The epoch has an odd number of global batches, so the sampler had to pad one rank's share;
    # both ranks ran every planned step of it.
    assert rank0["global_batches"] % 2 == 1
    assert rank0["planned_batches"] == rank1["planned_batches"] == rank0["steps"] == rank1["steps"]
    assert rank0["weights_in_sync"] and rank1["weights_in_sync"]
    # Batches are uneven: the two ranks' batches differ in shape and in real tokens.
    assert rank0["shapes"] != rank1["shapes"]
    tokens0, tokens1 = rank0["step0_tokens"]
    assert tokens0 != tokens1

    # fp32 sums taken in a different order: agreement to ~1e-6 of the gradient's size.
    tolerance = 1e-5 * rank0["grad_scale"]
    for result in (rank0, rank1):
        assert result["err_global_norm"] <= tolerance
        # Negative control: per-rank token means averaged by DDP are off by far more.
        assert result["err_local_mean"] > 100 * tolerance
