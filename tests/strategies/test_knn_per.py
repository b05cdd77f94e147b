"""kNN-Per through the engine: a small MLP over ClientImages, two of five clients per round. The global model must be
FedAvg's to the bit, and after every round each client's held-out split is scored against Marfoq et al. (ICML 2022)
computed independently: the MLP's embeddings and logits from the recorded W^{t+1} in plain torch (fp32, as the
network runs), each client's datastore searched by scikit-learn's brute-force KNeighborsClassifier with the kernel
exp(−d²/T) as its weights, and λ · p_kNN + (1 − λ) · softmax(logits) in numpy."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.neighbors import KNeighborsClassifier

from fedlight.clients import ClassificationClient
from fedlight.data import FederatedDataModule
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.strategies.fedavg import FedAvg
from fedlight.strategies.knn_per import KNNPer, knn_probabilities
from fedlight.testing import ClientImages

SIZES, SEEDS = [12, 16, 8, 20, 12], [1, 2, 3, 4, 5]
LR, EPOCHS, ROUNDS, HIDDEN = 0.1, 2, 3, 6


class Recorded(KNNPer):
    """KNNPer that notes W^{t+1} and what it logged after every round."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.states, self.logged = [], []

    def on_round_end(self, context, round_idx, updates):
        self.states.append(context.global_state.clone())
        self.logged.append(super().on_round_end(context, round_idx, updates))
        return self.logged[-1]


def fit(root, rule, rounds=ROUNDS, test_fraction=0.25):
    data = FederatedDataModule(ClientImages(SIZES, SEEDS), batch_size=5, test_fraction=test_fraction)
    trainer = FederatedTrainer(
        rounds=rounds, clients_per_round=2, local_epochs=EPOCHS, logger=None, enable_progress_bar=False,
        default_root_dir=root,
    )  # fmt: skip
    torch.manual_seed(0)
    client = ClassificationClient(
        num_classes=3, input_shape=(1, 8, 8), model="mlp", model_kwargs={"hidden": [HIDDEN]},
        optimizer=lambda params: torch.optim.SGD(params, lr=LR),
    )  # fmt: skip
    trainer.fit(client, data, rule)
    return trainer


def embed(weights, x):
    """φ(x) [B, HIDDEN] and logits [B, 3] of Flatten → Linear → ReLU → Linear: the network's fp32 arithmetic, so
    that neighbours at a small T are those the run sees; fp64 numpy from there on."""
    hidden = F.linear(x.flatten(1), weights["net.encoder.1.weight"], weights["net.encoder.1.bias"]).relu()
    logits = F.linear(hidden, weights["net.head.weight"], weights["net.head.bias"])
    return hidden.double().numpy(), logits.double().numpy()


def reference(trainer, state, lam, k, temperature):
    """(Σ correct, Σ count, Σ −log p) per client of the interpolated prediction under the flat ``state``."""
    data = trainer.run.datamodule
    weights = trainer.model.layout.to_state_dict(state, {})
    inputs, targets = data.pool.inputs, data.pool.targets.numpy()
    rows = []
    for client in range(len(SIZES)):
        train = data.client_train[client]
        held_out = data.held_out_index[data.held_out_group == client]
        keys, _ = embed(weights, inputs[train])
        queries, logits = embed(weights, inputs[held_out])
        t = temperature or keys.shape[1]

        def kernel(distances, t=t):  # exp(−d²/T), each row scaled by its largest weight (the ratio is unchanged)
            squared = distances**2
            return np.exp(-(squared - squared.min(axis=1, keepdims=True)) / t)

        knn = KNeighborsClassifier(n_neighbors=min(k, len(train)), weights=kernel, algorithm="brute")
        knn.fit(keys, targets[train])
        p_knn = np.zeros((len(held_out), 3))
        p_knn[:, knn.classes_] = knn.predict_proba(queries)
        p_global = np.exp(logits - logits.max(axis=1, keepdims=True))
        p_global /= p_global.sum(axis=1, keepdims=True)
        p = lam * p_knn + (1 - lam) * p_global
        y = targets[held_out]
        nll = -np.log(np.maximum(p[np.arange(len(y)), y], 1e-12))
        rows.append(((p.argmax(axis=1) == y).sum(), len(y), nll.sum()))
    return np.array(rows, dtype=np.float64)


