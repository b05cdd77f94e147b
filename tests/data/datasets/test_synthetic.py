import warnings

import numpy as np
import pytest
import torch
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression
from threadpoolctl import threadpool_limits

from fedlight.data.datasets.synthetic import Synthetic
from fedlight.data.partition import Natural


@pytest.fixture(scope="module")
def pool():
    return Synthetic(alpha=1.0, beta=1.0, seed=0).load_train()


def test_shapes_and_users(pool) -> None:
    dataset = Synthetic()
    assert dataset.input_shape == (60,) and dataset.num_classes == 10 and dataset.load_test() is None
    assert pool.inputs.dtype == torch.float32 and pool.inputs.shape == (len(pool), 60)
    assert pool.targets.dtype == torch.int64 and pool.targets.min() >= 0 and pool.targets.max() < 10
    sizes = np.bincount(pool.groups)
    assert sizes.size == 30 and sizes.min() >= 50
    parts = Natural()(pool.targets.numpy(), 10, np.random.default_rng(0), pool.groups)
    assert [part.size for part in parts] == sizes.tolist()


def test_same_seed_same_data_other_seed_other_data(pool) -> None:
    again = Synthetic(seed=0).load_train()
    assert torch.equal(pool.inputs, again.inputs) and torch.equal(pool.targets, again.targets)
    other = Synthetic(seed=1).load_train()
    assert len(other) != len(pool) or not torch.equal(pool.inputs, other.inputs)


def test_input_variances_follow_the_covariance(pool) -> None:
    largest = np.argmax(np.bincount(pool.groups))
    x = pool.inputs.numpy()[pool.groups == largest].astype(np.float64)
    assert len(x) >= 500, "seed 0 is expected to have a user large enough for variance estimates"
    j = np.arange(1, 61)
    ratio = x.var(axis=0, ddof=1) / j**-1.2  # Σ = diag(j^−1.2) holds variances
    assert np.all((ratio > 0.6) & (ratio < 1.5)), ratio
    slope = np.polyfit(np.log(j), np.log(x.var(axis=0, ddof=1)), 1)[0]
    assert slope == pytest.approx(-1.2, abs=0.1)


def test_labels_come_from_each_users_own_linear_model(pool) -> None:
    x, y, groups = pool.inputs.numpy(), pool.targets.numpy(), pool.groups
    # inputs vary little around v_k, so most users are dominated by one class (as in FedProx's data)
    majority = [np.bincount(y[groups == u]).max() / np.sum(groups == u) for u in range(30)]
    assert np.mean(majority) > 0.6
    # the user whose second most common class is the largest is the hardest to separate
    user = np.argmax([np.sort(np.bincount(y[groups == u], minlength=10))[-2] for u in range(30)])
    mine = groups == user
    assert np.sort(np.bincount(y[mine]))[-2] >= 50
    # one BLAS thread: on a busy 2-core machine, oversubscribed threads make these small fits 40x slower
    with threadpool_limits(1), warnings.catch_warnings():
        # y = argmax(x W_k + b_k) is exactly linearly separable within a user
        fit = LogisticRegression(C=1e4, max_iter=2000).fit(x[mine], y[mine])
        assert fit.score(x[mine], y[mine]) == 1.0
        # the check has teeth: the same labels, shuffled, are far from separable
        shuffled = np.random.default_rng(0).permutation(y[mine])
        warnings.simplefilter("ignore", ConvergenceWarning)
        null = LogisticRegression(C=1e4, max_iter=300).fit(x[mine], shuffled)
        assert null.score(x[mine], shuffled) < 0.8


def test_alpha_and_beta_control_heterogeneity() -> None:
    # φ1 = φ2 = 0: the users' model means u_k and input means B_k are all 0
    iid_ish = Synthetic(alpha=0.0, beta=0.0, num_clients=10, seed=3).load_train()
    skewed = Synthetic(alpha=5.0, beta=5.0, num_clients=10, seed=3).load_train()

    def spread_of_user_means(data) -> float:
        x = data.inputs.numpy()
        return float(np.std([x[data.groups == u].mean() for u in range(10)]))

    assert spread_of_user_means(skewed) > 2 * spread_of_user_means(iid_ish)


def test_bad_inputs_name_the_flags() -> None:
    with pytest.raises(ValueError, match=r"(?s)--data\.dataset\.init_args\.alpha >= 0.*init_args\.dim >= 1"):
        Synthetic(alpha=-1.0, dim=0)
