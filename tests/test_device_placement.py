"""Every host keeps every tensor it makes on the model's device, proven on a CPU-only machine.

Each host (train, bench, tune, doctor, TurboTrainer, the Lightning callback) runs in a child
process with the model on ``fakegpu`` (tests/fake_device.py: tensors that compute on the CPU,
and fail as CUDA fails when an op mixes them with CPU tensors), on a Hugging Face Llama with
packing, bf16 and the chunked loss, and on built-in workloads (tests/scripts/on_fake_device.py).
Packing's isolation check built its position ids on the CPU, and a tune of a Llama on an H200
stopped there; this is the test that would have seen it. The negative control plants one CPU
tensor in the batches the one place moves (``base/device.to_device``), and every host must fail.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from torch.utils import backend_registration

SCRIPT = Path(__file__).parent / "scripts" / "on_fake_device.py"
HOSTS = ["train", "bench", "tune", "doctor", "transformers", "lightning"]
MIXED = "Expected all tensors to be on the same device"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not hasattr(backend_registration, "_setup_privateuseone_for_python_backend"),
        reason="this torch has no Python PrivateUse1 backend to make a second device with",
    ),
]


def _host(host: str, *flags: str) -> tuple[int, str, int]:
    """(exit status, output, ops run on the device) of one host in a fresh process."""
    done = subprocess.run(
        [sys.executable, str(SCRIPT), host, *flags],
        capture_output=True,
        text=True,
        timeout=240,
    )
    output = done.stdout + done.stderr
    found = re.search(r"ops on fakegpu: (\d+)", output)
    return done.returncode, output, int(found[1]) if found else 0


@pytest.mark.parametrize("host", HOSTS)
def test_every_host_trains_with_every_tensor_on_the_models_device(host):
    status, output, ops = _host(host)
    assert status == 0, output[-4000:]
    assert MIXED not in output
    # The model trained there: thousands of ops, not a model left on the CPU.
    assert ops > 2000, output[-2000:]


@pytest.mark.parametrize("host", HOSTS)
def test_one_planted_cpu_tensor_fails_every_host(host):
    status, output, _ = _host(host, "--plant")
    assert status != 0 and MIXED in output, output[-4000:]
