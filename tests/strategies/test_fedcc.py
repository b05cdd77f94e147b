"""FedCC with hand-placed centroids: the server's new centroids and weights, Table 4's modes, state."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fedlight.clients.unsupervised import UnsupervisedSegmentationClient
from fedlight.errors import ConfigError
from fedlight.plans import ClientPlan, ClientUpdate
from fedlight.state import FlatState
from fedlight.strategies import FedCC

# Client 0's rows lie at 0 and 10 on the x axis; client 1 learnt the same two clusters in the other order.
CENTROIDS = [torch.tensor([[0.0, 0.0], [10.0, 0.0]]), torch.tensor([[9.0, 0.0], [1.0, 0.0]])]


def make_module():
    torch.manual_seed(0)
    return UnsupervisedSegmentationClient(
        num_classes=2, input_shape=(3, 8, 8), backbone="conv_patch8",
        backbone_kwargs={"out_channels": 4, "width": 4}, dim=2,
    )  # fmt: skip


def started(strategy, module=None):
    module = module or make_module()
    layout = FlatState(module, module.frozen_modules)
    context = SimpleNamespace(
        layout=layout,
        module=module,
        datamodule=SimpleNamespace(batch_size=8),
        strategy_rng=lambda t: np.random.default_rng(t),
    )
    strategy.on_fit_start(context)
    strategy.on_round_start(context, 0, [])
    return context


def updates(sizes=(8, 24)):
    out = []
    for client, (size, centroids) in enumerate(zip(sizes, CENTROIDS, strict=True)):
        update = ClientUpdate(client=client, num_samples=size, epochs=1, num_steps=1, train_loss=0.0)
        update.payload["centroids"] = centroids.clone()
        out.append(update)
    return out


def centroid_rows(context, state):
    return state[context.layout.mask(["centroids.clusters"])].view(2, 2)


def test_weights_are_batches_per_epoch_or_uniform():
    strategy = FedCC()
    started(strategy)
    sizes = [1, 8, 9, 17, 24]
    batch = [strategy.client_weights(ClientUpdate(k, n, 1, 1, 0.0)) for k, n in enumerate(sizes)]
    assert batch == [(1.0,), (1.0,), (2.0,), (3.0,), (3.0,)]  # ceil(n / 8), the short last batch counts
    uniform = FedCC(weighting="uniform")
    started(uniform)
    assert {uniform.client_weights(ClientUpdate(0, n, 1, 1, 0.0)) for n in sizes} == {(1.0,)}


def test_maximin_replaces_the_averaged_rows_by_pooled_rows_far_apart():
    strategy = FedCC(centroids="maximin")
    context = started(strategy)
    aggregate = torch.arange(context.layout.numel, dtype=torch.float32)
    new = strategy.server_update(aggregate.clone(), aggregate.clone(), updates())
    # pooled rows (0,0), (10,0), (9,0), (1,0): start at row 0, then the farthest from it, (10, 0)
    assert centroid_rows(context, new).tolist() == [[0.0, 0.0], [10.0, 0.0]]
    others = ~context.layout.mask(["centroids.clusters"])
    assert torch.equal(new[others], aggregate[others])  # head and probe keep the weighted average


def test_kmeans_finds_the_two_pairs_whatever_their_order_on_the_clients():
    strategy = FedCC(centroids="kmeans")
    context = started(strategy)
    aggregate = torch.zeros(context.layout.numel)
    rows = centroid_rows(context, strategy.server_update(aggregate, aggregate, updates()))
    assert sorted(rows.tolist()) == [[0.5, 0.0], [9.5, 0.0]]


def test_fedavg_rows_average_the_misaligned_centroids_into_neither_cluster():
    """Through the engine's batch weights 1 and 3: row 0 = (0·1 + 9·3)/4, row 1 = (10·1 + 1·3)/4."""
    strategy = FedCC(centroids="average")
    context = started(strategy)
    weights = [strategy.client_weights(u)[0] for u in updates()]
    mask = context.layout.mask(["centroids.clusters"])
    states = []
    for centroids in CENTROIDS:
        state = torch.zeros(context.layout.numel)
        state[mask] = centroids.flatten()
        states.append(state)
    aggregate = sum(w * s for w, s in zip(weights, states, strict=True)) / sum(weights)
    rows = centroid_rows(context, strategy.server_update(aggregate, aggregate, updates()))
    assert rows.tolist() == [[6.75, 0.0], [3.25, 0.0]]


def test_a_random_maximin_start_is_drawn_from_the_rounds_stream():
    strategy = FedCC(maximin_start="random")
    context = started(strategy)
    start = int(np.random.default_rng(0).integers(4))  # round 0's stream, four pooled rows
    pooled = torch.cat(CENTROIDS)
    rows = centroid_rows(context, strategy.server_update(*[torch.zeros(context.layout.numel)] * 2, updates()))
    assert rows[0].tolist() == pooled[start].tolist()


def test_mode_e_clients_keep_their_centroids_and_take_everything_else():
    strategy = FedCC(aggregated="encoder")
    context = started(strategy)
    strategy.on_round_end(context, 0, updates())
    global_state = torch.arange(context.layout.numel, dtype=torch.float32)
    mask = context.layout.mask(["centroids.clusters"])
    for client in (0, 1):
        state = strategy.initial_state(context, ClientPlan(client, 1), global_state)
        assert torch.equal(state[mask].view(2, 2), CENTROIDS[client])
        assert torch.equal(state[~mask], global_state[~mask])
    assert torch.equal(strategy.initial_state(context, ClientPlan(5, 1), global_state), global_state)


