"""FedDecorr's loss against hand-worked cases and ``torch.corrcoef``; β = 0 is FedAvg."""

import pytest
import torch

from fedlight.clients import ClassificationClient
from fedlight.data import FederatedDataModule, Synthetic
from fedlight.engine.trainer import FederatedTrainer
from fedlight.strategies import FedAvg, FedDecorr
from fedlight.strategies.feddecorr import decorrelation_loss


def test_decorrelated_features_cost_nothing():
    # orthogonal, zero-mean columns (a 2-level factorial design) in 3 dimensions
    z = torch.tensor([[1.0, 1.0, 1.0], [1.0, -1.0, -1.0], [-1.0, 1.0, -1.0], [-1.0, -1.0, 1.0]])
    assert decorrelation_loss(z).item() == pytest.approx(0.0, abs=1e-12)
    assert decorrelation_loss(3.0 * z + 5.0).item() == pytest.approx(0.0, abs=1e-12)  # shifts and scales too


def test_loss_matches_the_correlation_matrix():
    # ẑᵀẑ = (N − 1)·corr with the unbiased variance, so L = mean_{j≠l} ((N − 1) corr_jl)² / N
    z = torch.randn(16, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    corr = torch.corrcoef(z.T)
    off = corr[~torch.eye(5, dtype=torch.bool)]
    expected = ((15 * off) ** 2).mean() / 16
    assert decorrelation_loss(z).item() == pytest.approx(expected.item(), rel=1e-6)


def test_one_sample_costs_nothing_and_gradients_flow():
    assert decorrelation_loss(torch.randn(1, 4)).item() == 0.0
    z = torch.randn(8, 3, requires_grad=True)
    decorrelation_loss(z).backward()
    assert z.grad is not None and bool(torch.isfinite(z.grad).all())


def fit(root, strategy):
    torch.manual_seed(0)
    model = ClassificationClient(num_classes=10, input_shape=(12,), model="mlp", model_kwargs={"hidden": [16]})
    trainer = FederatedTrainer(
        rounds=2, clients_per_round=3, local_epochs=1, logger=None, enable_progress_bar=False, default_root_dir=root
    )
    trainer.fit(model, FederatedDataModule(Synthetic(num_clients=6, dim=12, seed=1), batch_size=10), strategy)
    return trainer.global_state


def test_zero_beta_is_fedavg_and_positive_beta_is_not(tmp_path):
    fedavg = fit(tmp_path, FedAvg(sampling="uniform"))
    torch.testing.assert_close(fit(tmp_path, FedDecorr(beta=0.0)), fedavg, rtol=0, atol=0)
    assert not torch.allclose(fit(tmp_path, FedDecorr(beta=0.1)), fedavg)
