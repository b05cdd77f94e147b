"""MO-FedProto through the engine, on small Synthetic data with a real classification client.

Every expected value is recomputed independently of the strategy: prototypes from recorded client states,
margins and attention with the functional module, the aggregate by hand from those states.
"""

import pickle
from pathlib import Path

import pytest
import torch

from fedlight.cli import build_parser
from fedlight.clients import ClassificationClient
from fedlight.data import FederatedDataModule, Synthetic
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.metrics.functional.prototypes import (
    aggregate_mean_margin,
    aggregate_prototypes,
    attention_weights,
    class_prototypes,
    client_deviation,
    minmax_normalize,
    semantic_prototype_margin,
)
from fedlight.strategies import ClientUpdate, FedAvg, FedProto
from fedlight.testing import Kill, KillAfterRound

CONF = Path(__file__).resolve().parents[2] / "conf"
SETTINGS = {"clients_per_round": 4, "local_epochs": 2, "straggler_fraction": 0.5, "checkpoint_every": 2}


def make_model(seed=0):
    torch.manual_seed(seed)
    return ClassificationClient(num_classes=10, input_shape=(12,), model="mlp", model_kwargs={"hidden": [16]})


def fit(strategy, root, rounds=3, model_seed=0, ckpt_path=None, **kwargs):
    data = FederatedDataModule(Synthetic(num_clients=6, dim=12, seed=1), batch_size=10)
    trainer = FederatedTrainer(
        rounds=rounds, default_root_dir=root, logger=None, enable_progress_bar=False, **{**SETTINGS, **kwargs}
    )
    trainer.fit(make_model(model_seed), data, strategy, ckpt_path=ckpt_path)
    return trainer


class Recorder(FedProto):
    """FedProto that keeps each round's trained client states, aggregated updates, metrics and W^{t+1}."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.states, self.updates, self.globals, self.metrics, self.attentions = {}, {}, {}, {}, {}

    def on_round_start(self, trainer, round_idx, plans):
        self.round = round_idx
        self.states[round_idx] = {}

    def on_client_fit_end(self, trainer, module, update):
        super().on_client_fit_end(trainer, module, update)
        self.states[self.round][update.client] = trainer.layout.flatten(module)

    def on_round_end(self, trainer, round_idx, updates):
        self.metrics[round_idx] = super().on_round_end(trainer, round_idx, updates)
        self.updates[round_idx] = updates
        self.globals[round_idx] = trainer.global_state.clone()
        self.attentions[round_idx] = self.attention
        return self.metrics[round_idx]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    strategy = Recorder()
    trainer = fit(strategy, tmp_path_factory.mktemp("fedproto"))
    return trainer, strategy


def prototypes_of(trainer, state, client):
    """p_k [C, D] and n_k [C] of a client's training set under a flat state, computed from scratch."""
    model = make_model()
    trainer.model.layout.load(model, state)
    index = trainer.run.datamodule.client_train[client]
    with torch.no_grad():
        features = model.net.forward_features(trainer.run.datamodule.pool.inputs[index])
    return class_prototypes(features, trainer.run.datamodule.pool.targets[index], num_classes=10)


def stacked(updates, key):
    return torch.stack([u.payload[key] for u in updates])


def sizes(updates):
    return torch.tensor([u.num_samples for u in updates])


def test_first_round_is_fedavg(run, tmp_path):
    _, strategy = run
    fedavg = fit(FedAvg(tolerate_stragglers=True), tmp_path, rounds=1)
    torch.testing.assert_close(strategy.globals[0], fedavg.global_state, rtol=0, atol=0)
    updates = strategy.updates[0]
    assert all(u.weights == (u.num_samples, u.num_samples) for u in updates)
    torch.testing.assert_close(strategy.attentions[0], (sizes(updates) / sizes(updates).sum()).double())
    assert "fedproto/apm_mean" not in strategy.metrics[0]  # no p̂_agg^{t−1} to compare with yet


