"""FedProx's Synthetic(α, β) data (Li et al., 2020, §5.1)

Follows ``litian96/FedProx:data/synthetic_1_1/generate_synthetic.py`` (not LEAF's clustered
generator). Each user ``k`` has its own softmax-regression model and input distribution:

- size ``n_k = int(LogNormal(4, 2)) + 50``;
- ``u_k ~ N(0, α)`` and ``B_k ~ N(0, β)``, where, as in FedProx, α and β are standard deviations;
- ``W_k ~ N(u_k, 1)^{d×C}``, ``b_k ~ N(u_k, 1)^C`` and ``v_k ~ N(B_k, 1)^d``;
- ``x ~ N(v_k, Σ)`` with ``Σ = diag(j^{−1.2})``, ``j = 1..d``, the variances;
- ``y = argmax softmax(x W_k + b_k)``.

The draws follow the same distributions in the same order, but from numpy's ``Generator`` rather
than the legacy global state, so the numbers differ from FedProx's files.
"""

from __future__ import annotations

import numpy as np
import torch

from fedlight.data.base import FederatedDataset, LabelledTensors
from fedlight.errors import ConfigError


class Synthetic(FederatedDataset):
    """FedProx's Synthetic(α, β): users with their own models and inputs, one natural client each.

    ``load_train`` returns every user's samples with ``groups`` holding the user id, for the
    :class:`~fedlight.data.partition.Natural` partitioner; there is no separate test set.

    Args:
        alpha: φ1 = α, the standard deviation of ``u_k``: how much the users' models differ.
        beta: φ2 = β, the standard deviation of ``B_k``: how much the users' inputs differ.
        num_clients: Number of users (FedProx: 30).
        dim: Input dimension ``d`` (FedProx: 60).
        num_classes: Number of classes ``C`` (FedProx: 10).
        seed: Seed of the generator; one seed gives one dataset.
    """

    def __init__(
        self,
        alpha: float = 1.0,
        beta: float = 1.0,
        num_clients: int = 30,
        dim: int = 60,
        num_classes: int = 10,
        seed: int = 0,
    ) -> None:
        problems = []
        for name, value in (("alpha", alpha), ("beta", beta)):
            if value < 0:
                problems.append(f"Expected --data.dataset.init_args.{name} >= 0 (a standard deviation), got {value}.")
        for name, value, least in (("num_clients", num_clients, 1), ("dim", dim, 1), ("num_classes", num_classes, 2)):
            if value < least:
                problems.append(f"Expected --data.dataset.init_args.{name} >= {least}, got {value}.")
        if problems:
            raise ConfigError(*problems)
        self.alpha = alpha
        self.beta = beta
        self.num_clients = num_clients
        self.dim = dim
        self.num_classes = num_classes
        self.seed = seed
        self.input_shape = (dim,)

    def load_train(self) -> LabelledTensors:
        """Generates the users' samples, concatenated in user order."""
        rng = np.random.default_rng(self.seed)
        num_users, dim, num_classes = self.num_clients, self.dim, self.num_classes
        sizes = rng.lognormal(4, 2, num_users).astype(np.int64) + 50  # n_k
        model_means = rng.normal(0, self.alpha, num_users)  # u_k, shared by W_k and b_k
        input_offsets = rng.normal(0, self.beta, num_users)  # B_k
        input_means = np.stack([rng.normal(b, 1, dim) for b in input_offsets])  # v_k, [K, d]
        input_std = np.arange(1, dim + 1) ** -0.6  # sqrt of the variances j^−1.2

        inputs, targets = [], []
        for user in range(num_users):
            weight = rng.normal(model_means[user], 1, (dim, num_classes))  # W_k
            bias = rng.normal(model_means[user], 1, num_classes)  # b_k
            # a diagonal covariance makes the multivariate normal a per-dimension rescaling
            x = input_means[user] + input_std * rng.standard_normal((sizes[user], dim))  # [n_k, d]
            inputs.append(x)
            targets.append(np.argmax(x @ weight + bias, axis=1))  # softmax keeps the argmax
        return LabelledTensors(
            inputs=torch.from_numpy(np.concatenate(inputs)).float(),
            targets=torch.from_numpy(np.concatenate(targets)).long(),
            groups=np.repeat(np.arange(num_users), sizes),
        )
