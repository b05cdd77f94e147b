"""Model banks: cluster-specific entries averaged within clusters, shared ones over every client."""

import copy
import os
import signal
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from processes import run_within
from torch import nn

from fedlight import checkpoint as ckpt_io
from fedlight.bank import cluster_entry_names
from fedlight.clients import ClassificationClient
from fedlight.data import FederatedDataModule
from fedlight.data.base import FederatedDataset, LabelledTensors
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.strategies import ClusteredFedAvg

REPO = Path(__file__).resolve().parents[1]
SIZES = [10, 20, 30]


class Vectors(FederatedDataset):
    """Three clients with 10, 20 and 30 random 4-D samples of 3 classes; clients shift their inputs."""

    num_classes = 3
    input_shape = (4,)

    def load_train(self) -> LabelledTensors:
        generator = torch.Generator().manual_seed(0)
        groups = np.repeat(np.arange(len(SIZES)), SIZES)
        y = torch.randint(3, (len(groups),), generator=generator)
        x = torch.randn(len(groups), 4, generator=generator) + y[:, None] + torch.tensor(groups)[:, None]
        return LabelledTensors(x, y, groups)


class NormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU())
        self.head = nn.Linear(6, 3)

    def forward_features(self, x):
        return self.encoder(x)

    def forward_head(self, features):
        return self.head(features)

    def forward(self, x):
        return self.head(self.encoder(x))


def make_model():
    torch.manual_seed(0)
    client = ClassificationClient(
        num_classes=3, input_shape=(4,), optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.5)
    )
    client.net = NormNet()
    return client


def make_data():
    return FederatedDataModule(Vectors(), batch_size=4, test_fraction=0.3, drop_last=True)


