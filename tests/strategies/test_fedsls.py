"""FedSLS: the R-weighted server step by hand, the static and dynamic R_k against direct computations."""

import copy

import numpy as np
import pytest
import torch

from fedlight.callbacks import RoundCallback
from fedlight.clients import ClassificationClient
from fedlight.data import FederatedDataModule, LabelledTensors
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.metrics.functional.saliency import layer_weights, saliency_norms
from fedlight.strategies import FedSLS
from fedlight.testing import ClientImages, ScalarClient, ScalarDataset


class RecordClients(RoundCallback):
    def __init__(self):
        self.rounds = []

    def on_round_end(self, context, round_idx, metrics):
        self.rounds.append([p.client for p in context.plans])


def with_saliency(strategy, values):
    """The strategy with preset static weights (as a resumed run has them), so no saliency is computed."""
    strategy.load_state_dict({"saliency": torch.tensor(values, dtype=torch.float64)})
    return strategy


def fit_scalar(root, sizes, values, strategy, rounds=1, clients_per_round=None, callbacks=None):
    data = FederatedDataModule(ScalarDataset(sizes, values), batch_size=10_000, test_fraction=0.5)
    trainer = FederatedTrainer(
        rounds=rounds, clients_per_round=clients_per_round or len(sizes), local_epochs=1, logger=None,
        enable_progress_bar=False, default_root_dir=root, callbacks=callbacks,
    )  # fmt: skip
    trainer.fit(ScalarClient(lr=1.0), data, strategy)  # a client's step lands on its y
    return trainer.global_state.item()


def test_server_step_by_hand(tmp_path):
    # R = (1, 3), clients land on (2, 6) from 0: Δ = (1·2 + 3·6)/4 = 5, θ = 0 + 0.5·5
    strategy = with_saliency(FedSLS(server_lr=0.5), [1.0, 3.0])
    assert fit_scalar(tmp_path, [4, 4], [2.0, 6.0], strategy) == pytest.approx(2.5)
    # with n_k weights it would be (4·2 + 12·6)/16 · 0.5: the weights are R_k, not n_k
    strategy = with_saliency(FedSLS(), [1.0, 3.0])
    assert fit_scalar(tmp_path, [8, 24], [2.0, 6.0], strategy) == pytest.approx(5.0)


def test_weights_are_normalised_over_the_sampled_clients(tmp_path):
    saliency, values = [1.0, 3.0, 100.0, 5.0], [2.0, 6.0, -1.0, 4.0]
    record = RecordClients()
    w = fit_scalar(
        tmp_path, [4, 4, 4, 4], values, with_saliency(FedSLS(), saliency), rounds=3, clients_per_round=2,
        callbacks=[record],
    )  # fmt: skip
    expected = 0.0
    for sampled in record.rounds:  # each round lands on the R-weighted mean of its two clients
        expected = sum(saliency[k] * values[k] for k in sampled) / sum(saliency[k] for k in sampled)
    assert w == pytest.approx(expected)


def make_client(seed=0):
    torch.manual_seed(seed)
    return ClassificationClient(
        num_classes=3, input_shape=(1, 8, 8), model="cnn", model_kwargs={"hidden": 8},
        optimizer=lambda params: torch.optim.SGD(params, lr=0.05),
    )  # fmt: skip


def fit_images(root, dataset, strategy, rounds=1, batch_size=4, client=None):
    data = FederatedDataModule(dataset, batch_size=batch_size, test_fraction=0.0)
    trainer = FederatedTrainer(
        rounds=rounds, clients_per_round=len(dataset.sizes), local_epochs=1, logger=None, enable_progress_bar=False,
        default_root_dir=root,
    )  # fmt: skip
    trainer.fit(client or make_client(), data, strategy)
    return trainer


