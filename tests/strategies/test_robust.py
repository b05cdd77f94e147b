"""RobustAggregation through the engine, on ScalarClient: a full-batch SGD step with lr 1 on ½(w − y_k)² lands on
client k's target, so the round's states are the targets and every aggregate is known by hand."""

import re
from pathlib import Path

import pytest
import torch

from fedlight.cli import build_parser
from fedlight.data import FederatedDataModule
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.gather import StateChunks
from fedlight.strategies import Attack, FedAvg, FedAvgM, FedProx, RobustAggregation
from fedlight.testing import ScalarClient, ScalarDataset

REPO = Path(__file__).resolve().parents[2]


def fit(root, sizes, values, strategy, rounds=1, lr=1.0, local_epochs=1, ckpt_path=None):
    # test_fraction 0.5: client k trains on int(0.5·sizes[k]) samples of target values[k]
    data = FederatedDataModule(ScalarDataset(sizes, values), batch_size=10_000, test_fraction=0.5)
    trainer = FederatedTrainer(
        rounds=rounds, clients_per_round=len(sizes), local_epochs=local_epochs, logger=None,
        enable_progress_bar=False, default_root_dir=root,
    )  # fmt: skip
    metrics = trainer.fit(ScalarClient(lr=lr), data, strategy, ckpt_path=ckpt_path)
    return trainer, metrics


SIZES, VALUES = [4, 6, 8, 10, 12], [1.0, 2.0, 3.0, 4.0, 100.0]  # n_k = 2, 3, 4, 5, 6; client 4 is an outlier


@pytest.mark.parametrize(
    ("aggregator", "kwargs", "expected"),
    [
        ("median", {}, 3.0),
        ("trimmed_mean", {"beta": 0.2}, (2.0 + 3.0 + 4.0) / 3),
        # Krum, f = 1: scores (two nearest) 5, 2, 2, 5, 9409 + 9216: client 1 wins the tie
        ("krum", {"f": 1}, 2.0),
        # Multi-Krum, m = K − f = 4: clients 1, 2, 0, 3 averaged with n_k
        ("multi_krum", {"f": 1}, (3 * 2.0 + 4 * 3.0 + 2 * 1.0 + 5 * 4.0) / 14),
    ],
)
def test_robust_aggregates_by_hand(tmp_path, aggregator, kwargs, expected):
    trainer, metrics = fit(tmp_path, SIZES, VALUES, RobustAggregation(aggregator=aggregator, **kwargs))
    assert trainer.global_state.item() == pytest.approx(expected)
    assert metrics["round/clients_aggregated"] == 5
    if aggregator in ("krum", "multi_krum"):
        assert metrics["robust/clients_selected"] == (1 if aggregator == "krum" else 4)


def test_bulyan_through_the_engine(tmp_path):
    # seven clients at 1..6 and 100, f = 1: the Krum selections are 1..5, and 2, 3, 4 are averaged
    trainer, _ = fit(tmp_path, [4] * 7, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 100.0], RobustAggregation(aggregator="bulyan"))
    assert trainer.global_state.item() == pytest.approx(3.0)


def test_fedavg_is_pulled_by_the_outlier(tmp_path):
    trainer, _ = fit(tmp_path, SIZES, VALUES, FedAvg())
    assert trainer.global_state.item() == pytest.approx((2 + 6 + 12 + 20 + 600) / 20)


def test_the_rules_client_hooks_and_server_update_are_kept(tmp_path):
    # FedProx, μ = 1, two SGD steps of lr 0.5 from w = 0: w₁ = y/2, then ∇ = (y/2 − y) + y/2 = 0, so each
    # client returns y/2 (FedAvg's clients would return 3y/4); the median is then 3/2.
    trainer, _ = fit(tmp_path, SIZES, VALUES, RobustAggregation(FedProx(mu=1.0)), lr=0.5, local_epochs=2)
    assert trainer.global_state.item() == pytest.approx(1.5)
    assert RobustAggregation(FedProx(mu=1.0)).tolerate_stragglers  # FedProx's own setting
    # FedAvgM, η = 0.5: v = W⁰ − median = −3, W¹ = 0 − 0.5·(−3)
    trainer, _ = fit(tmp_path, SIZES, VALUES, RobustAggregation(FedAvgM(momentum=0.5, server_lr=0.5)))
    assert trainer.global_state.item() == pytest.approx(1.5)


def test_state_round_trips_through_a_checkpoint(tmp_path):
    def make():
        return RobustAggregation(FedAvgM(momentum=0.5), aggregator="trimmed_mean", beta=0.2)

    straight, _ = fit(tmp_path, SIZES, VALUES, make(), rounds=2, lr=0.5)
    first, _ = fit(tmp_path, SIZES, VALUES, make(), rounds=1, lr=0.5)
    resumed, _ = fit(
        tmp_path, SIZES, VALUES, make(), rounds=2, lr=0.5, ckpt_path=first.run_dir / "checkpoints" / "last.ckpt"
    )
    torch.testing.assert_close(resumed.global_state, straight.global_state, rtol=0, atol=0)
    assert "velocity" in resumed.run.strategy.state_dict()["rule"]


def test_too_few_clients_for_krum_names_the_flags(tmp_path):
    with pytest.raises(ConfigError, match="clients_per_round"):
        fit(tmp_path, SIZES[:4], VALUES[:4], RobustAggregation(aggregator="krum", f=1))


