"""MO-FedProto with two processes (CPU, gloo) must give the same run as with one.

Each rank computes its own clients' payloads and weights; the payloads are gathered for the aggregate
prototypes and the weighted sums are all-reduced, so the model, p̂_agg and the logged attention must not
depend on how the clients were spread over the ranks.
"""

import subprocess
import sys
from pathlib import Path

import torch
from processes import communicate_within

from fedlight import checkpoint as ckpt_io

REPO = Path(__file__).resolve().parents[2]


def start(tmp_path: Path, devices: int) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "fedlight", "fit",
        "--config", str(REPO / "conf/fedproto/synthetic/fedproto_delta50.yaml"),
        "--trainer.rounds=3", "--trainer.local_epochs=2", f"--trainer.devices={devices}",
        "--trainer.logger=csv", f"--trainer.default_root_dir={tmp_path}", f"--trainer.name=devices{devices}",
        "--trainer.enable_progress_bar=false",
    ]  # fmt: skip
    return subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(process: subprocess.Popen, tmp_path: Path, devices: int) -> dict:
    output, _ = communicate_within(process, cpu_budget=600)
    assert process.returncode == 0, output[-3000:]
    return ckpt_io.load(tmp_path / f"devices{devices}" / "version_0" / "checkpoints" / "last.ckpt")


def test_two_processes_give_the_same_fedproto_run_as_one(tmp_path):
    # Both runs at once: most of their time is spent starting Python and the process group.
    processes = {devices: start(tmp_path, devices) for devices in (1, 2)}
    one, two = (finish(processes[devices], tmp_path, devices) for devices in (1, 2))
    for name, value in one["global_state"].items():
        torch.testing.assert_close(two["global_state"][name], value, rtol=0, atol=1e-6)
    state_one, state_two = one["strategy"]["state"], two["strategy"]["state"]
    assert state_one["first_round_done"] and state_two["first_round_done"]
    torch.testing.assert_close(state_two["aggregate_prototypes"], state_one["aggregate_prototypes"], rtol=0, atol=1e-5)
    assert torch.equal(state_two["seen"], state_one["seen"])
    for row_one, row_two in zip(one["history"], two["history"], strict=True):
        assert row_one["round/clients_aggregated"] == row_two["round/clients_aggregated"] == 10  # δ = 50% tolerated
        for key in ("fedproto/attention_max", "fedproto/attention_min", "fedproto/amm", "train/loss"):
            assert abs(row_one[key] - row_two[key]) < 1e-5, key
