"""Two nodes launched as the README says (torchrun, one process each, gloo on this machine) must give the
single-process run's global model and metrics exactly."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from fedlight import checkpoint as ckpt_io

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_torchrun_nodes_give_the_single_process_run(tmp_path):
    settings = [
        "--config", str(REPO / "conf/fedproto/synthetic/fedavg_delta50.yaml"),
        "--trainer.rounds=2", "--trainer.local_epochs=1", "--trainer.logger=csv",
        "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={tmp_path}",
        "--strategy.init_args.tolerate_stragglers=true",
    ]  # fmt: skip
    # one intra-op thread everywhere: the same kernels, so the same floats, in every process
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    port = free_port()
    launch = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
        "--master_addr=127.0.0.1", f"--master_port={port}",
    ]  # fmt: skip
    node_run = ["-m", "fedlight", "fit", *settings, "--trainer.num_nodes=2", "--trainer.name=nodes"]
    nodes = [
        subprocess.Popen(
            [*launch, f"--node_rank={rank}", *node_run], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank in (0, 1)
    ]
    single = [sys.executable, "-m", "fedlight", "fit", *settings, "--trainer.name=single"]
    subprocess.run(single, check=True, cwd=tmp_path, env=env, timeout=300, capture_output=True)
    for node in nodes:
        output, _ = node.communicate(timeout=300)
        assert node.returncode == 0, output.decode()[-2000:]

    one = ckpt_io.load(tmp_path / "single" / "version_0" / "checkpoints" / "last.ckpt")
    two = ckpt_io.load(tmp_path / "nodes" / "version_0" / "checkpoints" / "last.ckpt")
    for name, value in one["global_state"].items():
        assert torch.equal(two["global_state"][name], value), name
    keys = ("train/loss", "test/acc", "clients/acc")
    assert [[row[k] for k in keys] for row in two["history"]] == [[row[k] for k in keys] for row in one["history"]]
