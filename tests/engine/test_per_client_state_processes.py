"""Per-client state with two processes (CPU, gloo, forked) gives the run of one process: a client trained by one
process in a round and by the other in the next starts from the state it left, through the run folder's files.

Eight clients, four a round, three rounds: clients are spread over the processes by size each round, so several
move between them."""

import os
import sys
from pathlib import Path

import torch
from processes import run_within

REPO = Path(__file__).resolve().parents[2]
# a vector slot summed over processes (SCAFFOLD's Δc_k), local slots (FedBN), a personal model (Ditto)
RULES = {"scaffold": "SCAFFOLD()", "fedbn": "FedBN()", "ditto": "Ditto(lam=0.5)"}
SCRIPT = """
import sys, torch
from fedlight import checkpoint as ckpt_io
from fedlight.clients import ClassificationClient
from fedlight.data import FederatedDataModule, Synthetic
from fedlight.engine.trainer import FederatedTrainer
from fedlight.strategies import SCAFFOLD, Ditto, FedBN

torch.set_num_threads(1)
results = {}
for name, make in RULES.items():
    for devices in (1, 2):
        data = FederatedDataModule(Synthetic(num_clients=8, dim=12, seed=1), batch_size=10)
        trainer = FederatedTrainer(rounds=3, clients_per_round=4, local_epochs=1, devices=devices,
                                   start_method="fork", logger=None, enable_progress_bar=False,
                                   default_root_dir=sys.argv[2], name=f"{name}{devices}")
        torch.manual_seed(0)
        client = ClassificationClient(num_classes=10, input_shape=(12,), model="mlp",
                                      model_kwargs={"hidden": [16], "batch_norm": name == "fedbn"})
        trainer.fit(client, data, eval(make))
        index = ckpt_io.load(trainer.run_dir / "checkpoints" / "last.ckpt")["client_states"]["index"]
        own = {k: torch.load(trainer.run_dir / "client_state" / f"{k}-{v}.pt") for k, v in index.items()}
        results[name, devices] = (trainer.global_state.clone(), trainer.history, index, own)
torch.save(results, sys.argv[1])
"""


def test_two_processes_keep_the_clients_states_as_one_does(tmp_path):
    out = tmp_path / "results.pt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = run_within(
        [sys.executable, "-c", f"RULES = {RULES!r}\n{SCRIPT}", str(out), str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, cpu_budget=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = torch.load(out, weights_only=False)
    for name in RULES:
        (w_one, history_one, index_one, own_one), (w_two, history_two, index_two, own_two) = (
            results[name, 1],
            results[name, 2],
        )
        torch.testing.assert_close(w_two, w_one, rtol=0, atol=0, msg=name)
        timeless = lambda history: [{k: v for k, v in row.items() if k != "round/time_s"} for row in history]  # noqa: E731
        assert timeless(history_two) == timeless(history_one), name
        assert index_two == index_one and len(index_one) > 4, name  # more clients than one round's trained
        for client, values in own_one.items():
            for slot, value in values.items():
                torch.testing.assert_close(own_two[client][slot], value, rtol=0, atol=0, msg=f"{name} {client}")
    personal = [key for key in results["ditto", 1][1][-1] if key.startswith("clients/personal/")]
    assert "clients/personal/acc" in personal and "clients/personal/acc_std" in personal
