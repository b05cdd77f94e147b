"""Tan et al.'s FedProto through the engine against Algorithm 1 (AAAI 2022) written out in plain torch.

A small CNN over ClientImages, full batches, two of three clients per round: each client trains its own model from
W^0 with cross-entropy plus λ times the distance of its embeddings to the global prototypes, then sends the class
means of its embeddings; the server takes their count-weighted means, carrying over the classes nobody sent.
"""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from fedlight.clients import ClassificationClient
from fedlight.data import FederatedDataModule
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.strategies.local_only import LocalOnly
from fedlight.strategies.tan_fedproto import TanFedProto, prototype_distance
from fedlight.testing import ClientImages, ScalarClient

SIZES, SEEDS = [12, 16, 10], [1, 2, 3]
LR, EPOCHS, ROUNDS, LAM = 0.1, 2, 4, 0.5


class Recorded(TanFedProto):
    """TanFedProto that notes each round's clients, for the reference to replay."""

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


def fit(root, rule):
    data = FederatedDataModule(ClientImages(SIZES, SEEDS), batch_size=1000, test_fraction=0.25)
    trainer = FederatedTrainer(
        rounds=ROUNDS, clients_per_round=2, local_epochs=EPOCHS, logger=None, enable_progress_bar=False,
        default_root_dir=root,
    )  # fmt: skip
    trainer.fit(make_client(), data, rule)
    return trainer


def algorithm_1(rounds, data, net, lam, distance):
    """Every client's own model and the global prototypes ``{class: [D]}`` after ``rounds`` (lists of clients)."""
    theta0 = {name: p.detach().clone() for name, p in net.named_parameters()}
    own, global_prototypes = {}, {}
    for clients in rounds:
        sent = []  # (counts {class: n}, prototypes {class: [D]}) of the round's clients
        for k in clients:
            index = data.client_train[k]
            x, y = data.pool.inputs[index], data.pool.targets[index]
            params = own.get(k, theta0)
            for _ in range(EPOCHS):  # full-batch SGD on CE + λ (1/B) Σ_b d(f(x_b), C̄^{y_b})
                params = {n: t.detach().requires_grad_() for n, t in params.items()}
                features = embed(net, params, x)
                loss = F.cross_entropy(functional_call(net, params, (x,)), y)
                terms = [
                    (f - global_prototypes[int(c)]).square().sum() / (1 if distance == "squared_l2" else f.numel())
                    for f, c in zip(features, y, strict=True) if int(c) in global_prototypes
                ]  # fmt: skip
                loss = loss + lam * sum(terms) / len(y)
                grads = torch.autograd.grad(loss, list(params.values()))
                params = {n: (t - LR * g).detach() for (n, t), g in zip(params.items(), grads, strict=True)}
            own[k] = params
            with torch.no_grad():
                features = embed(net, params, x)
            classes = sorted(set(y.tolist()))
            sent.append(({c: int((y == c).sum()) for c in classes}, {c: features[y == c].mean(0) for c in classes}))
        for c in {c for counts, _ in sent for c in counts}:  # classes nobody sent keep their prototype
            total = sum(counts.get(c, 0) for counts, _ in sent)
            global_prototypes[c] = sum(counts[c] * protos[c] for counts, protos in sent if c in counts) / total
    return own, global_prototypes, theta0


def embed(net, params, x):
    """f(x): the CNN's encoder with ``params``."""
    encoder = {n.removeprefix("encoder."): t for n, t in params.items() if n.startswith("encoder.")}
    return functional_call(net.encoder, encoder, (x,))


def as_net_state(layout, flat):
    return {name.removeprefix("net."): value for name, value in layout.to_state_dict(flat, {}).items()}


