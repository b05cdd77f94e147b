"""FedALA through the engine against Algorithm 1 of Zhang et al. (AAAI 2023) written out in plain torch.

A small CNN over ClientImages, full batches (the ALA sample with s = 100% is then the whole training split, whatever
its order), two of three clients per round: clients join late (their local model is still Θ^0), learn W_k until
convergence in their first ALA and for one epoch afterwards. The reference keeps θ_k and W_k itself.
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from fedlight.clients import ClassificationClient
from fedlight.data import FederatedDataModule
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.strategies.fedala import FedALA
from fedlight.strategies.fedavg import FedAvg
from fedlight.testing import ClientImages, ScalarClient, ScalarDataset

SIZES, SEEDS = [12, 16, 10], [1, 2, 3]
LR, EPOCHS, ROUNDS, ETA = 0.3, 2, 4, 20.0  # a large η, so that W_k moves and meets its clip
TOP = ["encoder.7.weight", "encoder.7.bias", "head.weight", "head.bias"]  # p = 2: the hidden linear layer and head


class Recorded(FedALA):
    """FedALA that notes each round's clients, for the reference to replay."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rounds = []

    def on_round_start(self, context, round_idx, plans):
        self.rounds.append([plan.client for plan in plans if not plan.dropped])


def make_client():
    torch.manual_seed(0)
    return ClassificationClient(
        num_classes=3, input_shape=(1, 8, 8), model="cnn", model_kwargs={"hidden": 8},
        optimizer=lambda params: torch.optim.SGD(params, lr=LR),
    )  # fmt: skip


def fit(root, rule, rounds=ROUNDS, ckpt_path=None):
    data = FederatedDataModule(ClientImages(SIZES, SEEDS), batch_size=1000, test_fraction=0.25)
    trainer = FederatedTrainer(
        rounds=rounds, clients_per_round=2, local_epochs=EPOCHS, logger=None, enable_progress_bar=False,
        default_root_dir=root,
    )  # fmt: skip
    trainer.fit(make_client(), data, rule, ckpt_path=ckpt_path)
    return trainer


def algorithm_1(rounds, data, net, threshold, window, max_epochs):
    """Θ after ``rounds`` (each a list of clients), with every client's θ_k and W_k (those that learned one)."""
    theta0 = {name: p.detach().clone() for name, p in net.named_parameters()}
    glob, local, weights = dict(theta0), {}, {}

    def loss_of(params, k):
        index = data.client_train[k]
        return F.cross_entropy(functional_call(net, params, (data.pool.inputs[index],)), data.pool.targets[index])

    for clients in rounds:
        trained = []
        for k in clients:
            old = local.get(k, theta0)  # θ_k: Θ^0 until the client has trained
            start = dict(glob)  # lower layers: Θ as is
            if any(not torch.equal(old[n], glob[n]) for n in TOP):
                start_phase = k not in weights
                w = weights.get(k, {n: torch.ones_like(glob[n]) for n in TOP})
                losses = []
                for _ in range(max_epochs if start_phase else 1):
                    mixed = {n: (old[n] + (glob[n] - old[n]) * w[n]).requires_grad_() for n in TOP}
                    loss = loss_of({**glob, **mixed}, k)
                    grads = torch.autograd.grad(loss, [mixed[n] for n in TOP])
                    w = {n: (w[n] - ETA * g * (glob[n] - old[n])).clamp(0, 1) for n, g in zip(TOP, grads, strict=True)}
                    losses.append(loss.item())
                    if start_phase and len(losses) > window and np.std(losses[-window:]) < threshold:
                        break
                weights[k] = w
                start.update({n: old[n] + (glob[n] - old[n]) * w[n] for n in TOP})
            params = start
            for _ in range(EPOCHS):  # plain SGD, full batch
                params = {n: t.detach().requires_grad_() for n, t in params.items()}
                grads = torch.autograd.grad(loss_of(params, k), list(params.values()))
                params = {n: (t - LR * g).detach() for (n, t), g in zip(params.items(), grads, strict=True)}
            local[k] = params
            trained.append((len(data.client_train[k]), params))
        total = sum(n for n, _ in trained)
        glob = {name: sum(n * p[name] for n, p in trained) / total for name in theta0}
    return glob, local, weights


def as_net_state(layout, flat):
    return {name.removeprefix("net."): value for name, value in layout.to_state_dict(flat, {}).items()}