@pytest.mark.parametrize(
    ("aggregator", "f", "clients", "needed"), [("krum", 2, 5, "2f + 3 = 7"), ("bulyan", 1, 6, "4f + 3 = 7")]
)
def test_krum_and_bulyan_bounds_are_checked_before_the_run_folder(tmp_path, aggregator, f, clients, needed):
    with pytest.raises(ConfigError, match=rf"f={f} needs at least {re.escape(needed)} clients per round") as err:
        fit(tmp_path, [4] * clients, [1.0] * clients, RobustAggregation(aggregator=aggregator, f=f))
    assert f"but {clients} train each round" in str(err.value)
    assert not list(tmp_path.rglob("version_*"))  # refused before any run folder or round


def test_a_client_the_engine_leaves_out_counts_among_the_tolerated_f(tmp_path):
    # seven clients, f = 1; client 6's target is 1e30, whose loss overflows fp32, so the engine leaves it out as
    # non-finite. It is the one tolerated Byzantine client: Bulyan aggregates the other six with f = 0, whose
    # selection keeps all six and whose trimmed mean around the median keeps θ − 2f = 6 values: the plain mean of
    # 1…6.
    values = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 1e30]
    with pytest.warns(UserWarning, match="Client 6 returned a state with NaN/Inf"):
        trainer, metrics = fit(tmp_path, [4] * 7, values, RobustAggregation(aggregator="bulyan", f=1))
    assert metrics["round/clients_aggregated"] == 6
    assert trainer.global_state.item() == pytest.approx(sum(values[:6]) / 6)


def test_more_clients_left_out_than_f_lower_f_to_what_the_rest_admit_with_a_warning():
    # Krum with f = 1 over 3 states (two of five left out): f − 2 < 0, so f = 0, which K = 3 > 2 admits: one
    # neighbour each, scores 4, 1, 1 for 0, 2, 3, and the tie goes to the smaller state, 2. Over 2 states not even
    # f = 0 is admitted (K > 2), so their coordinate-wise median, the midpoint, is taken.
    from fedlight.plans import ClientPlan, ClientUpdate

    rule = RobustAggregation(aggregator="krum", f=1)
    rule.on_round_start(None, 0, [ClientPlan(k, 1, False) for k in range(5)])
    updates = [ClientUpdate(k, 1, 1, 1, 0.0) for k in range(3)]
    states = torch.tensor([[0.0], [2.0], [3.0]])
    assert rule.aggregate_chunks(torch.zeros(1), StateChunks.of(states), updates).item() == 2.0
    with pytest.warns(UserWarning, match="cannot aggregate the 2 clients left .* coordinate-wise median"):
        aggregate = rule.aggregate_chunks(torch.zeros(1), StateChunks.of(states[:2]), updates[:2])
    assert aggregate.item() == 1.0


def test_bad_settings_are_reported_together():
    with pytest.raises(ConfigError, match="beta") as error:
        RobustAggregation(beta=0.5, f=-1)
    assert "init_args.f" in str(error.value)


def test_nested_rule_from_yaml():
    parser = build_parser()
    cfg = parser.parse_args(
        ["fit", "--config", str(REPO / "conf/robust/median_fedprox.yaml"), "--strategy.init_args.aggregator=bulyan"]
    )
    strategy = parser.instantiate(cfg).fit.strategy
    assert isinstance(strategy, RobustAggregation) and strategy.aggregator == "bulyan" and strategy.f == 2
    assert isinstance(strategy.rule, FedProx) and strategy.rule.mu == 0.01


def test_the_cifar10_config_builds_an_attacked_defense_on_the_fedsls_setting():
    parser = build_parser()
    cfg = parser.parse_args(["fit", "--config", str(REPO / "conf/robust/cifar10_label_flip_median.yaml")])
    fit_cfg = parser.instantiate(cfg).fit
    attack = fit_cfg.strategy
    assert isinstance(attack, Attack) and attack.kind == "label_flip" and attack.fraction == 0.2
    assert isinstance(attack.rule, RobustAggregation) and attack.rule.aggregator == "median"
    assert attack.sampling == "uniform"  # the FedSLS setting, read through both wrappers
    assert type(fit_cfg.data.dataset).__name__ == "CIFAR10" and fit_cfg.trainer.run.rounds == 2000


# -- the shared invariants, for every aggregator --------------------------------------------------------

ALL = {
    "median": {},
    "trimmed_mean": {"beta": 0.2},
    "krum": {"f": 1},
    "multi_krum": {"f": 1},
    "bulyan": {"f": 1},
}


@pytest.mark.parametrize("aggregator", list(ALL))
def test_identical_clients_are_a_fixed_point(tmp_path, aggregator):
    trainer, _ = fit(
        tmp_path, [6] * 7, [1.5] * 7, RobustAggregation(aggregator=aggregator, **ALL[aggregator]), rounds=2
    )
    assert trainer.global_state.item() == pytest.approx(1.5, abs=1e-7)


@pytest.mark.parametrize("aggregator", list(ALL))
def test_result_does_not_depend_on_client_order(tmp_path, aggregator):
    sizes, values = [4, 6, 10, 8, 12, 14, 16], [1.0, -2.0, 4.0, 0.5, 7.0, 3.0, -9.0]  # no ties among distances
    order = [2, 0, 3, 1, 6, 4, 5]
    make = lambda: RobustAggregation(aggregator=aggregator, **ALL[aggregator])  # noqa: E731
    w, _ = fit(tmp_path, sizes, values, make(), rounds=2, lr=0.5)
    permuted, _ = fit(tmp_path, [sizes[i] for i in order], [values[i] for i in order], make(), rounds=2, lr=0.5)
    torch.testing.assert_close(permuted.global_state, w.global_state)
