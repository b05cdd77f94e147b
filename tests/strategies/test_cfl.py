"""CFL through the engine against Algorithm 2 of Sattler et al. (IEEE TNNLS 2020) written out in plain Python.

A client's loss pulls its model to one point: ScalarClient's ½(w − y)² to y, the plane client's ½‖w − (cos y, sin y)‖²
to the unit vector of angle y. One full-batch step of SGD with lr η from θ moves the client by Δθ = η (target − θ),
so the updates, their norms and cosine similarities, and so every split are known in closed form. The reference
finds the optimal bipartition of Algorithm 1 by trying every bipartition, not by agglomerative clustering.
"""

import itertools
import math

import numpy as np
import pytest
import torch

from fedlight.data import FederatedDataModule
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.strategies.cfl import CFL, optimal_bipartition
from fedlight.testing import ScalarClient, ScalarDataset


class PlaneClient(ScalarClient):
    """w ∈ R², pulled by the loss ½‖w − (cos y, sin y)‖² to the unit vector of its samples' angle y."""

    def __init__(self, lr: float = 1.0) -> None:
        super().__init__(lr=lr)
        self.w = torch.nn.Parameter(torch.zeros(2))

    @staticmethod
    def point(y):
        return torch.stack([torch.cos(y), torch.sin(y)], dim=-1)  # [B, 2]

    def training_step(self, batch, batch_idx):
        return {"loss": 0.5 * (self.w - self.point(batch[1])).square().sum(-1).mean()}

    def validation_step(self, batch, batch_idx):
        return {"loss": 0.5 * (self.w - self.point(batch[1])).square().sum(-1)}


class Scheduled(CFL):
    """CFL whose rounds train the clients of ``schedule``, one list per round, whatever the round size."""

    def __init__(self, schedule, **kwargs):
        super().__init__(**kwargs)
        self.schedule, self.drawn = schedule, 0

    def sample_clients(self, num_samples, k, rng):
        self.drawn += 1
        return np.array(self.schedule[self.drawn - 1])


def fit(root, sizes, values, strategy, rounds, client, clients_per_round=None, ckpt_path=None):
    """Client k holds sizes[k] samples of target values[k], half of them held out; one full-batch step a round."""
    data = FederatedDataModule(ScalarDataset(sizes, values), batch_size=10_000, test_fraction=0.5)
    trainer = FederatedTrainer(
        rounds=rounds, clients_per_round=clients_per_round or len(sizes), local_epochs=1, logger=None,
        enable_progress_bar=False, default_root_dir=root,
    )  # fmt: skip
    trainer.fit(client, data, strategy, ckpt_path=ckpt_path)
    return trainer


def best_bipartition(alpha):
    """Algorithm 1's objective, minimised over every bipartition: (max cross similarity, first half, second half)."""
    n = len(alpha)
    candidates = []
    for size in range(1, n):
        for rest in itertools.combinations(range(1, n), size - 1):
            first = [0, *rest]
            second = [i for i in range(n) if i not in first]
            candidates.append((max(alpha[i][j] for i in first for j in second), first, second))
    return min(candidates)