@pytest.mark.parametrize(
    ("threshold", "window", "max_epochs"),
    [(1e6, 3, 50), (0.0, 3, 5)],  # converged after window + 1 epochs; never converged, so capped
)
def test_rounds_of_partial_participation_follow_algorithm_1(tmp_path, threshold, window, max_epochs):
    rule = Recorded(layer_idx=2, rand_percent=100, eta=ETA, threshold=threshold, loss_window=window,
                    max_start_epochs=max_epochs)  # fmt: skip
    trainer = fit(tmp_path, rule)
    rounds = rule.rounds
    # the run covers what the test is about: a client that joins late, and one that learns W_k a second time
    joins = [next(t for t, clients in enumerate(rounds) if k in clients) for k in range(3)]
    assert all(len(clients) == 2 for clients in rounds) and max(joins) > 0
    assert max(sum(k in clients for clients in rounds) for k in range(3)) >= 3

    data, layout, store = trainer.run.datamodule, trainer.model.layout, trainer.model.client_states
    glob, local, weights = algorithm_1(rounds, data, make_client().net, threshold, window, max_epochs)
    tolerance = {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(as_net_state(layout, trainer.global_state), glob, **tolerance)
    for k in range(3):
        own = store.get(k)
        assert own is not None and own["phase"].item() == (2.0 if k in weights else 1.0)
        torch.testing.assert_close(as_net_state(layout, own["local"]), local[k], **tolerance)
        if k in weights:
            torch.testing.assert_close(own["weights"], torch.cat([weights[k][n].reshape(-1) for n in TOP]), **tolerance)
    learned = torch.cat([store.get(k)["weights"] for k in weights])
    assert (learned == 0).any() and ((learned > 0) & (learned < 1)).any()  # clipped weights, and mixed ones

    # every client is scored with its own θ_k on its held-out samples
    net, held_out = make_client().net, data.held_out_index
    loss_sum = sum(
        F.cross_entropy(functional_call(net, local[k], (data.pool.inputs[held_out[data.held_out_group == k]],)),
                        data.pool.targets[held_out[data.held_out_group == k]], reduction="sum").item()
        for k in range(3)
    )  # fmt: skip
    assert trainer.history[-1]["clients/personal/loss"] == pytest.approx(loss_sum / len(held_out), rel=1e-4)
    # the adaptive start matters: FedAvg's global model ends elsewhere
    fedavg = FederatedTrainer(rounds=ROUNDS, clients_per_round=2, local_epochs=EPOCHS, logger=None,
                              enable_progress_bar=False, default_root_dir=tmp_path)  # fmt: skip
    fedavg.fit(make_client(), FederatedDataModule(ClientImages(SIZES, SEEDS), batch_size=1000, test_fraction=0.25),
               FedAvg(sampling="uniform"))  # fmt: skip
    assert not torch.allclose(fedavg.global_state, trainer.global_state, rtol=1e-3, atol=1e-4)


def test_a_resumed_run_equals_a_straight_one(tmp_path):
    # the clients that join after the checkpoint start from Θ^0, which the rule's state carries
    def rule():
        return FedALA(layer_idx=2, rand_percent=100, eta=ETA, threshold=1e6, loss_window=3)

    straight = fit(tmp_path, rule())
    first = fit(tmp_path, rule(), rounds=1)
    resumed = fit(tmp_path, rule(), ckpt_path=first.run_dir / "checkpoints" / "last.ckpt")
    torch.testing.assert_close(resumed.global_state, straight.global_state, rtol=0, atol=0)
    for k in range(3):
        own, expected = resumed.model.client_states.get(k), straight.model.client_states.get(k)
        torch.testing.assert_close(own, expected, rtol=0, atol=0)


def test_one_round_of_weight_learning_by_hand(tmp_path):
    # ScalarClient, loss ½(w − y)², y = 2 and −2, two training samples each, one step of lr ½, Θ^0 = 0.
    # Round 1: θ = Θ^0 = Θ, no ALA; w = 0 − ½(0 − 2) = 1 and −1; Θ^1 = 0.
    # Round 2, client 0: Θ − θ = −1, W = 1: θ̂ = 0, loss 2, ∇ = −2, W = clip(1 − (−2)(−1)) = 0, θ̂ = 1;
    # then loss ½, ∇ = −1, W = clip(0 − 1) = 0; then loss ½ again: three epochs, std(½, ½) = 0 < 1, converged.
    # It trains from θ̂ = 1 to 1.5 (client 1: −1.5); Θ^2 = 0, while FedAvg's clients would end at ±1.
    data = FederatedDataModule(ScalarDataset([4, 4], [2.0, -2.0]), batch_size=100, test_fraction=0.5)
    trainer = FederatedTrainer(rounds=2, clients_per_round=2, local_epochs=1, logger=None, enable_progress_bar=False,
                               default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(ScalarClient(lr=0.5), data, FedALA(rand_percent=100, eta=1.0, threshold=1.0, loss_window=2))
    store = trainer.model.client_states
    assert [store.get(k)["local"].item() for k in range(2)] == [1.5, -1.5]
    assert [store.get(k)["weights"].item() for k in range(2)] == [0.0, 0.0]
    assert trainer.global_state.item() == 0.0
    assert [h["fedala/epochs_mean"] for h in trainer.history] == [0.0, 3.0]
    assert trainer.history[-1]["clients/personal/loss"] == pytest.approx(0.5 * 0.5**2)  # ½(1.5 − 2)²


def test_the_sample_is_s_percent_of_the_training_split():
    data = FederatedDataModule(ClientImages([20], [4]), batch_size=4, test_fraction=0.0)
    data.setup()
    context = SimpleNamespace(datamodule=data, round=3, client_seed=lambda round_idx, client: 11)
    batches = FedALA(rand_percent=70)._sample(context, 0)
    assert [len(batch[1]) for batch in batches] == [4, 4, 4, 2]  # int(0.7 · 20) = 14 samples
    inputs = torch.cat([batch[0] for batch in batches]).flatten(1)
    assert len(torch.unique(inputs, dim=0)) == 14  # distinct samples
    again = FedALA(rand_percent=70)._sample(context, 0)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again, strict=True))  # drawn from the client's stream


def test_bad_settings_are_reported_together():
    with pytest.raises(ConfigError) as err:
        FedALA(layer_idx=0, rand_percent=0, eta=0.0, threshold=-1.0, loss_window=1, max_start_epochs=0)
    message = str(err.value)
    for flag in ("layer_idx", "rand_percent", "eta", "threshold", "loss_window", "max_start_epochs"):
        assert f"--strategy.init_args.{flag}" in message
    (problem,) = FedALA(layer_idx=5).check(make_client(), None)
    assert "layer_idx=5" in problem and "4 layers" in problem and "Choose 1 to 4" in problem
    assert FedALA(layer_idx=4).check(make_client(), None) == []
