"""A run whose rule keeps per-client state, killed with SIGKILL and resumed, ends bit for bit where the uninterrupted
run ends: the global model, every round's metrics, and each client's state file (the personalised FedBN and FedPer,
FedDyn's gradient corrections, and SCAFFOLD's control variates over two processes). The kill lands at the start of
round 3, after round 2's checkpoint: nothing gets to clean up, and the store holds round 3's first states of
nobody yet."""

import csv
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedlight import checkpoint as ckpt_io

REPO = Path(__file__).resolve().parents[2]
RULES = {
    "fedbn": [],
    "fedper": [],
    "feddyn": [],
    "scaffold": ["--trainer.devices=2", "--trainer.start_method=fork"],
}


def command(root: Path, rule: str, name: str, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "fedlight", "fit", "--config", str(REPO / f"conf/baselines/digits/{rule}.yaml"),
        "--trainer.rounds=4", "--trainer.clients_per_round=4", "--trainer.local_epochs=1",
        "--trainer.checkpoint_every=1", "--trainer.logger=csv", f"--trainer.default_root_dir={root}",
        f"--trainer.name={name}", "--trainer.enable_progress_bar=false", *RULES[rule], *extra,
    ]  # fmt: skip


def outcome(root: Path, name: str) -> tuple[dict, list[dict], dict]:
    """The last checkpoint's global state, the metrics of every round (times left out) and each client's state."""
    run_dir = root / name / "version_0"
    state = ckpt_io.load(run_dir / "checkpoints" / "last.ckpt")
    with open(run_dir / "metrics.csv", newline="") as file:
        history = [{k: v for k, v in row.items() if "time" not in k} for row in csv.DictReader(file)]
    index = state["client_states"]["index"]
    assert index, "the rule kept no client's state"
    folder = run_dir / "client_state"
    clients = {c: torch.load(folder / f"{c}-{v}.pt", weights_only=True) for c, v in index.items()}
    return state["global_state"], history, clients


@pytest.mark.parametrize("rule", sorted(RULES))
def test_a_killed_run_resumes_to_the_uninterrupted_runs_model_metrics_and_client_states(tmp_path, rule):
    # one intra-op thread in every process: the same kernels, so the same floats
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    options = {"cwd": tmp_path, "timeout": 600, "env": env, "capture_output": True, "text": True}
    whole = subprocess.run(command(tmp_path, rule, "whole"), **options)
    assert whole.returncode == 0, whole.stderr[-2000:]
    killer = ["--trainer.callbacks+=fedlight.testing.SigkillAtRound", "--trainer.callbacks.init_args.round_idx=2"]
    killed = subprocess.run(command(tmp_path, rule, "killed", *killer), **options)
    assert killed.returncode in (-signal.SIGKILL, 1), killed.stderr[-2000:]  # a launcher reports its rank's kill
    resume = f"--ckpt_path={tmp_path / 'killed' / 'version_0' / 'checkpoints' / 'last.ckpt'}"
    resumed = subprocess.run(command(tmp_path, rule, "killed", resume), **options)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    expected, got = outcome(tmp_path, "whole"), outcome(tmp_path, "killed")
    for name, value in expected[0].items():
        assert torch.equal(got[0][name], value), name
    assert got[1] == expected[1]
    assert got[2].keys() == expected[2].keys()
    for client, slots in expected[2].items():
        for slot, value in slots.items():
            assert torch.equal(got[2][client][slot], value), (client, slot)
