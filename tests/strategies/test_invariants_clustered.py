"""The shared tester for the rules that train their own kind of client: FedCC and its FedProx and MOON variants on
FUSS's unsupervised client (cluster centroids), ClusteredFedAvg's and LADD's model banks.

Every one must lose nothing across a checkpoint: a run resumed after round 1 ends, bit for bit, where the
uninterrupted run does, and its state loads into a fresh rule unchanged. A cluster bank also keeps what a
cluster of one client means: that cluster's entries are the client's own. (Client order and process count are
tested for the banks with two processes in ``tests/test_bank.py``; the rules of ``test_invariants.py`` need
only a state.)
"""

import pytest
import torch

from fedlight.callbacks import BackboneFeatureCache
from fedlight.clients.unsupervised import UnsupervisedSegmentationClient
from fedlight.data import FederatedDataModule, StreetScenes
from fedlight.engine.trainer import FederatedTrainer
from fedlight.strategies import CFL, LADD, ClusteredFedAvg, FedCC, FedCCMOON, FedCCProx
from tests.strategies import ladd_run
from tests.strategies.test_invariants import _assert_same_state
from tests.test_bank import make_data, make_model

CENTROID_RULES = {
    "fedcc_maximin": FedCC,
    "fedcc_kmeans": lambda: FedCC(centroids="kmeans", kmeans_n_init=2),
    "fedcc_prox": lambda: FedCCProx(mu=0.1),
    "fedcc_moon": lambda: FedCCMOON(mu=0.5),
    "fedcc_moon_released": lambda: FedCCMOON(mu=0.5, previous="averaged"),
}
BANK_RULES = {
    "clustered_bn": lambda: ClusteredFedAvg(clusters=[0, 0, 1], cluster_layers="bn"),
    "clustered_all": lambda: ClusteredFedAvg(clusters=[1, 0, 1], cluster_layers="all"),
    # splits once before the checkpoint of the round-trip test and once after it
    "cfl": lambda: CFL(eps1=1e3, eps2=1e-6, max_clusters=3),
}


def fit_centroids(root, strategy, rounds, ckpt_path=None):
    dataset = StreetScenes(num_classes=12, num_cities=3, images_per_city=6, num_test_samples=2, image_size=16)
    data = FederatedDataModule(dataset, batch_size=3, test_fraction=0.0, return_index=True)
    torch.manual_seed(0)
    module = UnsupervisedSegmentationClient(
        num_classes=12, input_shape=(3, 16, 16), backbone="conv_patch8", backbone_kwargs={"out_channels": 8},
        dim=3, feature_samples=2, num_negatives=1,
    )  # fmt: skip
    trainer = FederatedTrainer(
        rounds=rounds, clients_per_round=3, local_steps=2, logger=None, enable_progress_bar=False,
        default_root_dir=root, callbacks=[BackboneFeatureCache(k=3)],
    )  # fmt: skip
    trainer.fit(module, data, strategy, ckpt_path=ckpt_path)
    return trainer


def fit_bank(root, strategy, rounds, ckpt_path=None):
    trainer = FederatedTrainer(
        rounds=rounds, clients_per_round=3, local_epochs=1, logger=None, enable_progress_bar=False,
        default_root_dir=root,
    )  # fmt: skip
    trainer.fit(make_model(), make_data(), strategy, ckpt_path=ckpt_path)
    return trainer


def fit_ladd(root, strategy, rounds, ckpt_path=None):
    trainer, _ = ladd_run.fit(root, strategy, rounds=rounds, ckpt_path=ckpt_path)
    return trainer


RUNS = {
    **{name: (fit_centroids, rule) for name, rule in CENTROID_RULES.items()},
    **{name: (fit_bank, rule) for name, rule in BANK_RULES.items()},
    "ladd": (fit_ladd, lambda: ladd_run.ladd(LADD, swa_start=2)),
}


@pytest.mark.parametrize("name", list(RUNS))
def test_a_resumed_run_ends_bit_for_bit_where_the_uninterrupted_one_does(name, tmp_path):
    fit, make_rule = RUNS[name]
    straight = fit(tmp_path / "straight", make_rule(), rounds=2)
    first = fit(tmp_path / "resumed", make_rule(), rounds=1)
    resumed = fit(tmp_path / "resumed", make_rule(), rounds=2, ckpt_path=first.run_dir / "checkpoints" / "last.ckpt")
    assert torch.equal(resumed.global_state, straight.global_state)
    if straight.model.bank.num_clusters:
        assert torch.equal(resumed.model.bank.clusters, straight.model.bank.clusters)
    clone = make_rule()
    clone.load_state_dict(resumed.run.strategy.state_dict())
    _assert_same_state(clone.state_dict(), resumed.run.strategy.state_dict())


class KeepsStates(ClusteredFedAvg):
    """ClusteredFedAvg that keeps every client's final state of the round."""

    def on_client_fit_end(self, context, module, update):
        super().on_client_fit_end(context, module, update)
        self.ends = getattr(self, "ends", {}) | {update.client: context.layout.flatten(module).clone()}


def test_a_cluster_of_one_client_keeps_that_clients_own_entries(tmp_path):
    strategy = KeepsStates(clusters=[0, 1, 1], cluster_layers="all")  # client 0 alone in cluster 0
    trainer = fit_bank(tmp_path, strategy, rounds=1)
    member = trainer.model.bank.member(0)
    torch.testing.assert_close(member, strategy.ends[0].to(member), rtol=0, atol=1e-6)
    weights = torch.tensor([20.0, 30.0]) / 50.0  # clients 1 and 2 hold 20 and 30 samples: FedAvg within cluster 1
    expected = weights[0] * strategy.ends[1] + weights[1] * strategy.ends[2]
    torch.testing.assert_close(trainer.model.bank.member(1), expected.to(member), rtol=1e-5, atol=1e-6)
