"""Gathered states read in column blocks: every aggregator and aggregation-step attack gives the same result in many
blocks as in one, the engine keeps each gathered block within --trainer.gather_budget_mb, and gathering rules see
their clients' weights."""

from statistics import NormalDist

import numpy as np
import pytest
import torch

from fedlight.clients import ClassificationClient
from fedlight.data import FederatedDataModule
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.gather import StateChunks
from fedlight.plans import ClientUpdate
from fedlight.strategies import Attack, FedAvg, RobustAggregation
from fedlight.strategies import robust_functional as R
from fedlight.strategies.base import Strategy
from fedlight.strategies.robust import squared_distances
from fedlight.testing import ClientImages, ScalarClient, ScalarDataset

AGGREGATORS = {
    "median": {},
    "trimmed_mean": {"beta": 0.2},
    "krum": {"f": 1},
    "multi_krum": {"f": 1},
    "bulyan": {"f": 1},
}
K, P = 7, 53  # P is prime: no block width divides it, so the last block is always shorter


def random_states(seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(K, P, generator=generator), torch.rand(K, generator=generator).double() + 0.5


@pytest.mark.parametrize("aggregator", list(AGGREGATORS))
@pytest.mark.parametrize("width", [1, 4, 10, 52])
def test_every_aggregator_gives_the_same_bits_in_blocks(aggregator, width):
    states, weights = random_states()
    rule = RobustAggregation(aggregator=aggregator, **AGGREGATORS[aggregator])
    whole = rule.robust_aggregate(states, weights)
    selected_whole = list(rule._selected)
    chunks = StateChunks.of(states, width=width)
    blocked = rule.robust_aggregate(chunks, weights)
    # the distances' fp64 sums differ in their last bits at most, too little to change a selection of
    # distinct random states; everything else is coordinate-wise, so the results are bit-identical
    torch.testing.assert_close(blocked, whole, rtol=0, atol=0)
    assert rule._selected == selected_whole
    assert chunks.peak_nbytes == K * width * 4  # never more than one block of all clients


def test_block_distances_add_up_to_the_whole_distances():
    states, _ = random_states(1)
    whole = R.squared_distances(states)
    blocked = squared_distances(StateChunks.of(states, width=5))
    expected = torch.cdist(states.double(), states.double()).square()  # an independent formula
    torch.testing.assert_close(blocked, whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(blocked, expected, rtol=1e-9, atol=1e-9)


def aggregation_attack(kind, attackers, scale=None):
    attack = Attack(FedAvg(), kind=kind, fraction=0.3, scale=scale)
    attack._is_parameter = torch.ones(P, dtype=torch.bool)
    attack._is_parameter[-3:] = False  # floating-point buffers stay the attacker's own
    attack.attackers = set(attackers)
    return attack


@pytest.mark.parametrize("kind", ["alie", "ipm"])
def test_alie_and_ipm_are_the_same_in_blocks_and_match_the_formula(kind):
    states, _ = random_states(2)
    global_state = torch.randn(P, generator=torch.Generator().manual_seed(3))
    updates = [ClientUpdate(client=c, num_samples=10, epochs=1, num_steps=1, train_loss=0.0) for c in range(K)]
    attackers = [1, 4]
    whole = aggregation_attack(kind, attackers).aggregate_chunks(global_state, StateChunks.of(states), updates)
    blocked = aggregation_attack(kind, attackers).aggregate_chunks(
        global_state, StateChunks.of(states, width=6), updates
    )
    torch.testing.assert_close(blocked, whole, rtol=0, atol=0)
    # by hand (numpy): the honest updates' mean and unbiased std per coordinate; equal weights n_k = 10
    deltas = (states - global_state).double().numpy()
    honest = deltas[[k for k in range(K) if k not in attackers]]
    z = NormalDist().inv_cdf((K - (K // 2 + 1 - 2)) / K)
    malicious = honest.mean(0) - z * honest.std(0, ddof=1) if kind == "alie" else -0.1 * honest.mean(0)
    rows = deltas.copy()
    rows[attackers, :-3] = malicious[:-3]
    expected = global_state.double().numpy() + rows.mean(0)
    np.testing.assert_allclose(whole.double().numpy(), expected, rtol=1e-5, atol=1e-5)


# -- through the engine ------------------------------------------------------------------------------

STRATEGIES = {
    **{name: lambda name=name: RobustAggregation(aggregator=name, **AGGREGATORS[name]) for name in AGGREGATORS},
    "alie_median": lambda: Attack(RobustAggregation(aggregator="median"), kind="alie", fraction=0.3, redraw=True),
    "ipm_fedavg": lambda: Attack(FedAvg(), kind="ipm", fraction=0.3),
}
SIZES, SEEDS = [10, 14, 8, 12, 9, 11, 13], [1, 2, 3, 4, 5, 6, 7]
TINY = 7 * 4 * 40  # bytes: 40 columns of 7 clients per block


def fit_images(tmp_path, strategy, budget_mb=1024.0):
    data = FederatedDataModule(ClientImages(SIZES, SEEDS), batch_size=1000, test_fraction=0.0)
    trainer = FederatedTrainer(
        rounds=2, clients_per_round=7, local_epochs=1, logger=None, enable_progress_bar=False,
        default_root_dir=tmp_path, gather_budget_mb=budget_mb,
    )  # fmt: skip
    torch.manual_seed(0)
    client = ClassificationClient(
        num_classes=3, input_shape=(1, 8, 8), model="cnn", model_kwargs={"hidden": 8},
        optimizer=lambda params: torch.optim.SGD(params, lr=0.05),
    )  # fmt: skip
    trainer.fit(client, data, strategy)
    return trainer


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_a_tiny_budget_gives_the_same_model_in_bounded_blocks(tmp_path, name):
    whole = fit_images(tmp_path, STRATEGIES[name]())
    numel = whole.model.layout.numel
    assert whole.run.pieces.aggregation.gather_peak_nbytes == 7 * numel * 4  # one block: every client's whole state
    blocked = fit_images(tmp_path, STRATEGIES[name](), budget_mb=TINY / 2**20)
    assert blocked.run.pieces.aggregation.gather_peak_nbytes == TINY < whole.run.pieces.aggregation.gather_peak_nbytes
    assert numel > 40 * 20  # many blocks
    torch.testing.assert_close(blocked.global_state, whole.global_state, rtol=0, atol=0)


class WeightedMeanOfGathered(Strategy):
    """A gathering rule that averages the states with the weights the engine recorded in every update."""

    gather_states = True

    def aggregate_states(self, global_state, states, updates):
        weights = torch.tensor([u.weights[0] for u in updates], dtype=states.dtype)
        self.seen = [u.weights for u in updates]
        return (weights / weights.sum()) @ states


def test_gathering_rules_see_the_client_weights(tmp_path):
    # ScalarClient: one full-batch SGD step of lr 1 lands on the client's target; n_k = int(0.5·size)
    sizes, values = [4, 6, 8], [1.0, 2.0, 7.0]
    data = FederatedDataModule(ScalarDataset(sizes, values), batch_size=10_000, test_fraction=0.5)
    trainer = FederatedTrainer(
        rounds=1, clients_per_round=3, local_epochs=1, logger=None, enable_progress_bar=False, default_root_dir=tmp_path
    )
    strategy = WeightedMeanOfGathered()
    trainer.fit(ScalarClient(), data, strategy)
    assert strategy.seen == [(2.0,), (3.0,), (4.0,)]
    assert trainer.global_state.item() == pytest.approx((2 * 1.0 + 3 * 2.0 + 4 * 7.0) / 9)


def test_a_rule_that_needs_whole_states_reads_them_whole_with_a_warning(tmp_path):
    with pytest.warns(UserWarning, match="gather_budget_mb"):
        trainer = fit_images(tmp_path, WeightedMeanOfGathered(), budget_mb=TINY / 2**20)
    assert trainer.run.pieces.aggregation.gather_peak_nbytes == 7 * trainer.model.layout.numel * 4


def test_a_budget_that_is_not_positive_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="gather_budget_mb"):
        FederatedTrainer(gather_budget_mb=0, default_root_dir=tmp_path)
