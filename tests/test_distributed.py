"""torchturbo.distributed: launch helpers in-process; DDP, comm hooks, FSDP2 and pipelining on
2 CPU processes over gloo, all checks in one bounded torchrun launch (tests/scripts/dist_checks.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import run_two_ranks, torchrun_two
from torch import nn

from torchturbo.distributed import (
    balanced_boundaries,
    check_comm_hook,
    init_distributed,
    measured_child_seconds,
    read_launch_env,
    split_sequential,
)

SCRIPT = Path(__file__).parent / "scripts" / "dist_checks.py"
TINY_RECIPE = Path(__file__).parent / "recipes" / "tiny.py"
TIMEOUT_S = 120  # a collective waiting for a peer must fail the test, not stall the suite

FULL_ENV = {
    "RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "1",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
}


def test_launch_env_is_read_whole_or_not_at_all():
    assert read_launch_env({}) is None
    env = read_launch_env(FULL_ENV)
    assert (env.rank, env.local_rank, env.world_size) == (1, 1, 2)
    assert env.is_distributed


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"RANK": "0", "WORLD_SIZE": "2"}, "half set up"),
        ({k: v for k, v in FULL_ENV.items() if k != "MASTER_PORT"}, "['MASTER_PORT'] are not"),
        (FULL_ENV | {"RANK": "2"}, "RANK = 2 is invalid for WORLD_SIZE = 2"),
        (FULL_ENV | {"WORLD_SIZE": "two"}, "WORLD_SIZE = 'two' is invalid"),
    ],
)
def test_half_set_launch_env_is_a_clear_error(environ, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        read_launch_env(environ)


def test_one_gpu_index_for_every_rank_is_refused(monkeypatch):
    for name, value in FULL_ENV.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="each process uses GPU LOCAL_RANK"):
        init_distributed("cuda:1")


def test_comm_hook_names_and_backends_are_validated_up_front():
    check_comm_hook("bf16", "nccl")
    check_comm_hook("fp16", "gloo")
    with pytest.raises(ValueError, match="needs the NCCL backend"):
        check_comm_hook("powersgd_bf16", "gloo")
    with pytest.raises(ValueError, match="'powersgd_fp16'"):
        check_comm_hook("int8", "gloo")


def test_pipeline_split_balances_parameters_at_child_boundaries():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    # The first Linear holds 4160 of 4824 parameters: it is a stage of its own.
    assert balanced_boundaries(model, 2) == [1]
    assert [len(s) for s in split_sequential(model, 3)] == [1, 1, 2]
    stages = split_sequential(model, 2, boundaries=[3])
    assert [len(s) for s in stages] == [3, 1]
    assert stages[1][0] is model[3]  # the same modules, not copies
    with pytest.raises(ValueError, match="boundaries"):
        split_sequential(model, 2, boundaries=[0])
    with pytest.raises(ValueError, match="expected 1 to the model's 4 children"):
        split_sequential(model, 5)
    with pytest.raises(ValueError, match=r"nn\.Sequential"):
        split_sequential(nn.ModuleList([nn.Linear(2, 2)]), 1)


def test_pipeline_balanced_by_measured_time_gives_heavy_convolutions_their_own_stage():
    model = nn.Sequential(
        nn.Conv2d(16, 16, 3, padding=1),  # 2,320 parameters, the largest feature maps: the cost
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 512),  # 8,704 parameters applied to 4 vectors: next to free
        nn.Linear(512, 16),
    )
    sample = torch.randn(4, 16, 128, 128)
    # Medians of 5: a busy machine's preemptions must hit most repeats of a Linear to flip it.
    seconds = measured_child_seconds(model, sample, repeats=5)
    assert seconds[0] == max(seconds)
    assert balanced_boundaries(model, 2, seconds) == [1]
    assert balanced_boundaries(model, 2) == [4]  # by parameter count: the Linears dominate
    assert all(p.grad is None for p in model.parameters())  # the measurement left no gradients
    with pytest.raises(ValueError, match="2 costs given for a model with 5 children"):
        balanced_boundaries(model, 2, [1.0, 2.0])


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_two_ranks(SCRIPT, tmp_path_factory.mktemp("dist"), TIMEOUT_S)


@pytest.mark.slow
def test_process_group_is_gloo_and_only_rank_zero_prints(two_ranks):
    results, output = two_ranks
    assert [r["backend"] for r in results] == ["gloo", "gloo"]
    assert [line for line in output.splitlines() if "MAIN_PRINT_MARK" in line] == [
        "MAIN_PRINT_MARK from rank 0"
    ]


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
def test_ddp_accumulation_over_unequal_counts_equals_one_process(two_ranks, rank):
    result = two_ranks[0][rank]["accumulation"]
    # fp32 sums in another order over 2 SGD steps: agreement to ~1e-6 of the parameters' size.
    tolerance = 1e-5 * result["grad_scale"]
    assert result["err_exact"] <= tolerance
    assert result["err_fsdp"] <= tolerance  # FSDP2, same normalization, same parameters
    # Clipping clips the global mean gradient, under DDP and over FSDP's shards alike (control:
    # the clipped reference is far from the unclipped one, so clipping was active).
    assert result["err_clipped_ddp"] <= tolerance and result["err_clipped_fsdp"] <= tolerance
    assert result["clipping_changed_result"] is True
    # Negative control: DDP averaging locally normalized gradients is far off.
    assert result["err_local"] > 1000 * tolerance
    # no_sync: one reduction per window (2 windows), and the first micro-step's gradients stay
    # local (they differ across ranks); without it, every micro-step reduces and they agree.
    assert result["reductions_no_sync"] == 2
    assert result["reductions_every_step"] == 4
    assert result["first_grads_differ_no_sync"] is True
    assert result["first_grads_differ_every_step"] is False


@pytest.mark.slow
def test_compression_hooks_send_fewer_bytes_and_still_train(two_ranks):
    hooks = two_ranks[0][0]["hooks"]
    assert hooks["bytes_fp16"] * 2 == hooks["bytes_none"]
    # fp16 keeps ~3 significant digits of each averaged gradient: one SGD step moves the
    # parameters by lr x grad, so the difference stays far below the parameters' size.
    assert hooks["fp16_param_error"] <= 1e-4 * hooks["param_scale"]
    # PowerSGD sends everything during warm-up, then exactly P and Q (and 1-D tensors).
    assert hooks["bytes_powersgd_warmup"] == hooks["bytes_none"]
    assert hooks["bytes_powersgd"] == hooks["bytes_powersgd_expected"]
    assert hooks["bytes_powersgd"] < 0.2 * hooks["bytes_none"]
    assert hooks["bytes_powersgd_fp16"] * 2 == hooks["bytes_powersgd"]
    losses = hooks["powersgd_losses"]
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5
    assert "needs the NCCL backend" in hooks["bf16_error"]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_stages_match_the_unsplit_model(two_ranks, schedule):
    first, last = (r["pipeline"][schedule] for r in two_ranks[0])
    assert first["stage_children"] == last["stage_children"] == 2
    assert first["loss"] is None
    # Mean of 4 equal micro-batch means = full-batch mean; fp32 reordering only.
    assert last["loss"] == pytest.approx(last["reference_loss"], rel=1e-6)
    for stage in (first, last):
        assert stage["grad_error"] <= 1e-5 * stage["grad_scale"]


@pytest.mark.slow
def test_pipeline_cut_by_rank_zeros_timing_matches_the_unsplit_model(two_ranks):
    first, last = (r["pipeline"]["1f1b-timed"] for r in two_ranks[0])
    # Rank 0 measured the last block as the costly one; rank 1 did not measure and cut alike.
    assert (first["stage_children"], last["stage_children"]) == (3, 1)
    assert last["loss"] == pytest.approx(last["reference_loss"], rel=1e-6)
    for stage in (first, last):
        assert stage["grad_error"] <= 1e-5 * stage["grad_scale"]


@pytest.mark.slow
def test_bucketed_epoch_with_uneven_batches_finishes_in_sync(two_ranks):
    first, second = (r["bucketed_epoch"] for r in two_ranks[0])
    # 7 micro-steps in windows of 2: the trailing partial window is stepped, not lost.
    assert first == second
    assert first["optimizer_steps"] == (first["steps"] + 1) // 2
    assert first["replicas_differ"] is False


@pytest.mark.slow
def test_flush_after_no_sync_micro_step_is_refused(two_ranks):
    for result in two_ranks[0]:
        assert "never all-reduced" in result["flush_error"]


@pytest.mark.slow
def test_tuner_ranks_follow_rank_zero_and_end_with_one_config(two_ranks):
    rank0, rank1 = (result["tune"] for result in two_ranks[0])
    # Rank 1's own budget was spent and its clock made every step look 1000x faster: alone it
    # would have measured nothing, and timed rounds of other lengths. It followed rank 0 to the
    # same rounds, rows and config.
    assert rank1 == rank0
    assert rank0["processes"] == 2
    rows = rank0["rows"]
    assert {"comm_hook:fp16", "comm_hook:powersgd"} <= set(rows)
    # The MLP's 26 KiB of gradients fit one bucket at every cap: nothing to measure.
    assert rows["ddp_buckets"]["verdict"] == "not applicable"
    assert "the bucket size changes nothing here" in rows["ddp_buckets"]["reason"]
    assert all(row["verdict"] != "not measured" for row in rows.values())
    assert not any("not measured further" in row["reason"] for row in rows.values())
    assert rows["broken"]["verdict"] == "rejected"
    assert rows["broken"]["reason"].endswith("raised RuntimeError: no kernel for this op")
    assert rows["comm_hook:fp16"]["bytes"] * 2 == rows["fp32 eager"]["bytes"]
    assert rows["comm_hook:powersgd"]["bytes"] < rows["comm_hook:fp16"]["bytes"]


@pytest.mark.slow
def test_comm_bytes_per_step_spread_one_all_reduce_over_the_accumulation_window(two_ranks):
    for result in two_ranks[0]:
        counted = result["trial_comm"]
        assert counted["bytes_per_step"] == 4 * counted["params"] // 4  # fp32, 4 micro-steps


@pytest.mark.slow
def test_per_rank_micro_batch_splitting_is_refused_or_switched_off(two_ranks):
    for result in two_ranks[0]:
        kept = result["kept_in_step"]
        assert "memory_budget_bytes" in kept["budget_error"]
        assert kept["auto_microbatch"] is False
        assert kept["note"].startswith("off under torchrun")


@pytest.mark.slow
def test_bench_under_torchrun_reports_once_and_counts_the_fp16_hook(tmp_path):
    config = tmp_path / "ddp_fp16.toml"
    config.write_text('[distributed]\nstrategy = "ddp"\ncomm_hook = "fp16"\n')
    out = tmp_path / "bench.json"
    command = ["-m", "torchturbo", "bench", f"{TINY_RECIPE}:recipe", "--device", "cpu"]
    command += ["--config", str(config), "--steps", "4", "--json", str(out)]
    output = torchrun_two(command, TIMEOUT_S)
    assert output.count("torchturbo bench: tiny (2 processes, gloo)") == 1  # rank 0 only
    payload = json.loads(out.read_text())
    assert payload["processes"] == 2
    baseline, fp16 = payload["results"]
    assert (baseline["variant"], fp16["variant"]) == ("baseline", "ddp_fp16.toml")
    assert fp16["comm_bytes_per_step"] * 2 == baseline["comm_bytes_per_step"] > 0
    # Same initial weights and first batch: the hook only changes gradients, not the first loss.
    assert fp16["loss_first"] == baseline["loss_first"]


@pytest.mark.slow
def test_comm_hooks_benchmark_reports_bytes_loss_and_scaling(tmp_path):
    import subprocess
    import sys

    script = Path(__file__).parents[1] / "benchmarks" / "comm_hooks.py"
    out = tmp_path / "comm_hooks.json"
    command = [sys.executable, str(script), "--quick", "--json", str(out)]
    # The script bounds its own torchrun launch; this timeout only backs it up.
    subprocess.run([*command, "--timeout", str(TIMEOUT_S)], check=True, timeout=TIMEOUT_S + 30)
    report = json.loads(out.read_text())
    hooks = report["hooks"]
    assert set(hooks) == {"none", "fp16", "powersgd"}
    assert hooks["fp16"]["bytes_per_step"] * 2 == hooks["none"]["bytes_per_step"]
    assert hooks["powersgd"]["bytes_per_step"] <= 0.1 * hooks["none"]["bytes_per_step"]
    for row in hooks.values():
        assert row["steps"] > 0 and row["loss_last"] < row["loss_first"]
    assert report["scaling_efficiency"] > 0 and report["nproc"] == 2


@pytest.mark.slow
def test_doctor_under_torchrun_judges_communication_from_counted_bytes(tmp_path):
    out = tmp_path / "doctor.json"
    command = ["-m", "torchturbo", "doctor", f"{TINY_RECIPE}:recipe", "--device", "cpu"]
    output = torchrun_two([*command, "--steps", "2", "--json", str(out)], TIMEOUT_S)
    verdicts = [line for line in output.splitlines() if line.startswith("verdict ")]
    assert len(verdicts) == 1  # rank 0 renders, rank 1 stays quiet
    diagnosis = json.loads(out.read_text())
    assert diagnosis["processes"] == 2
    params = 16 * 3 * 9 + 16 + 16 * 16 * 9 + 16 + 16 * 2 + 2  # TinyConv, fp32 gradients
    assert diagnosis["comm_bytes_per_step"] == 4 * params
    (item,) = [i for i in diagnosis["items"] if i["name"] == "communication efficiency"]
    assert item["state"] in {"ok", "recommended"}
    assert "DDP all-reduced 10.9 KiB per step" in item["evidence"]


@pytest.mark.slow
def test_resumed_ddp_and_fsdp_runs_continue_bit_exactly(two_ranks):
    first, second = (r["resume"] for r in two_ranks[0])
    for strategy in ("ddp", "fsdp"):
        for result in (first[strategy], second[strategy]):
            assert result["err"] == 0.0 and result["steps"] == 4
        # Rank 0 wrote every rank's random state (the ranks drew different dropout masks).
        assert {"rng.pt", "rng.rank1.pt", "random.json", "random.rank1.json"} <= set(
            first[strategy]["files"]
        )
        assert first[strategy]["rng_differs"] is True
    # DDP: whole state dicts, written once the replicas' parameters were found identical.
    ddp = first["ddp"]
    assert {"model.pt", "optimizer.pt"} <= set(ddp["files"])
    assert ddp["replicas"] == [ddp["saved_digest"]] * 2
    # FSDP: no whole model anywhere; each rank's shards through torch.distributed.checkpoint.
    fsdp = first["fsdp"]
    assert "model.pt" not in fsdp["files"] and "optimizer.pt" not in fsdp["files"]
    assert fsdp["shards"] == [".metadata", "__0_0.distcp", "__1_0.distcp"]


@pytest.mark.slow
def test_the_engine_wraps_under_torchrun_without_being_asked(two_ranks):
    for result in two_ranks[0]:
        assert result["kept_in_step"]["distributed"] is None  # applied: DDP, from setup alone


#: Optimizer steps of the DDP-equality run: 10 keep the negative control 40x outside the bound.
DDP_STEPS = 10


@pytest.mark.slow
def test_torchrun_train_is_ddp_equal_to_one_process_on_the_union_of_batches(tmp_path):
    """`torchrun -m torchturbo train --workload text` with a DDP config: both ranks end with
    identical parameters, equal to one process trained on the union of their batches
    (tests/scripts/union_reference.py)."""
    import subprocess
    import sys

    from torchturbo.distributed.ddp import parameter_digest
    from torchturbo.resume.files import read_checkpoint

    config = tmp_path / "ddp.toml"
    config.write_text('[distributed]\nstrategy = "ddp"\n')
    command = ["-m", "torchturbo", "train", "--workload", "text", "--device", "cpu"]
    command += ["--config", str(config), "--steps", str(DDP_STEPS)]
    command += ["--checkpoint-dir", str(tmp_path)]
    output = torchrun_two(command, TIMEOUT_S)
    assert output.count(f"trained to optimizer step {DDP_STEPS}") == 1  # rank 0 reports
    files = read_checkpoint(tmp_path / f"ckpt-{DDP_STEPS:010d}")
    saved = files["model.pt"]
    reference = tmp_path / "reference.pt"
    script = Path(__file__).parent / "scripts" / "union_reference.py"
    reference_command = [sys.executable, str(script), str(reference), str(DDP_STEPS)]
    subprocess.run(reference_command, check=True, timeout=300)
    references = torch.load(reference)
    union, mean_of_means, names = (references[k] for k in ("union", "mean_of_means", "parameters"))
    # Both ranks' parameters: each rank hashed its own; both equal what rank 0 saved.
    digests = files["replicas.json"]["parameter_sha256"]
    assert digests == [parameter_digest(saved[name] for name in names)] * 2

    def error(reference: dict[str, torch.Tensor]) -> float:
        return max(float((saved[name] - reference[name]).abs().max()) for name in names)

    # AdamW divides each gradient element by its running RMS, so the ~1e-7 relative
    # differences of summing in another order can move a parameter whose gradient is near zero
    # by a fraction of lr (5e-3) per step: 1.5e-4 measured over 20 steps, 8e-5 over 10; bound
    # 0.2 x lr. Plain DDP's mean of means landed 0.04 away after 10 steps.
    tolerance = 1e-3
    assert error(union) <= tolerance
    # Negative control: weighing each rank's mean equally (plain DDP) lands far outside it.
    assert error(mean_of_means) > 10 * tolerance


STREAM = str(Path(__file__).parent / "recipes" / "stream.py") + ":recipe"


@pytest.mark.slow
def test_a_stream_recipe_trains_under_torchrun_each_rank_its_own_share(tmp_path, monkeypatch):
    """An IterableDataset has no len() for a DistributedSampler: dealt out instead, rank r the
    r-th item of each round of 2, the odd 37th dropped, so both ranks have 5 batches."""
    log = tmp_path / "ids"
    monkeypatch.setenv("STREAM_LOG", str(log))
    command = ["-m", "torchturbo", "train", STREAM, "--device", "cpu", "--steps", "5"]
    output = torchrun_two(command, TIMEOUT_S)
    assert "trained to optimizer step 5" in output
    ids = [[int(i) for i in Path(f"{log}.rank{r}").read_text().split()] for r in range(2)]
    assert sorted(ids[0]) == list(range(0, 36, 2)) and sorted(ids[1]) == list(range(1, 36, 2))