def test_mode_c_clients_keep_their_head_and_take_the_centroids():
    strategy = FedCC(aggregated="centroids")
    context = started(strategy)
    own = [torch.full((context.layout.numel,), float(k + 1)) for k in range(2)]
    module = context.module
    sent = []
    for client in range(2):
        context.layout.load(module, own[client])
        update = ClientUpdate(client, 8, 1, 1, 0.0)
        strategy.on_client_fit_end(context, module, update)
        sent.append(update)
    strategy.on_round_end(context, 0, sent)
    global_state = -torch.arange(context.layout.numel, dtype=torch.float32)
    mask = context.layout.mask(["centroids.clusters"])
    for client in range(2):
        state = strategy.initial_state(context, ClientPlan(client, 1), global_state)
        assert torch.equal(state[mask], global_state[mask])
        assert torch.equal(state[~mask], own[client][~mask])
    restored = FedCC(aggregated="centroids")
    restored.load_state_dict(strategy.state_dict())
    started(restored, module)
    assert torch.equal(
        restored.initial_state(context, ClientPlan(1, 1), global_state),
        strategy.initial_state(context, ClientPlan(1, 1), global_state),
    )


def test_a_model_without_centroids_is_refused():
    strategy = FedCC(centroid_key="clusters")
    with pytest.raises(ConfigError, match="clusters"):
        started(strategy)


class Recording(FedCC):
    """FedCC that also keeps every client's final state, to check the engine's aggregate against."""

    def on_client_fit_end(self, context, module, update):
        super().on_client_fit_end(context, module, update)
        self.states = getattr(self, "states", {}) | {update.client: context.layout.flatten(module).clone()}


def test_one_round_through_the_engine_averages_by_batches_and_substitutes_maximin_centroids(tmp_path):
    from fedlight.callbacks import BackboneFeatureCache
    from fedlight.data import FederatedDataModule, StreetScenes
    from fedlight.engine.trainer import FederatedTrainer
    from fedlight.strategies.functional import maximin_select

    dataset = StreetScenes(num_classes=12, num_cities=2, images_per_city=9, num_test_samples=2, image_size=16)
    data = FederatedDataModule(dataset, batch_size=4, test_fraction=0.0, return_index=True)
    torch.manual_seed(0)
    module = UnsupervisedSegmentationClient(
        num_classes=12, input_shape=(3, 16, 16), backbone="conv_patch8", backbone_kwargs={"out_channels": 8},
        dim=3, feature_samples=2, num_negatives=1,
    )  # fmt: skip
    trainer = FederatedTrainer(
        rounds=1, clients_per_round=2, local_steps=2, logger=None, enable_progress_bar=False,
        default_root_dir=tmp_path, callbacks=[BackboneFeatureCache(k=3)],
    )  # fmt: skip
    strategy = Recording()
    trainer.fit(module, data, strategy)
    mask = trainer.model.layout.mask(["centroids.clusters"])
    weights = [3.0, 3.0]  # 9 images in batches of 4
    average = sum(w * strategy.states[k] for k, w in enumerate(weights)) / sum(weights)
    torch.testing.assert_close(trainer.global_state[~mask], average[~mask])
    pooled = torch.cat([strategy.states[k][mask].view(12, 3) for k in range(2)])
    assert torch.equal(trainer.global_state[mask].view(12, 3), maximin_select(pooled, 12))


def test_a_resumed_run_ends_where_an_uninterrupted_one_does_and_keeps_each_clients_centroids(tmp_path):
    from tests.strategies.test_invariants_clustered import fit_centroids

    straight = fit_centroids(tmp_path / "a", FedCC(aggregated="encoder"), rounds=2)
    first = fit_centroids(tmp_path / "b", FedCC(aggregated="encoder"), rounds=1)
    ckpt = first.run_dir / "checkpoints" / "last.ckpt"
    resumed = fit_centroids(tmp_path / "b", FedCC(aggregated="encoder"), rounds=2, ckpt_path=ckpt)
    assert torch.equal(resumed.global_state, straight.global_state)
    assert set(resumed.run.strategy.own_centroids) == {0, 1, 2}


def test_a_misaligned_start_permutes_each_clients_first_centroids_and_nothing_else():
    module = UnsupervisedSegmentationClient(
        num_classes=12, input_shape=(3, 8, 8), backbone="conv_patch8",
        backbone_kwargs={"out_channels": 4, "width": 4}, dim=3,
    )  # fmt: skip
    strategy = FedCC(misaligned_start=True)
    context = started(strategy, module)
    context.seed = 7
    mask = context.layout.mask(["centroids.clusters"])
    global_state = torch.randn(context.layout.numel)
    rows = global_state[mask].view(12, 3)
    firsts = [strategy.initial_state(context, ClientPlan(client, 1), global_state) for client in (0, 1)]
    for state in firsts:
        assert torch.equal(state[~mask], global_state[~mask])  # head and probe as broadcast
        mine = state[mask].view(12, 3)
        order = [int(torch.nonzero((rows == row).all(dim=1))) for row in mine]  # where each row came from
        assert sorted(order) == list(range(12)) and order != list(range(12))  # the same rows, reordered
    assert not torch.equal(firsts[0], firsts[1])  # each client has its own order
    assert torch.equal(strategy.initial_state(context, ClientPlan(0, 1), global_state), firsts[0])  # from the seed
    context.seed = 8
    assert not torch.equal(strategy.initial_state(context, ClientPlan(0, 1), global_state), firsts[0])

    update = ClientUpdate(client=0, num_samples=8, epochs=1, num_steps=1, train_loss=0.0)
    update.payload["centroids"] = rows.clone()
    strategy.on_round_end(context, 0, [update])
    assert torch.equal(strategy.initial_state(context, ClientPlan(0, 1), global_state), global_state)  # once only
    restored = FedCC(misaligned_start=True)
    restored.load_state_dict(strategy.state_dict())
    assert restored.started == {0}