def direct_saliency(net, data, client, tau=0.5):
    """R_k by the formula: Σ_l τ^{l−1} Σ_i N_{i,l}, image by image, with ``net`` in eval mode."""
    indices = data.client_train[client]
    x, y = data.pool.inputs[indices], data.pool.targets[indices]
    norms = torch.cat([saliency_norms(net.eval(), x[i : i + 1], y[i : i + 1]) for i in range(len(y))])
    return float(layer_weights(norms.shape[1], tau) @ norms.double().sum(dim=0))


def test_static_weights_without_warm_up_are_the_saliency_of_the_initial_model(tmp_path):
    client = make_client()
    initial = copy.deepcopy(client.net)
    trainer = fit_images(tmp_path, ClientImages([6, 9], [1, 2]), FedSLS(warmup_epochs=0, tau=0.7), client=client)
    expected = [direct_saliency(initial, trainer.run.datamodule, k, tau=0.7) for k in range(2)]
    np.testing.assert_allclose(trainer.run.strategy.saliency.numpy(), expected, rtol=1e-5)


def test_saliency_weight_scales_with_the_number_of_images(tmp_path):
    # client 1 holds client 0's 5 images twice over
    class Doubled(ClientImages):
        def load_train(self):
            x, y = self._draw(5, 3)
            return LabelledTensors(torch.cat([x, x, x]), torch.cat([y, y, y]), np.array([0] * 5 + [1] * 10))

    trainer = fit_images(tmp_path, Doubled([5, 10], [3, 3]), FedSLS(warmup_epochs=0))
    r0, r1 = trainer.run.strategy.saliency.tolist()
    assert r1 == pytest.approx(2 * r0, rel=1e-6)


def test_saliency_weight_does_not_depend_on_the_batch_size(tmp_path):
    dataset = ClientImages([7, 12], [1, 2])
    one = fit_images(tmp_path, dataset, FedSLS(batch_size=1)).run.strategy.saliency
    many = fit_images(tmp_path, dataset, FedSLS(batch_size=64)).run.strategy.saliency
    torch.testing.assert_close(one, many, rtol=1e-5, atol=0)


def test_warm_up_changes_the_weights_but_not_the_federated_run(tmp_path):
    dataset = ClientImages([7, 12], [1, 2])
    warmed = fit_images(tmp_path, dataset, FedSLS(warmup_epochs=1), rounds=2)
    cold = fit_images(tmp_path, dataset, FedSLS(warmup_epochs=0), rounds=1)
    assert not torch.allclose(warmed.run.strategy.saliency, cold.run.strategy.saliency)
    # the warmed-up models are discarded: the run equals one handed the same weights without any warm-up
    preset = with_saliency(FedSLS(), warmed.run.strategy.saliency.tolist())
    torch.testing.assert_close(fit_images(tmp_path, dataset, preset, rounds=2).global_state, warmed.global_state)


class RecordingFedSLS(FedSLS):
    """Keeps a copy of every trained local network and every aggregated update."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.nets, self.updates = {}, []

    def on_client_fit_end(self, trainer, module, update):
        self.nets[update.client] = copy.deepcopy(module.net)
        super().on_client_fit_end(trainer, module, update)

    def on_round_end(self, trainer, round_idx, updates):
        self.updates += updates
        return super().on_round_end(trainer, round_idx, updates)


def test_dynamic_weights_are_the_saliency_of_the_trained_local_models(tmp_path):
    strategy = RecordingFedSLS(mode="dynamic")
    trainer = fit_images(tmp_path, ClientImages([6, 9], [1, 2]), strategy)
    assert strategy.saliency is None  # nothing static was computed
    for update in strategy.updates:
        expected = direct_saliency(strategy.nets[update.client], trainer.run.datamodule, update.client)
        assert update.payload["saliency"] == pytest.approx(expected, rel=1e-5)
        assert update.weights == (update.payload["saliency"],)


def test_bad_settings_are_reported_together():
    with pytest.raises(ConfigError) as err:
        FedSLS(tau=0.0, server_lr=-1.0, warmup_epochs=-1, batch_size=0)
    assert len(err.value.problems) == 4