@pytest.mark.parametrize("round_idx", [1, 2])
def test_later_rounds_aggregate_with_the_prototype_attention(run, round_idx):
    _, strategy = run
    updates = strategy.updates[round_idx]
    v_loc, v_agg = client_deviation(stacked(updates, "lpm")), client_deviation(stacked(updates, "apm"))
    a = attention_weights(v_loc, v_agg, sizes(updates), first_round=False)  # Eqs. 12–13
    states = torch.stack([strategy.states[round_idx][u.client] for u in updates])  # [K, P]
    torch.testing.assert_close(strategy.globals[round_idx], a @ states, rtol=0, atol=1e-6)  # Eq. 14
    torch.testing.assert_close(strategy.attentions[round_idx], a.double())
    assert strategy.attentions[round_idx].sum().item() == pytest.approx(1.0)
    assert not torch.allclose(a, sizes(updates) / sizes(updates).sum(), atol=1e-4), "no different from FedAvg"
    metrics = strategy.metrics[round_idx]
    assert metrics["fedproto/attention_max"] == pytest.approx(a.max().item())
    assert metrics["fedproto/attention_min"] == pytest.approx(a.min().item())
    torch.testing.assert_close(metrics["fedproto/attention"], a.float())  # the W&B histogram of Fig. S2


def test_payload_margins_and_aggregates_match_an_independent_computation(run):
    trainer, strategy = run
    previous = None
    for round_idx in range(3):
        updates = strategy.updates[round_idx]
        # W^t, the state the round's clients received
        global_before = (
            trainer.model.layout.flatten(make_model()) if round_idx == 0 else strategy.globals[round_idx - 1]
        )
        for u in updates:
            p_after, counts = prototypes_of(trainer, strategy.states[round_idx][u.client], u.client)
            p_before, _ = prototypes_of(trainer, global_before, u.client)
            torch.testing.assert_close(u.payload["prototypes"], p_after, rtol=1e-5, atol=1e-6)
            assert torch.equal(u.payload["counts"], counts)
            lpm = semantic_prototype_margin(minmax_normalize(p_before), minmax_normalize(p_after), counts, counts)
            torch.testing.assert_close(u.payload["lpm"], lpm, rtol=1e-4, atol=1e-5)
            if previous is not None:
                apm = semantic_prototype_margin(minmax_normalize(p_after), previous[0], counts, previous[2])
                torch.testing.assert_close(u.payload["apm"], apm, rtol=1e-4, atol=1e-5)
        raw, counts = stacked(updates, "prototypes"), stacked(updates, "counts")
        carried = {} if previous is None else {"previous": previous[0], "previous_seen": previous[2]}
        previous = aggregate_prototypes(minmax_normalize(raw), counts, **carried)  # Eq. 10
        amm = aggregate_mean_margin(*aggregate_prototypes(raw, counts)[:2])  # D6, unnormalised
        assert strategy.metrics[round_idx]["fedproto/amm"] == pytest.approx(amm.item())
    torch.testing.assert_close(strategy.aggregate, previous[0], rtol=0, atol=0)
    assert torch.equal(strategy.seen, previous[2])


@pytest.mark.parametrize(("flag", "kept"), [("use_apm", "lpm"), ("use_lpm", "apm")])
def test_one_clue_alone_decides_the_weights(tmp_path, flag, kept):
    strategy = Recorder(**{flag: False})
    fit(strategy, tmp_path, rounds=2)
    updates = strategy.updates[1]
    dropped = {"lpm", "apm"} - {kept}
    assert all(kept in u.payload and not dropped & u.payload.keys() for u in updates)
    v = client_deviation(stacked(updates, kept))
    assert [u.weights for u in updates] == [(x, x) for x in v.tolist()]
    v_loc, v_agg = (v, None) if kept == "lpm" else (None, v)
    a = attention_weights(v_loc, v_agg, sizes(updates), first_round=False)
    states = torch.stack([strategy.states[1][u.client] for u in updates])
    torch.testing.assert_close(strategy.globals[1], a @ states, rtol=0, atol=1e-6)


def test_dplus_only_margins_use_no_negatives(run, tmp_path):
    trainer, default = run
    strategy = Recorder(use_negatives=False)
    fit(strategy, tmp_path, rounds=1)
    # round 0 trains exactly as the default run (FedAvg weights), so only the margins differ
    for u, reference in zip(strategy.updates[0], default.updates[0], strict=True):
        assert torch.equal(u.payload["prototypes"], reference.payload["prototypes"])
        p_before, counts = prototypes_of(trainer, trainer.model.layout.flatten(make_model()), u.client)
        p_before, p_after = minmax_normalize(p_before), minmax_normalize(u.payload["prototypes"])
        lpm = semantic_prototype_margin(p_before, p_after, counts, counts, use_negatives=False)
        torch.testing.assert_close(u.payload["lpm"], lpm, rtol=1e-4, atol=1e-5)
        assert not torch.allclose(u.payload["lpm"], reference.payload["lpm"])


