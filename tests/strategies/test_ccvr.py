"""CCVR through the engine against Algorithm 1 of Luo et al. (NeurIPS 2021) written out with NumPy and plain torch.

A small MLP trains on 8×8 images of 3 classes, two of four clients a round. The reference reads the features of
every training sample under the model the calibration starts from, takes NumPy's mean and covariance of each class's
pooled features (what Eqs. 3–4 must reproduce from the clients' messages), draws M_c virtual features per class from
the round's strategy stream, and trains a copy of the linear head on them with its own SGD loop.
"""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedlight.clients import ClassificationClient
from fedlight.data import FederatedDataModule
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.strategies.ccvr import CCVR, class_moments, class_statistics, combine_class_statistics
from fedlight.strategies.fedavg import FedAvg
from fedlight.testing import ClientImages, ScalarClient

SIZES, SEEDS = [14, 10, 12, 8], [1, 2, 3, 4]
M, LR, STEPS, BATCH = 40, 0.5, 12, 16  # 3·40 virtual features in batches of 16: the 12 steps span two epochs
HEAD = ["net.head.weight", "net.head.bias"]


class Recorded(CCVR):
    """CCVR that notes each calibration's statistics and the states around it, for the reference to replay."""

    def __init__(self, **kwargs):
        super().__init__(virtual_per_class=M, calib_lr=LR, calib_steps=STEPS, calib_batch_size=BATCH, **kwargs)
        self.statistics, self.updates, self.starts = [], [], {}

    def global_statistics(self, context, module):
        statistics = super().global_statistics(context, module)
        self.statistics.append([t.clone() for t in statistics])
        return statistics

    def server_update(self, global_state, aggregate, updates):
        new = super().server_update(global_state, aggregate, updates)
        self.updates.append((aggregate.clone(), new.clone()))
        return new

    def initial_state(self, context, plan, global_state):
        self.starts[(context.round, plan.client)] = global_state.clone()
        return global_state


def fit(root, strategy, rounds=2):
    data = FederatedDataModule(ClientImages(SIZES, SEEDS), batch_size=5, test_fraction=0.0)
    trainer = FederatedTrainer(
        rounds=rounds, clients_per_round=2, local_epochs=1, logger=None, enable_progress_bar=False,
        default_root_dir=root,
    )  # fmt: skip
    torch.manual_seed(0)
    client = ClassificationClient(
        num_classes=3, input_shape=(1, 8, 8), model="mlp", model_kwargs={"hidden": [6]},
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
    )  # fmt: skip
    trainer.fit(client, data, strategy)
    return trainer


def pooled_class_statistics(module):
    """NumPy's per-class mean and unbiased covariance of every client's training features under ``module``."""
    samples = ClientImages(SIZES, SEEDS).load_train()
    with torch.no_grad():
        features = module.net.forward_features(samples.inputs).double().numpy()  # [N, D]
    targets = samples.targets.numpy()
    counts = np.bincount(targets, minlength=3)
    means = [features[targets == c].mean(axis=0) for c in range(3)]
    covariances = [np.cov(features[targets == c], rowvar=False) for c in range(3)]
    return counts, means, covariances


def reference_head(module, rng):
    """Algorithm 1's calibration of ``module``'s linear head: ``(weight, bias)`` after STEPS SGD steps on virtual
    features drawn from the pooled statistics, batches from a fresh permutation each epoch."""
    _, means, covariances = pooled_class_statistics(module)
    z = np.concatenate([rng.multivariate_normal(means[c], covariances[c], M, method="eigh") for c in range(3)])
    z, y = torch.from_numpy(z).float(), torch.arange(3).repeat_interleave(M)
    weight = module.net.head.weight.detach().clone().requires_grad_()
    bias = module.net.head.bias.detach().clone().requires_grad_()
    steps = 0
    while steps < STEPS:
        order = torch.from_numpy(rng.permutation(len(y)))
        for start in range(0, len(y), BATCH):
            if steps == STEPS:
                break
            index = order[start : start + BATCH]
            loss = F.cross_entropy(z[index] @ weight.T + bias, y[index])
            grad_w, grad_b = torch.autograd.grad(loss, (weight, bias))
            with torch.no_grad():
                weight -= LR * grad_w
                bias -= LR * grad_b
            steps += 1
    return torch.cat([weight.detach().flatten(), bias.detach()])