class Recording(ClusteredFedAvg):
    """Keeps, per round, the state each client started from and ended with, and the bank after aggregation."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.starts, self.ends, self.clusters_after, self.globals_after = {}, {}, {}, {}
        self.globals_before, self.clusters_before = {}, {}

    def on_round_start(self, context, round_idx, plans):
        self.round = round_idx
        self.starts[round_idx], self.ends[round_idx] = {}, {}
        self.globals_before[round_idx] = context.global_state.clone()
        self.clusters_before[round_idx] = context.bank.clusters.clone()

    def initial_state(self, context, plan, state):
        self.starts[self.round][plan.client] = state.clone()
        return state

    def on_client_fit_end(self, context, module, update):
        self.ends[self.round][update.client] = context.layout.flatten(module).clone()

    def on_round_end(self, context, round_idx, updates):
        self.globals_after[round_idx] = context.global_state.clone()
        self.clusters_after[round_idx] = context.bank.clusters.clone()
        return super().on_round_end(context, round_idx, updates)


def fit(tmp_path, strategy, rounds=2, clients_per_round=3):
    trainer = FederatedTrainer(
        rounds=rounds, clients_per_round=clients_per_round, local_epochs=1, logger="csv",
        enable_progress_bar=False, default_root_dir=tmp_path,
    )  # fmt: skip
    data, model = make_data(), make_model()
    trainer.fit(model, data, strategy)
    return trainer, data, model


def test_two_clusters_average_bn_within_clusters_and_the_rest_over_all_clients(tmp_path):
    strategy = Recording(clusters=[0, 0, 1], cluster_layers="bn")
    trainer, data, _ = fit(tmp_path, strategy)
    layout = trainer.model.layout
    bn = layout.mask(cluster_entry_names(trainer.model.module, layout, "bn"))
    assert layout.names == [
        "net.encoder.0.weight", "net.encoder.0.bias", "net.encoder.1.weight", "net.encoder.1.bias",
        "net.encoder.1.running_mean", "net.encoder.1.running_var", "net.head.weight", "net.head.bias",
    ]  # fmt: skip
    assert int(bn.sum()) == 4 * 6  # BatchNorm weight, bias, running mean and variance
    n = data.num_samples.astype(np.float64)
    for t in range(2):
        theta = {k: v.double() for k, v in strategy.ends[t].items()}
        everyone = sum(n[k] * theta[k] for k in range(3)) / n.sum()
        cluster0 = (n[0] * theta[0] + n[1] * theta[1]) / (n[0] + n[1])
        cluster1 = theta[2]
        expected = everyone.clone()
        expected[bn] = (cluster0[bn] + cluster1[bn]) / 2  # the global model's bn: unweighted mean of clusters
        torch.testing.assert_close(strategy.globals_after[t].double(), expected, rtol=0, atol=1e-6)
        torch.testing.assert_close(strategy.clusters_after[t][0].double(), cluster0[bn], rtol=0, atol=1e-6)
        torch.testing.assert_close(strategy.clusters_after[t][1].double(), cluster1[bn], rtol=0, atol=1e-6)
    # in round 1 each client starts from the global model with its cluster's BatchNorm
    for client, cluster in enumerate([0, 0, 1]):
        start = strategy.globals_after[0].clone()
        start[bn] = strategy.clusters_after[0][cluster]
        assert torch.equal(strategy.starts[1][client], start)


@pytest.mark.parametrize("reset", [False, True])
def test_a_cluster_without_clients_keeps_its_values_or_restarts_from_the_global_model(tmp_path, reset):
    strategy = Recording(clusters=[0, 0, 1], cluster_layers="bn", reset_unsampled_clusters=reset)
    trainer, _, _ = fit(tmp_path, strategy, rounds=4, clients_per_round=1)
    bn = trainer.model.bank.index
    unsampled = 0
    for t in range(4):
        (client,) = strategy.ends[t]
        other = 1 - strategy.clusters[client]
        before, after = strategy.clusters_before[t][other], strategy.clusters_after[t][other]
        expected = strategy.globals_before[t][bn] if reset else before
        assert torch.equal(after, expected)
        unsampled += not torch.equal(before, after)
    assert unsampled > 0 or not reset  # the reset did change a cluster at least once


def test_routed_metrics_equal_each_member_on_the_samples_routed_to_it(tmp_path):
    strategy = ClusteredFedAvg(clusters=[0, 1, 1], cluster_layers="bn")
    trainer, data, model = fit(tmp_path, strategy)
    metrics = trainer.history[-1]
    x = data.pool.inputs[data.held_out_index]
    y = data.pool.targets[data.held_out_index]
    clients = data.held_out_group
    correct = losses = 0.0
    members = {}
    for cluster in (0, 1):
        member = copy.deepcopy(model)
        trainer.model.layout.load(member, trainer.model.bank.member(cluster), trainer.model.integers)
        members[cluster] = member.eval()
    with torch.no_grad():
        for i in range(len(y)):
            logits = members[strategy.clusters[int(clients[i])]].net(x[i : i + 1])
            correct += float(logits.argmax(1).item() == y[i].item())
            losses += F.cross_entropy(logits, y[i : i + 1]).item()
        global_logits = trainer.model.evaluation_module().net(x)
    assert metrics["clients/routed/acc"] == pytest.approx(correct / len(y), abs=1e-6)
    assert metrics["clients/routed/loss"] == pytest.approx(losses / len(y), abs=1e-5)
    assert metrics["clients/loss"] == pytest.approx(F.cross_entropy(global_logits, y).item(), abs=1e-5)
    assert metrics["clients/routed/loss"] != pytest.approx(metrics["clients/loss"], abs=1e-6)
    assert metrics["test/routed/acc"] == metrics["clients/routed/acc"]  # no test set: the held-out splits


def test_a_cluster_map_of_another_partition_names_the_flag(tmp_path):
    with pytest.raises(ConfigError, match="clusters names the cluster of 2 clients, but the partition has 3"):
        fit(tmp_path, ClusteredFedAvg(clusters=[0, 1]))
    assert not list(tmp_path.rglob("version_*"))  # refused at set-up, before the run folder
    with pytest.raises(ConfigError, match=r"leaves cluster\(s\) \[1\] without clients"):
        fit(tmp_path, ClusteredFedAvg(clusters=[0, 2, 0]))
    with pytest.raises(ConfigError, match=r"cluster_layers.*matches no federated entry"):
        fit(tmp_path, ClusteredFedAvg(clusters=[0, 1, 1], cluster_layers="net.nothing.*"))


# -- whole runs through the command line: two processes, and a kill -9 ---------------------------------
CLUSTERS = "[" + ",".join(str(k % 3) for k in range(30)) + "]"


def command(tmp_path: Path, name: str, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "fedlight", "fit",
        "--config", str(REPO / "conf/fedproto/synthetic/fedavg_delta50.yaml"),
        "--trainer.rounds=3", "--trainer.local_epochs=2", "--trainer.checkpoint_every=1",
        "--trainer.logger=csv", f"--trainer.default_root_dir={tmp_path}", f"--trainer.name={name}",
        "--trainer.enable_progress_bar=false",
        "--strategy=fedlight.strategies.ClusteredFedAvg", f"--strategy.init_args.clusters={CLUSTERS}",
        "--strategy.init_args.cluster_layers=classifier", "--strategy.init_args.tolerate_stragglers=true",
        *extra,
    ]  # fmt: skip


def last(tmp_path: Path, name: str) -> dict:
    return ckpt_io.load(tmp_path / name / "version_0" / "checkpoints" / "last.ckpt")


def assert_same_run(a: dict, b: dict, atol: float = 0.0) -> None:
    for name, value in a["global_state"].items():
        torch.testing.assert_close(b["global_state"][name], value, rtol=0, atol=atol, msg=name)
    torch.testing.assert_close(b["bank"]["clusters"], a["bank"]["clusters"], rtol=0, atol=atol)
    keys = ("train/loss", "clients/acc", "clients/routed/acc")
    values_a = [row[k] for row in a["history"] for k in keys]
    values_b = [row[k] for row in b["history"] for k in keys]
    assert values_b == pytest.approx(values_a, abs=atol * 10, rel=0)


def test_a_bank_run_on_two_processes_equals_one_and_resumes_bit_exactly_after_kill_9(tmp_path):
    # one intra-op thread in every process: the same kernels, so the same floats (see tests/test_multinode.py)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    run_within(command(tmp_path, "one"), check=True, cwd=tmp_path, cpu_budget=600, env=env, capture_output=True)
    one = last(tmp_path, "one")
    assert one["bank"]["clusters"].shape[0] == 3
    assert one["history"][-1]["clients/routed/acc"] != one["history"][-1]["clients/acc"]

    two = run_within(
        command(tmp_path, "two", "--trainer.devices=2"), cwd=tmp_path, cpu_budget=600, env=env, capture_output=True
    )
    assert two.returncode == 0, two.stderr.decode()[-2000:]
    assert_same_run(one, last(tmp_path, "two"))

    # SIGKILL at the start of round 2, after round 1's checkpoint: nothing gets to clean up
    killer = "--trainer.callbacks+=fedlight.testing.SigkillAtRound", "--trainer.callbacks.init_args.round_idx=2"
    killed = run_within(command(tmp_path, "killed", *killer), cwd=tmp_path, cpu_budget=600, env=env)
    assert killed.returncode == -signal.SIGKILL
    assert last(tmp_path, "killed")["round"] == 2
    resume = f"--ckpt_path={tmp_path / 'killed' / 'version_0' / 'checkpoints' / 'last.ckpt'}"
    run_within(command(tmp_path, "killed", resume), check=True, cwd=tmp_path, cpu_budget=600, env=env)
    assert_same_run(one, last(tmp_path, "killed"))
