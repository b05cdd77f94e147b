"""Multi-process runs fail as one process does: a missing launcher, a rendezvous that never completes and an error
inside forked processes each end with one ConfigError message and exit code 2."""

import os
import socket
import sys
from pathlib import Path

import pytest
from processes import run_within

from fedlight.cli import main
from fedlight.engine.launch import LAUNCHER_VARIABLES
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
SYNTHETIC = str(REPO / "conf/fedproto/synthetic/fedavg_delta0.yaml")
FORK = str(REPO / "conf/two_cpu_processes.yaml")
QUICK = [
    "--trainer.local_epochs=1",
    "--trainer.rounds=2",
    "--trainer.enable_progress_bar=false",
    "--trainer.logger=csv",
]


@pytest.fixture
def no_launcher(monkeypatch):
    for names in LAUNCHER_VARIABLES.values():
        for name in names:
            monkeypatch.delenv(name, raising=False)


def test_several_nodes_without_a_launcher_say_how_to_launch(tmp_path, no_launcher, capsys):
    with pytest.raises(ConfigError) as err:
        FederatedTrainer(num_nodes=2, devices=4, default_root_dir=tmp_path)
    assert "--trainer.num_nodes=2 needs a launcher" in str(err.value)
    assert "torchrun --nnodes=2 --nproc_per_node=4 --node_rank=" in str(err.value)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", SYNTHETIC, *QUICK, f"--trainer.default_root_dir={tmp_path}", "--trainer.num_nodes=2"])
    assert exit_info.value.code == 2
    assert "fedlight: error: --trainer.num_nodes=2 needs a launcher" in capsys.readouterr().err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_rendezvous_that_never_completes_times_out_naming_what_it_waited_for(tmp_path):
    port = free_port()
    # the variables torchrun gives node 0 of two; node 1 never starts
    env = {
        **os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port), "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "fedlight-test",
    }  # fmt: skip
    command = [
        sys.executable, "-m", "fedlight", "fit", "--config", SYNTHETIC, *QUICK,
        f"--trainer.default_root_dir={tmp_path}", "--trainer.num_nodes=2", "--trainer.rendezvous_timeout=3",
    ]  # fmt: skip
    done = run_within(command, cpu_budget=480, env=env, cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 2, done.stderr[-3000:]
    assert (
        f"fedlight: error: Waited 3 s (--trainer.rendezvous_timeout) at 127.0.0.1:{port} for the 2 processes of "
        "--trainer.num_nodes=2 × --trainer.devices=1"
    ) in done.stderr


ALL_FAIL = """
from fedlight.strategies import FedAvg


class BrokenFedAvg(FedAvg):
    def on_client_fit_start(self, context, module, plan):
        raise RuntimeError("no client can train")
"""


@pytest.mark.parametrize(
    "settings",
    [["--trainer.clients_per_round=500"], ["--strategy=broken_strategy.BrokenFedAvg"]],
    ids=["set-up", "rounds"],
)
def test_forked_processes_report_a_config_error_as_one_process_does(tmp_path, capsys, monkeypatch, settings):
    (tmp_path / "broken_strategy.py").write_text(ALL_FAIL)
    monkeypatch.syspath_prepend(str(tmp_path))
    reports = []
    for name, extra in [("one", []), ("two", ["--config", FORK])]:
        args = [
            "fit",
            "--config",
            SYNTHETIC,
            *extra,
            *QUICK,
            *settings,
            f"--trainer.default_root_dir={tmp_path / name}",
        ]
        with pytest.raises(SystemExit) as exit_info:
            main(args)
        err = capsys.readouterr().err
        assert "fedlight: error: " in err, err[-3000:]
        message = err[err.index("fedlight: error: ") :].replace(str(tmp_path / name), "<root>")
        reports.append((exit_info.value.code, message))
    assert reports[0] == reports[1]
    assert reports[0][0] == 2 and "Traceback" not in reports[1][1]