def algorithm_2(schedule, sizes, angles, lr, eps1, eps2, gamma_max=0.0, weighting="samples", max_clusters=8):
    """Cluster of every client, the clusters' models, the splits and the splits refused for want of a free bank member
    after the rounds of ``schedule``.

    The plane clients of ``angles``: client k holds sizes[k] // 2 training samples and moves its cluster's model θ
    by Δθ_k = lr (u_k − θ) in a round, u_k the unit vector of its angle.
    """
    targets = [np.array([math.cos(a), math.sin(a)]) for a in angles]
    weights = [size // 2 if weighting == "samples" else 1 for size in sizes]
    assignment = [0] * len(sizes)
    models = {c: np.zeros(2) for c in range(max_clusters)}
    splits, refused = [], 0
    for t, present in enumerate(schedule):
        delta = {k: lr * (targets[k] - models[assignment[k]]) for k in present}
        tested = sorted({assignment[k] for k in present})
        updates = {}
        for c in tested:
            ks = [k for k in present if assignment[k] == c]
            updates[c] = sum(weights[k] * delta[k] for k in ks) / sum(weights[k] for k in ks)  # Δθ_c
            models[c] = models[c] + updates[c]
        for c in tested:
            members = [k for k in range(len(sizes)) if assignment[k] == c]
            if any(k not in present for k in members) or len(members) < 2:
                continue
            norms = {k: np.linalg.norm(delta[k]) for k in members}
            if not (np.linalg.norm(updates[c]) < eps1 and max(norms.values()) > eps2):
                continue
            alpha = [[delta[i] @ delta[j] / (norms[i] * norms[j]) for j in members] for i in members]
            cross, _, second = best_bipartition(alpha)
            if not gamma_max < math.sqrt((1 - cross) / 2):
                continue
            free = set(range(max_clusters)) - set(assignment)
            if not free:
                refused += 1
                continue
            free = min(free)
            for position in second:
                assignment[members[position]] = free
            models[free] = models[c].copy()
            splits.append([t + 1, c, free])
    return assignment, models, splits, refused


def test_two_groups_of_opposite_targets_split_by_hand(tmp_path):
    # From w = 0, one step of lr ½ moves clients 0, 1 (y = 2) by +1 and clients 2, 3 (y = −2) by −1: the n-weighted
    # mean update is (2 + 4 − 2 − 4)/12 = 0 < ε1, the longest 1 > ε2, the similarities +1 within a group and −1
    # across. Round 1 splits {0, 1} from {2, 3}, both at the round's average 0; then each cluster trains alone:
    # 0 → 1 → 1.5 and 0 → −1 → −1.5. The global model is the mean of the two, 0.
    strategy = CFL(eps1=0.5, eps2=0.8, max_clusters=3)
    trainer = fit(tmp_path, [4, 8, 4, 8], [2.0, 2.0, -2.0, -2.0], strategy, rounds=3, client=ScalarClient(lr=0.5))
    assert strategy.assignment == [0, 0, 1, 1]
    assert strategy.splits == [[1, 0, 1]]
    assert trainer.model.bank.clusters[:2].flatten().tolist() == pytest.approx([1.5, -1.5])
    assert trainer.global_state.item() == pytest.approx(0.0, abs=1e-7)
    metrics = trainer.history[-1]
    # every held-out sample scored by its cluster's model: ½(1.5 − 2)²; by the global model: ½(0 − 2)²
    assert metrics["clients/routed/loss"] == pytest.approx(0.125)
    assert metrics["clients/loss"] == pytest.approx(2.0)
    assert metrics["cfl/clusters"] == 2 and metrics["cfl/mean_update_norm"] == pytest.approx(0.5)


SIZES = [4, 8, 6, 4, 10, 6]
ANGLES = [0.0, 0.3, 2.5, 2.8, -1.9, -2.2]  # three pairs of clients, each pair pulling to its own direction
# every client in round 1; later rounds leave clients out, so that some clusters wait for all their clients
SCHEDULE = [[0, 1, 2, 3, 4, 5], [0, 1, 2, 4], [0, 1, 2, 3, 4, 5], [2, 3, 4, 5], [1, 2, 3, 4, 5], [0, 2, 3, 4, 5]]


@pytest.mark.parametrize("weighting", ["samples", "uniform"])
def test_rounds_of_partial_participation_follow_algorithm_2(tmp_path, weighting):
    kwargs = {"eps1": 0.1, "eps2": 0.3}
    strategy = Scheduled(SCHEDULE, weighting=weighting, max_clusters=4, **kwargs)
    trainer = fit(tmp_path, SIZES, ANGLES, strategy, rounds=len(SCHEDULE), client=PlaneClient(lr=0.5))
    assignment, models, splits, _ = algorithm_2(SCHEDULE, SIZES, ANGLES, 0.5, weighting=weighting, **kwargs)
    assert len(splits) >= 2, "the reference should split more than once, or the test checks little"
    assert strategy.splits == splits
    assert strategy.assignment == assignment
    for cluster in set(assignment):
        member = trainer.model.bank.member(cluster).tolist()
        assert member == pytest.approx(models[cluster].tolist(), abs=1e-5), f"cluster {cluster}"


def test_a_split_past_the_banks_members_is_refused(tmp_path):
    kwargs = {"eps1": 0.1, "eps2": 0.3, "weighting": "uniform", "max_clusters": 2}
    strategy = Scheduled(SCHEDULE, **kwargs)
    trainer = fit(tmp_path, SIZES, ANGLES, strategy, rounds=len(SCHEDULE), client=PlaneClient(lr=0.5))
    assignment, models, splits, refused = algorithm_2(SCHEDULE, SIZES, ANGLES, 0.5, **kwargs)
    assert refused > 0 and len(splits) == 1
    assert (strategy.assignment, strategy.splits, strategy.refused) == (assignment, splits, refused)
    assert trainer.history[-1]["cfl/splits_refused"] == refused
    for cluster in (0, 1):
        assert trainer.model.bank.member(cluster).tolist() == pytest.approx(models[cluster].tolist(), abs=1e-5)


@pytest.mark.parametrize(("gamma_max", "splits"), [(0.83, [[1, 0, 1]]), (0.85, [])])
def test_gamma_max_allows_only_splits_it_tolerates(tmp_path, gamma_max, splits):
    # Round 1 from w = 0: clients 0, 1 move by ½u(0), clients 2, 3 by ½u(2); α_cross^max = cos 2 = −0.416, so the
    # split is made for γ_max < √((1 + 0.416)/2) = 0.8415. Mean update ½ cos 1 = 0.27 < ε1, longest ½ > ε2.
    strategy = CFL(eps1=0.3, eps2=0.4, gamma_max=gamma_max)
    fit(tmp_path, [4, 4, 4, 4], [0.0, 0.0, 2.0, 2.0], strategy, rounds=1, client=PlaneClient(lr=0.5))
    assert strategy.splits == splits


@pytest.mark.parametrize(
    ("kwargs", "splits"),
    [({}, [[1, 0, 1]]), ({"warmup_rounds": 1}, [[2, 0, 1]]), ({"min_split_size": 5}, []), ({"eps2": 1.0}, [])],
)
def test_warmup_cluster_size_and_thresholds_hold_splits_back(tmp_path, kwargs, splits):
    # the hand case above: round 1 (and, the average staying at 0, round 2) meets ‖Δθ_c‖ = 0 < ε1 and max 1 > ε2
    strategy = CFL(**{"eps1": 0.5, "eps2": 0.8, **kwargs})
    fit(tmp_path, [4, 8, 4, 8], [2.0, 2.0, -2.0, -2.0], strategy, rounds=2, client=ScalarClient(lr=0.5))
    assert strategy.splits == splits


def test_a_cluster_missing_a_client_in_its_round_does_not_split(tmp_path):
    strategy = CFL(eps1=10.0, eps2=0.1)  # every cluster that may be tested splits
    with pytest.warns(UserWarning, match="never split"):
        trainer = fit(
            tmp_path, [4, 8, 4, 8], [2.0, 2.0, -2.0, -2.0], strategy, rounds=3, client=ScalarClient(lr=0.5),
            clients_per_round=3,
        )  # fmt: skip
    assert strategy.splits == [] and strategy.assignment == [0, 0, 0, 0]
    assert trainer.history[-1]["cfl/clusters"] == 1


def test_a_resumed_run_ends_where_the_uninterrupted_one_does(tmp_path):
    # every client in every round: splits in rounds 2 and 5 (algorithm_2), one on each side of the checkpoint
    def run(root, rounds, ckpt_path=None):
        strategy = CFL(eps1=0.1, eps2=0.3)
        trainer = fit(root, SIZES, ANGLES, strategy, rounds=rounds, client=PlaneClient(lr=0.5), ckpt_path=ckpt_path)
        return trainer, strategy

    straight, straight_rule = run(tmp_path / "straight", 6)
    first, _ = run(tmp_path / "resumed", 3)
    resumed, resumed_rule = run(tmp_path / "resumed", 6, first.run_dir / "checkpoints" / "last.ckpt")
    assert straight_rule.splits == [[2, 0, 1], [5, 1, 2]]
    assert resumed_rule.state_dict() == straight_rule.state_dict()
    assert torch.equal(resumed.model.bank.clusters, straight.model.bank.clusters)
    assert torch.equal(resumed.global_state, straight.global_state)


def test_optimal_bipartition_minimises_the_largest_cross_similarity():
    generator = np.random.default_rng(0)
    for n in (2, 3, 5, 7):
        for _ in range(20):
            vectors = generator.normal(size=(n, 4))
            unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
            alpha = unit @ unit.T
            first, second = optimal_bipartition(alpha)
            assert sorted(first + second) == list(range(n)) and first and second and 0 in first
            assert alpha[np.ix_(first, second)].max() == pytest.approx(best_bipartition(alpha.tolist())[0])


def test_complete_linkage_can_miss_the_optimum():
    # Four clients on a line at 0, 0.5, 1.025 and 1.6, α = 1 − distance. Single linkage cuts the widest gap (0.575):
    # {0, 1, 2} | {3}, of largest cross similarity 1 − 0.575. Complete linkage joins 0 and 1 (0.5), then 2 and 3
    # (0.575 < 1.025, the farthest of 2 from {0, 1}): {0, 1} | {2, 3}, whose cross similarity reaches 1 − 0.525.
    position = np.array([0.0, 0.5, 1.025, 1.6])
    alpha = 1.0 - np.abs(position[:, None] - position[None, :])
    assert optimal_bipartition(alpha, "single") == ([0, 1, 2], [3])
    assert optimal_bipartition(alpha, "complete") == ([0, 1], [2, 3])
    assert best_bipartition(alpha.tolist())[0] == pytest.approx(1 - 0.575)


def test_bad_settings_are_reported_together():
    with pytest.raises(ConfigError) as err:
        CFL(eps1=0.0, eps2=-1.0, gamma_max=1.0, warmup_rounds=-1, min_split_size=1, max_clusters=1)
    message = str(err.value)
    for flag in ("eps1", "eps2", "gamma_max", "warmup_rounds", "min_split_size", "max_clusters"):
        assert f"--strategy.init_args.{flag}" in message
