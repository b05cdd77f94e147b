"""Two nodes launched as the README says (torchrun, one process each, gloo on this machine) must give the
single-process run's global model and metrics exactly."""

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import torch

from fedlight import checkpoint as ckpt_io

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Generous, for a machine that runs other tests beside these three processes; a healthy run takes ~30 s.
TIMEOUT = 900


def launch_nodes(node_run: list[str], cwd: Path, env: dict[str, str], attempts: int = 3) -> list[tuple[int, str]]:
    """Starts two torchrun nodes of ``node_run`` on a free port and returns each one's exit code and output.

    The port is free when chosen but may be taken by another process before node 0 binds it: only then is the
    launch repeated on a new port, so that every other failure is reported as it happened.
    """
    for _ in range(attempts):
        launch = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
            "--master_addr=127.0.0.1", f"--master_port={free_port()}",
        ]  # fmt: skip
        nodes = [
            subprocess.Popen(
                [*launch, f"--node_rank={rank}", *node_run],
                cwd=cwd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            for rank in (0, 1)
        ]
        first, _ = nodes[0].communicate(timeout=TIMEOUT)
        first = first.decode(errors="replace")
        if nodes[0].returncode != 0 and "address already in use" in first.lower():
            nodes[1].kill()  # it waits for a node 0 that never listened
            nodes[1].communicate()
            shutil.rmtree(cwd / "nodes", ignore_errors=True)
            continue
        second, _ = nodes[1].communicate(timeout=TIMEOUT)
        return [(nodes[0].returncode, first), (nodes[1].returncode, second.decode(errors="replace"))]
    raise AssertionError(f"node 0 found its port taken in {attempts} attempts:\n{first[-2000:]}")


def test_two_torchrun_nodes_give_the_single_process_run(tmp_path):
    settings = [
        "--config", str(REPO / "conf/fedproto/synthetic/fedavg_delta50.yaml"),
        "--trainer.rounds=2", "--trainer.local_epochs=1", "--trainer.logger=csv",
        "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={tmp_path}",
        "--strategy.init_args.tolerate_stragglers=true",
    ]  # fmt: skip
    # one intra-op thread everywhere: the same kernels, so the same floats, in every process
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    node_run = ["-m", "fedlight", "fit", *settings, "--trainer.num_nodes=2", "--trainer.name=nodes"]
    outputs = launch_nodes(node_run, tmp_path, env)
    for rank, (returncode, output) in enumerate(outputs):
        assert returncode == 0, f"node {rank}:\n{output[-2000:]}"
    single = [sys.executable, "-m", "fedlight", "fit", *settings, "--trainer.name=single"]
    subprocess.run(single, check=True, cwd=tmp_path, env=env, timeout=TIMEOUT, capture_output=True)

    one = ckpt_io.load(tmp_path / "single" / "version_0" / "checkpoints" / "last.ckpt")
    two = ckpt_io.load(tmp_path / "nodes" / "version_0" / "checkpoints" / "last.ckpt")
    for name, value in one["global_state"].items():
        assert torch.equal(two["global_state"][name], value), name
    keys = ("train/loss", "test/acc", "clients/acc")
    assert [[row[k] for k in keys] for row in two["history"]] == [[row[k] for k in keys] for row in one["history"]]