def test_calibration_after_the_last_round_matches_algorithm_1(tmp_path):
    fedavg = fit(tmp_path, FedAvg())
    strategy = Recorded()
    ccvr = fit(tmp_path, strategy)
    assert len(strategy.statistics) == 1  # after the last round only, the paper's setting
    head = ccvr.model.layout.mask(HEAD)
    # training is FedAvg's: the body is FedAvg's to the bit, and so was the head before its calibration
    torch.testing.assert_close(ccvr.global_state[~head], fedavg.global_state[~head], rtol=0, atol=0)
    torch.testing.assert_close(strategy.updates[-1][0], fedavg.global_state, rtol=0, atol=0)

    module = fedavg.context.global_module()  # W^T, from which the clients' statistics are read
    counts, means, covariances = pooled_class_statistics(module)
    n, mu, sigma = strategy.statistics[0]
    assert n.tolist() == counts.tolist()
    np.testing.assert_allclose(mu.numpy(), np.stack(means), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(sigma.numpy(), np.stack(covariances), rtol=1e-5, atol=1e-6)

    expected = reference_head(module, ccvr.context.strategy_rng(1))
    torch.testing.assert_close(ccvr.global_state[head], expected, rtol=1e-4, atol=1e-5)
    assert (ccvr.global_state[head] - fedavg.global_state[head]).abs().max() > 1e-2  # the head did move
    last, first = ccvr.history[-1], ccvr.history[0]
    assert last["ccvr/virtual_loss_after"] < last["ccvr/virtual_loss_before"]
    assert "ccvr/virtual_loss_after" not in first


def test_calibrating_every_round_feeds_the_next_round(tmp_path):
    strategy = Recorded(calibrate_every=1)
    trainer = fit(tmp_path, strategy)
    head = trainer.model.layout.mask(HEAD)
    assert len(strategy.updates) == 2
    for round_idx, (aggregate, calibrated) in enumerate(strategy.updates):
        module = copy.deepcopy(trainer.model.module)
        trainer.model.layout.load(module, aggregate)
        module.eval()
        expected = reference_head(module, trainer.context.strategy_rng(round_idx))
        torch.testing.assert_close(calibrated[head], expected, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(calibrated[~head], aggregate[~head], rtol=0, atol=0)
    # round 1's clients (two of four) start from round 0's calibrated model
    starts = [state for (round_idx, _), state in strategy.starts.items() if round_idx == 1]
    assert len(starts) == 2
    for state in starts:
        torch.testing.assert_close(state, strategy.updates[0][1], rtol=0, atol=0)
    torch.testing.assert_close(trainer.global_state, strategy.updates[1][1], rtol=0, atol=0)


def test_client_statistics_combine_into_those_of_the_pooled_features():
    generator = np.random.default_rng(0)
    num_classes, width = 4, 3
    # class 2 is held once in all (client 1), class 3 by nobody; client 0 holds class 1 once
    labels = [np.array([0, 0, 0, 1, 0]), np.array([1, 1, 0, 2, 1, 1]), np.array([0, 1, 1, 1]), np.array([1, 0, 0])]
    features = [generator.normal(size=(len(y), width)) + 3.0 * y[:, None] for y in labels]
    messages = []
    for z, y in zip(features, labels, strict=True):
        z, y = torch.from_numpy(z), torch.from_numpy(y)
        whole = class_moments(z, y, num_classes)
        halves = [class_moments(z[part], y[part], num_classes) for part in (slice(0, 2), slice(2, None))]
        for total, first, second in zip(whole, *halves, strict=True):  # moments add up over batches
            torch.testing.assert_close(total, first + second)
        messages.append(class_statistics(*whole))
    n, mu, sigma = combine_class_statistics(*(torch.stack(parts) for parts in zip(*messages, strict=True)))

    pooled, pooled_labels = np.concatenate(features), np.concatenate(labels)
    assert n.tolist() == [8.0, 9.0, 1.0, 0.0]
    for c in (0, 1):
        np.testing.assert_allclose(mu[c].numpy(), pooled[pooled_labels == c].mean(axis=0), rtol=1e-12)
        np.testing.assert_allclose(sigma[c].numpy(), np.cov(pooled[pooled_labels == c], rowvar=False), rtol=1e-10)
    np.testing.assert_allclose(mu[2].numpy(), pooled[pooled_labels == 2][0])  # the one sample
    assert not sigma[2].any() and not mu[3].any() and not sigma[3].any()
    # a client's own message is NumPy's mean and covariance of its class
    _, means, covariances = messages[1]
    np.testing.assert_allclose(means[1].numpy(), features[1][labels[1] == 1].mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(covariances[1].numpy(), np.cov(features[1][labels[1] == 1], rowvar=False), rtol=1e-10)


def test_eq_4_by_hand():
    # Class 0: client 0 holds 1-d features {0, 2} (N = 2, μ = 1, Σ = 2), client 1 holds {4} (N = 1, μ = 4, Σ := 0).
    # Eq. 4: (1/2)·2 + 0 + (2/2)·1² + (1/2)·4² − (3/2)·2² = 1 + 1 + 8 − 6 = 4, the variance of {0, 2, 4};
    # class 1: client 0 holds {1, 3}, client 1 none: μ = 2, Σ = 2.
    counts = torch.tensor([[2.0, 2.0], [1.0, 0.0]])
    means = torch.tensor([[[1.0], [2.0]], [[4.0], [0.0]]])
    covariances = torch.tensor([[[[2.0]], [[2.0]]], [[[0.0]], [[0.0]]]])
    n, mu, sigma = combine_class_statistics(counts, means, covariances)
    assert n.tolist() == [3.0, 2.0] and mu.flatten().tolist() == [2.0, 2.0] and sigma.flatten().tolist() == [4.0, 2.0]


def test_bad_settings_are_reported_together():
    with pytest.raises(ConfigError) as err:
        CCVR(calibrate_every=-1, virtual_per_class=0, calib_lr=0.0, calib_steps=0, calib_batch_size=0)
    message = str(err.value)
    for flag in ("calibrate_every", "virtual_per_class", "calib_lr", "calib_steps", "calib_batch_size"):
        assert f"--strategy.init_args.{flag}" in message


def test_models_without_a_head_are_refused():
    assert "forward_head" in CCVR().check(ScalarClient(), None)[0]
    client = ClassificationClient(num_classes=3, input_shape=(1, 8, 8), model="mlp")
    assert CCVR().check(client, None) == []
    assert "--strategy.init_args.head" in CCVR(head="net.nothing.*").check(client, None)[0]