@pytest.mark.parametrize(("lam", "k", "temperature"), [(0.5, 3, None), (0.8, 5, 0.05), (1.0, 20, 2.0)])
def test_rounds_of_fedavg_scored_with_the_interpolation_follow_the_reference(tmp_path, lam, k, temperature):
    rule = Recorded(lam=lam, k=k, temperature=temperature)
    trainer = fit(tmp_path / "knn", rule)
    fedavg = fit(tmp_path / "fedavg", FedAvg())
    torch.testing.assert_close(trainer.global_state, fedavg.global_state, rtol=0, atol=0)  # training is FedAvg's
    assert len(rule.logged) == ROUNDS
    for round_idx, (state, logged) in enumerate(zip(rule.states, rule.logged, strict=True)):
        correct, count, nll = reference(trainer, state, lam, k, temperature).T
        assert logged["knn_per/acc"] == pytest.approx(correct.sum() / count.sum(), abs=1e-12)
        assert logged["knn_per/loss"] == pytest.approx(nll.sum() / count.sum(), rel=1e-9)
        np.testing.assert_allclose(logged["knn_per/acc_per_client"].numpy(), correct / count, atol=1e-7)
        assert logged["knn_per/acc_mean"] == pytest.approx((correct / count).mean(), abs=1e-12)
        history = trainer.history[round_idx]
        assert history["knn_per/acc"] == logged["knn_per/acc"]  # logged as the round's metrics
        # the datastores did something: the global model alone scores otherwise
        assert history["knn_per/loss"] != pytest.approx(history["clients/loss"], rel=1e-3)


def test_lam_zero_is_the_global_model_the_engine_scores(tmp_path):
    trainer = fit(tmp_path, KNNPer(lam=0.0, k=3))
    for row in trainer.history:
        assert row["knn_per/acc"] == pytest.approx(row["clients/acc"], abs=1e-12)
        assert row["knn_per/acc_mean"] == pytest.approx(row["clients/acc_mean"], abs=1e-12)
        assert row["knn_per/loss"] == pytest.approx(row["clients/loss"], rel=1e-5)  # fp64 here, fp32 there


def test_knn_probabilities_by_hand():
    keys = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0], [3.0, 3.0]], dtype=torch.float64)
    labels = torch.tensor([0, 1, 1, 2])
    queries = torch.tensor([[0.0, 0.0], [3.0, 2.0]], dtype=torch.float64)
    # query 0: d² = 0, 1, 4 (18 is the 4th); T = 2 weighs them 1, e^{−1/2}, e^{−2}
    # query 1: d² = 1 (label 2), 8 (label 1), 9 (label 1); T = 2: e^{−1/2}, e^{−4}, e^{−9/2}
    p = knn_probabilities(queries, keys, labels, num_classes=3, k=3, temperature=2.0)
    w0 = np.array([1, np.exp(-0.5), np.exp(-2)])
    w1 = np.array([np.exp(-0.5), np.exp(-4), np.exp(-4.5)])
    expected = [[w0[0], w0[1] + w0[2], 0], [0, w1[1] + w1[2], w1[0]]] / np.array([[w0.sum()], [w1.sum()]])
    np.testing.assert_allclose(p.numpy(), expected, rtol=1e-12)
    # more neighbours than entries: all four, and far ones (e^{−d²/T} = 0 in fp64) still give a distribution
    p = knn_probabilities(queries + 100, keys, labels, num_classes=3, k=10, temperature=1e-3)
    np.testing.assert_allclose(p.numpy(), [[0, 0, 1], [0, 0, 1]], atol=1e-12)


def test_eval_every_and_no_held_out_data(tmp_path):
    trainer = fit(tmp_path / "every", KNNPer(eval_every=2))
    assert ["knn_per/acc" in row for row in trainer.history] == [False, True, True]  # rounds 2 and 3 (the last)
    trainer = fit(tmp_path / "last", KNNPer(eval_every=0))
    assert ["knn_per/acc" in row for row in trainer.history] == [False, False, True]
    trainer = fit(tmp_path / "none", KNNPer(), rounds=1, test_fraction=0.0)
    assert not any(key.startswith("knn_per/") for key in trainer.history[-1])


def test_bad_settings_are_reported_together():
    with pytest.raises(ConfigError) as err:
        KNNPer(lam=1.5, k=0, temperature=0.0, eval_every=-1)
    message = str(err.value)
    assert "lam (λ) in [0, 1], got 1.5" in message and "k ≥ 1 neighbours, got 0" in message
    assert "temperature (T) > 0 or null" in message and "eval_every ≥ 0" in message


def test_check_names_what_the_run_lacks():
    rule = KNNPer()
    plain = torch.nn.Module()
    data = FederatedDataModule(ClientImages(SIZES, SEEDS), centralized=True)
    problems = rule.check(plain, data)
    assert len(problems) == 2
    assert "module.net.forward_features" in problems[0] and "--data.centralized=false" in problems[1]
    client = ClassificationClient(num_classes=3, input_shape=(1, 8, 8), model="mlp")
    assert rule.check(client, FederatedDataModule(ClientImages(SIZES, SEEDS))) == []
