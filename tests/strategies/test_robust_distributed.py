"""Rules that gather states (robust aggregators, attacks in the aggregation step) give the same model with two
processes (CPU, gloo, forked) as with one: the engine sorts the gathered states by client. With a gather budget
far below the round's K × P × 4 bytes, the states are read in column blocks broadcast from the processes that hold
them, and one and two processes still agree bit for bit (with each other and with the whole-state aggregate)."""

import os
import sys
from pathlib import Path

import torch
from processes import run_within

REPO = Path(__file__).resolve().parents[2]
STRATEGIES = {
    "median": "Peak(aggregator='median')",
    "trimmed_mean": "Peak(aggregator='trimmed_mean', beta=0.2)",
    "krum": "Peak(aggregator='krum', f=1)",
    "multi_krum": "Peak(aggregator='multi_krum', f=1)",
    "bulyan": "Peak(aggregator='bulyan', f=1)",
    "alie_median": "Attack(Peak(aggregator='median'), kind='alie', fraction=0.3, redraw=True)",
    "ipm_fedavg": "Attack(FedAvg(), kind='ipm', fraction=0.3)",
}
BLOCKED = ("krum", "bulyan", "alie_median")  # also run in blocks of 40 columns
BLOCK_BYTES = 7 * 40 * 4
# Seven clients of a small CNN, two rounds; every strategy runs with one and with two processes.
SCRIPT = """
import sys, torch
from fedlight.clients import ClassificationClient
from fedlight.data import FederatedDataModule
from fedlight.strategies import Attack, FedAvg, RobustAggregation
from fedlight.testing import ClientImages
from fedlight.engine.trainer import FederatedTrainer


class Peak(RobustAggregation):
    # logs the largest gathered block of the round, which every process reads alike
    def aggregate_chunks(self, global_state, states, updates):
        result = super().aggregate_chunks(global_state, states, updates)
        self.peak = states.peak_nbytes
        return result

    def on_round_end(self, context, round_idx, updates):
        return {**super().on_round_end(context, round_idx, updates), "peak_nbytes": float(self.peak)}


torch.set_num_threads(1)
results = {}
runs = [(name, make, devices, None) for name, make in STRATEGIES.items() for devices in (1, 2)]
runs += [(name, STRATEGIES[name], devices, BLOCK_BYTES) for name in BLOCKED for devices in (1, 2)]
for name, make, devices, budget in runs:
    data = FederatedDataModule(ClientImages([10, 14, 8, 12, 9, 11, 13], [1, 2, 3, 4, 5, 6, 7]), batch_size=1000,
                               test_fraction=0.0)
    trainer = FederatedTrainer(rounds=2, clients_per_round=7, local_epochs=1, devices=devices,
                               start_method="fork", logger=None, enable_progress_bar=False,
                               default_root_dir=sys.argv[2],
                               gather_budget_mb=1024 if budget is None else budget / 2**20)
    torch.manual_seed(0)
    client = ClassificationClient(num_classes=3, input_shape=(1, 8, 8), model="cnn", model_kwargs={"hidden": 8},
                                  optimizer=lambda params: torch.optim.SGD(params, lr=0.05))
    trainer.fit(client, data, eval(make))
    results[name, devices, budget] = (trainer.global_state.clone(), trainer.history)
torch.save(results, sys.argv[1])
"""


def test_two_processes_give_the_same_model_as_one(tmp_path):
    out = tmp_path / "results.pt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    script = f"STRATEGIES = {STRATEGIES!r}\nBLOCKED = {BLOCKED!r}\nBLOCK_BYTES = {BLOCK_BYTES}\n{SCRIPT}"
    done = run_within(
        [sys.executable, "-c", script, str(out), str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, cpu_budget=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = torch.load(out, weights_only=False)
    for name in STRATEGIES:
        (one, history_one), (two, history_two) = results[name, 1, None], results[name, 2, None]
        torch.testing.assert_close(two, one, rtol=0, atol=0, msg=name)
        assert [row["test/acc"] for row in history_two] == [row["test/acc"] for row in history_one], name
    for name in BLOCKED:
        whole = results[name, 1, None][0]
        for devices in (1, 2):
            blocked, history = results[name, devices, BLOCK_BYTES]
            torch.testing.assert_close(blocked, whole, rtol=0, atol=0, msg=f"{name}, {devices} processes")
            assert all(row["peak_nbytes"] == BLOCK_BYTES for row in history), name
    assert results["median", 1, None][1][-1]["round/clients_aggregated"] == 7
    assert results["ipm_fedavg", 1, None][1][-1]["attack/clients"] == 2