def test_mean_reduction_averages_over_each_margins_classes():
    strategy = FedProto(reduction="mean")
    strategy.load_state_dict(
        {"first_round_done": True, "aggregate_prototypes": torch.rand(4, 3), "seen": torch.tensor([1, 1, 0, 1]) > 0}
    )
    payload = {
        "counts": torch.tensor([5, 0, 2, 1]),  # class 1 absent here; class 2 absent from p̂_agg
        "lpm": torch.tensor([0.6, 0.0, -0.3, 0.9]),
        "apm": torch.tensor([0.2, 0.0, 0.0, 0.5]),
    }
    update = ClientUpdate(client=0, num_samples=8, epochs=1, num_steps=1, train_loss=0.0, payload=payload)
    v_agg, v_loc = strategy.client_weights(update)
    assert v_agg == pytest.approx(torch.sigmoid(torch.tensor((0.2 + 0.5) / 2)).item())  # C′ = {0, 3}
    assert v_loc == pytest.approx(torch.sigmoid(torch.tensor((0.6 - 0.3 + 0.9) / 3)).item())  # C′ = {0, 2, 3}


def test_both_clues_off_is_refused():
    with pytest.raises(ConfigError, match=r"use_lpm and --strategy.init_args.use_apm are both false"):
        FedProto(use_lpm=False, use_apm=False)


def test_state_round_trips_through_a_weights_only_checkpoint(run, tmp_path):
    _, strategy = run
    torch.save(strategy.state_dict(), tmp_path / "state.pt")
    clone = FedProto()
    clone.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert torch.equal(clone.aggregate, strategy.aggregate) and torch.equal(clone.seen, strategy.seen)
    update = strategy.updates[2][0]
    assert clone.client_weights(update) == strategy.client_weights(update)
    # a state saved before any round ended means the next round is a first round: FedAvg's weights
    fresh = FedProto()
    fresh.load_state_dict(FedProto().state_dict())
    assert fresh.aggregate is None and fresh.client_weights(update) == (update.num_samples,) * 2


def test_killed_and_resumed_run_continues_identically(tmp_path):
    reference = fit(FedProto(), tmp_path / "reference", rounds=4)
    killed_strategy = FedProto()
    with pytest.raises(Kill):
        fit(killed_strategy, tmp_path / "killed", rounds=4, callbacks=[KillAfterRound(2)])
    killed_dir = next((tmp_path / "killed").rglob("last.ckpt"))
    # another initial model and a fresh strategy: everything must come from the checkpoint
    resumed = fit(FedProto(), tmp_path / "killed", rounds=4, model_seed=123, ckpt_path=killed_dir)
    torch.testing.assert_close(resumed.global_state, reference.global_state, rtol=0, atol=0)
    assert torch.equal(resumed.run.strategy.aggregate, reference.run.strategy.aggregate)
    for row, reference_row in zip(resumed.history, reference.history, strict=True):
        assert {k: v for k, v in row.items() if k.startswith("fedproto/")} == {
            k: v for k, v in reference_row.items() if k.startswith("fedproto/")
        }


def test_payload_is_small_and_on_the_cpu(run):
    _, strategy = run
    for u in strategy.updates[2]:
        assert len(pickle.dumps(u.payload)) < 64 * 1024
        assert all(t.device.type == "cpu" for t in u.payload.values())


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("fedproto_delta50", {"tolerate_stragglers": True, "use_lpm": True, "use_apm": True}),
        ("fedproto_no_toleration_delta50", {"tolerate_stragglers": False}),
        ("fedproto_lpm_only_delta50", {"tolerate_stragglers": True, "use_apm": False}),
        ("fedproto_apm_only_delta50", {"tolerate_stragglers": True, "use_lpm": False}),
        ("fedproto_dplus_only_delta50", {"tolerate_stragglers": True, "use_negatives": False}),
    ],
)
def test_table_rows_configure_the_strategy(name, expected):
    parser = build_parser()
    cfg = parser.parse_args(["fit", "--config", str(CONF / "fedproto/synthetic" / f"{name}.yaml")])
    strategy = parser.instantiate(cfg).fit.strategy
    assert isinstance(strategy, FedProto)
    assert {key: getattr(strategy, key) for key in expected} == expected