@pytest.mark.parametrize("distance", ["squared_l2", "mse"])
def test_rounds_of_partial_participation_follow_algorithm_1(tmp_path, distance):
    rule = Recorded(lam=LAM, distance=distance)
    trainer = fit(tmp_path, rule)
    rounds = rule.rounds
    assert all(len(clients) == 2 for clients in rounds) and {k for c in rounds for k in c} == {0, 1, 2}
    data, layout, store = trainer.run.datamodule, trainer.model.layout, trainer.model.client_states
    own, prototypes, theta0 = algorithm_1(rounds, data, make_client().net, LAM, distance)

    tolerance = {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(as_net_state(layout, trainer.global_state), theta0, rtol=0, atol=0)  # W stays W^0
    for k in range(3):
        torch.testing.assert_close(as_net_state(layout, store.get(k)["own"]), own[k], **tolerance)
    assert sorted(prototypes) == [0, 1, 2] and bool(rule.known.all())
    torch.testing.assert_close(rule.prototypes, torch.stack([prototypes[c] for c in range(3)]), **tolerance)

    # every client is scored with its own model on its held-out samples
    net, held_out = make_client().net, data.held_out_index
    loss_sum = sum(
        F.cross_entropy(functional_call(net, own[k], (data.pool.inputs[held_out[data.held_out_group == k]],)),
                        data.pool.targets[held_out[data.held_out_group == k]], reduction="sum").item()
        for k in range(3)
    )  # fmt: skip
    assert trainer.history[-1]["clients/personal/loss"] == pytest.approx(loss_sum / len(held_out), rel=1e-4)
    # the prototypes pull: clients trained alone (λ = 0, Local-only) end elsewhere
    alone = fit(tmp_path, LocalOnly()).model.client_states
    assert not torch.allclose(alone.get(rounds[-1][0])["own"], store.get(rounds[-1][0])["own"], rtol=1e-3, atol=1e-4)


def test_global_prototypes_by_hand():
    rule = TanFedProto()

    def update(client, prototypes, counts):
        payload = {"prototypes": torch.tensor(prototypes), "counts": torch.tensor(counts)}
        return SimpleNamespace(client=client, payload=payload)

    # class 0: (1·[1, 1] + 3·[3, 3]) / 4 = [2.5, 2.5]; class 1 only from client 0; class 2 from nobody
    metrics = rule.on_round_end(None, 0, [
        update(0, [[1.0, 1.0], [2.0, 0.0], [0.0, 0.0]], [1, 2, 0]),
        update(1, [[3.0, 3.0], [0.0, 0.0], [0.0, 0.0]], [3, 0, 0]),
    ])  # fmt: skip
    assert rule.prototypes.tolist() == [[2.5, 2.5], [2.0, 0.0], [0.0, 0.0]] and rule.known.tolist() == [1, 1, 0]
    assert metrics == {"tan_fedproto/classes_with_prototype": 2.0}
    # next round: a client with classes 1 and 2 only; class 0 keeps its prototype
    rule.on_round_end(None, 1, [update(2, [[0.0, 0.0], [4.0, 4.0], [1.0, 2.0]], [0, 5, 1])])
    assert rule.prototypes.tolist() == [[2.5, 2.5], [4.0, 4.0], [1.0, 2.0]] and bool(rule.known.all())
    clone = TanFedProto()
    clone.load_state_dict(rule.state_dict())
    assert torch.equal(clone.prototypes, rule.prototypes) and torch.equal(clone.known, rule.known)


def test_the_loss_by_hand():
    features, labels = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 3.0]]), torch.tensor([0, 1, 2])
    prototypes, known = torch.tensor([[0.0, 0.0], [0.0, 1.0], [9.0, 9.0]]), torch.tensor([True, True, False])
    # ‖·‖²: 1, 1 and nothing for class 2 (no prototype) over B = 3; mse halves each (D = 2)
    assert prototype_distance(features, labels, prototypes, known, "squared_l2").item() == pytest.approx(2 / 3)
    assert prototype_distance(features, labels, prototypes, known, "mse").item() == pytest.approx(1 / 3)
    rule = TanFedProto(lam=0.75)
    outputs = {"loss": torch.tensor(0.25), "features": features}
    assert rule.training_loss(None, (None, labels), outputs).item() == 0.25  # no prototype yet: CE alone
    rule._targets = (prototypes, known)
    assert rule.training_loss(None, (None, labels), outputs).item() == pytest.approx(0.25 + 0.75 * 2 / 3)


def test_bad_settings_are_reported():
    with pytest.raises(ConfigError) as err:
        TanFedProto(lam=-1.0, distance="l1")
    assert "--strategy.init_args.lam" in str(err.value) and "--strategy.init_args.distance" in str(err.value)
    (problem,) = TanFedProto().check(ScalarClient(), None)
    assert "forward_features" in problem and "ClassificationClient" in problem
    assert TanFedProto().check(make_client(), None) == []
