"""DDP on 2 CPU processes over gloo, fed by BucketBatchSampler: the epoch finishes (equal batch
counts on both ranks, so no rank waits forever in an all-reduce) and token-weighted gradients
match a single process on the union of both ranks' batches."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_two_ranks

SCRIPT = Path(__file__).parent / "scripts" / "ddp_bucketing.py"
TIMEOUT_S = 120  # a DDP hang must fail the test, not stall the suite


@pytest.mark.slow
def test_ddp_epoch_over_bucketed_batches(tmp_path):
    (rank0, rank1), _ = run_two_ranks(SCRIPT, tmp_path, TIMEOUT_S)

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
