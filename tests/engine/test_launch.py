"""Two processes on CPU (gloo) must give the same global model as one process."""

import sys
from pathlib import Path

import torch
from processes import run_within

from fedlight import checkpoint as ckpt_io

REPO = Path(__file__).resolve().parents[2]


def fit(tmp_path: Path, devices: int, *extra: str, name: str = "") -> dict:
    name = name or f"devices{devices}"
    command = [
        sys.executable, "-m", "fedlight", "fit",
        "--config", str(REPO / "conf/fedproto/synthetic/fedavg_delta50.yaml"),
        "--trainer.rounds=3", "--trainer.local_epochs=2", f"--trainer.devices={devices}",
        "--trainer.logger=csv", f"--trainer.default_root_dir={tmp_path}", f"--trainer.name={name}",
        "--trainer.enable_progress_bar=false",
        # tolerated stragglers: ranks run clients with different workloads
        "--strategy.init_args.tolerate_stragglers=true",
        *extra,
    ]  # fmt: skip
    done = run_within(command, cpu_budget=600, check=True, cwd=tmp_path, capture_output=True, text=True)
    state = ckpt_io.load(tmp_path / name / "version_0" / "checkpoints" / "last.ckpt")
    state["stderr"] = done.stderr
    return state


def test_two_processes_give_exactly_the_model_and_metrics_of_one_and_warn_of_nothing(tmp_path):
    # one intra-op thread per process by default, so the kernels sum in the same order in both runs
    one, two = fit(tmp_path, 1), fit(tmp_path, 2)
    for name, value in one["global_state"].items():
        assert torch.equal(two["global_state"][name], value), name
    for row_one, row_two in zip(one["history"], two["history"], strict=True):
        assert row_one["round/clients_aggregated"] == row_two["round/clients_aggregated"] == 10
        for key in ("train/loss", "test/acc", "clients/acc_mean"):
            assert row_one[key] == row_two[key], key
    assert "Warning" not in two["stderr"], two["stderr"]


def test_two_processes_of_batched_clients_give_the_model_of_one(tmp_path):
    one = fit(tmp_path, 1, "--trainer.client_batching=16", name="batched1")
    two = fit(tmp_path, 2, "--trainer.client_batching=16", name="batched2")
    for name, value in one["global_state"].items():
        torch.testing.assert_close(two["global_state"][name], value, rtol=0, atol=1e-6)
    for row_one, row_two in zip(one["history"], two["history"], strict=True):
        for key in ("train/loss", "test/acc"):
            assert abs(row_one[key] - row_two[key]) < 1e-5, key


def test_fork_started_processes_give_the_same_model_as_popen(tmp_path):
    popen = fit(tmp_path, 2)
    forked = fit(tmp_path, 2, "--trainer.start_method=fork", name="fork")
    for name, value in popen["global_state"].items():
        assert torch.equal(forked["global_state"][name], value), name
    assert [row["test/acc"] for row in forked["history"]] == [row["test/acc"] for row in popen["history"]]
