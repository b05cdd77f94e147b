"""FedRoD through the engine against Chen & Chao (ICLR 2022) written out in plain torch: a one-hidden-layer ReLU MLP
over ClientImages, full-batch SGD with momentum, rounds of partial participation. In every local step the body and
the generic head step on the balanced-softmax cross-entropy (logits + log of the client's class prior), and the
client's personalised linear head steps on the cross-entropy of generic + personalised logits, from the same forward
pass with features and generic logits detached; the server averages body and generic head by n_k. Each client's own
prediction, generic + personalised logits, is scored on its held-out split."""

import pytest
import torch
import torch.nn.functional as F

from fedlight.clients import ClassificationClient
from fedlight.data import FederatedDataModule
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.strategies.fedavg import FedAvg
from fedlight.strategies.fedrod import FedRoD
from fedlight.testing import ClientImages

SIZES, SEEDS = [8, 12, 12, 8, 10], [8, 3, 5, 15, 4]  # clients 0 and 3 lack a class (2 and 1)
LR, MOMENTUM, EPOCHS, ROUNDS = 0.1, 0.5, 2, 3
NAMES = ("encoder.1.weight", "encoder.1.bias", "head.weight", "head.bias")


class Recorded(FedRoD):
    """FedRoD that notes each round's clients, for the reference to replay."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rounds = []

    def on_round_start(self, context, round_idx, plans):
        self.rounds.append([plan.client for plan in plans if not plan.dropped])


def make_client(zero=False, hidden=5):
    torch.manual_seed(0)
    client = ClassificationClient(
        num_classes=3, input_shape=(1, 8, 8), model="mlp", model_kwargs={"hidden": [hidden]},
        optimizer=lambda params: torch.optim.SGD(params, lr=LR, momentum=MOMENTUM),
    )  # fmt: skip
    if zero:
        with torch.no_grad():
            for p in client.parameters():
                p.zero_()
    return client


def fit(root, rule, sizes=SIZES, seeds=SEEDS, rounds=ROUNDS, epochs=EPOCHS, clients_per_round=2, **kwargs):
    test_fraction = kwargs.pop("test_fraction", 0.25)
    data = FederatedDataModule(ClientImages(sizes, seeds), batch_size=1000, test_fraction=test_fraction)
    trainer = FederatedTrainer(
        rounds=rounds, clients_per_round=clients_per_round, local_epochs=epochs, logger=None,
        enable_progress_bar=False, default_root_dir=root,
    )  # fmt: skip
    client = make_client(**kwargs)
    start = [p.detach().clone() for p in client.net.parameters()]
    trainer.fit(client, data, rule)
    return trainer, start


def global_weights(trainer):
    state = trainer.model.layout.to_state_dict(trainer.global_state, {})
    return [state[f"net.{name}"] for name in NAMES]


def sgd(params, grads, buffers):
    """One step of SGD with momentum on lists of tensors; ``buffers`` is empty at a fresh optimizer's first step."""
    if not buffers:
        buffers.extend(g.clone() for g in grads)
    else:
        for b, g in zip(buffers, grads, strict=True):
            b.mul_(MOMENTUM).add_(g)
    return [(p - LR * b).detach().requires_grad_() for p, b in zip(params, buffers, strict=True)]


def reference(data, rounds, start):
    """The global MLP and every client's personalised head (W_φ, b_φ) after the rounds."""
    weights = start
    personal = {k: [torch.zeros(3, 5), torch.zeros(3)] for k in range(len(SIZES))}
    for clients in rounds:
        trained, sizes = [], []
        for k in clients:
            x = data.pool.inputs[data.client_train[k]].flatten(1)
            y = data.pool.targets[data.client_train[k]]
            counts = torch.stack([(y == c).sum() for c in range(3)]).float()
            log_prior = torch.log(counts / counts.sum())  # −∞ for a class the client lacks
            params = [w.clone().requires_grad_() for w in weights]
            head = [p.clone().requires_grad_() for p in personal[k]]
            body_buffers, head_buffers = [], []  # fresh optimizers every round
            for _ in range(EPOCHS):
                w1, b1, w2, b2 = params
                z = torch.relu(x @ w1.T + b1)
                g = z @ w2.T + b2
                balanced = F.cross_entropy(g + log_prior, y)  # ℓ_BSM
                own = F.cross_entropy(g.detach() + z.detach() @ head[0].T + head[1], y)  # ER of g + h(z; φ)
                params = sgd(params, torch.autograd.grad(balanced, params), body_buffers)
                head = sgd(head, torch.autograd.grad(own, head), head_buffers)
            trained.append([p.detach() for p in params])
            personal[k] = [p.detach() for p in head]
            sizes.append(len(y))
        total = sum(sizes)
        weights = [sum(n / total * t[i] for n, t in zip(sizes, trained, strict=True)) for i in range(4)]
    return weights, personal


def personal_scores(data, weights, personal):
    """Loss and accuracy of every client's generic + personalised logits on its held-out split, over all samples."""
    w1, b1, w2, b2 = weights
    losses, correct = [], []
    for k, (wp, bp) in personal.items():
        index = data.held_out_index[data.held_out_group == k]
        x, y = data.pool.inputs[index].flatten(1), data.pool.targets[index]
        z = torch.relu(x @ w1.T + b1)
        logits = z @ w2.T + b2 + z @ wp.T + bp
        losses.append(F.cross_entropy(logits, y, reduction="none"))
        correct.append(logits.argmax(1) == y)
    return torch.cat(losses).mean().item(), torch.cat(correct).float().mean().item()


def test_rounds_of_partial_participation_follow_the_paper(tmp_path):
    rule = Recorded()
    trainer, start = fit(tmp_path, rule)
    assert len(rule.rounds) == ROUNDS and all(len(clients) == 2 for clients in rule.rounds)
    data = trainer.run.datamodule
    weights, personal = reference(data, rule.rounds, start)
    for name, got, expected in zip(NAMES, global_weights(trainer), weights, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=name)
    store = trainer.model.client_states
    trained = {k for clients in rule.rounds for k in clients}
    assert len(trained) < len(SIZES)  # a client that never trained keeps φ = 0 and is scored with the generic model
    for k in range(len(SIZES)):
        own = store.get(k)
        assert (own is not None) == (k in trained)
        got = torch.zeros(18) if own is None else own["personal_head"]
        expected = torch.cat([p.reshape(-1) for p in personal[k]])
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=f"φ of client {k}")
    assert any(personal[k][0].abs().sum() > 0 for k in trained)
    loss, acc = personal_scores(data, weights, personal)
    assert trainer.history[-1]["clients/personal/loss"] == pytest.approx(loss, rel=1e-5)
    assert trainer.history[-1]["clients/personal/acc"] == pytest.approx(acc, abs=1e-6)
    generic, _ = personal_scores(data, weights, {k: [torch.zeros(3, 5), torch.zeros(3)] for k in personal})
    assert trainer.history[-1]["clients/loss"] == pytest.approx(generic, rel=1e-5)
    assert generic != pytest.approx(loss, rel=1e-3)  # the personalised heads change the clients' scores


def test_one_round_from_zero_by_hand(tmp_path):
    # From all-zero weights the features and generic logits are 0. The balanced softmax of zero logits is the client's
    # prior π_k itself, so ℓ_BSM's gradient q − π_k vanishes and the generic model stays at 0, where FedAvg moves its
    # bias. The personalised head sees logits 0 + 0: its bias steps by −η (⅓ − π_k), its weight not at all (z = 0).
    # The first client (counts 3, 3, 0): b_φ = η (⅙, ⅙, −⅓); the second (5, 0, 1): b_φ = η (½, −⅓, −⅙).
    sizes, seeds = [6, 6], [8, 15]
    kwargs = {"rounds": 1, "epochs": 1, "clients_per_round": 2, "zero": True, "test_fraction": 0.0}
    trainer, _ = fit(tmp_path, FedRoD(), sizes, seeds, **kwargs)
    torch.testing.assert_close(trainer.global_state, torch.zeros_like(trainer.global_state), rtol=0, atol=1e-8)
    store = trainer.model.client_states
    first, second = (store.get(k)["personal_head"] for k in (0, 1))  # φ = (W_φ [3, 5], b_φ [3])
    assert not first[:15].any() and not second[:15].any()
    torch.testing.assert_close(first[15:], LR * torch.tensor([1 / 6, 1 / 6, -1 / 3]))
    torch.testing.assert_close(second[15:], LR * torch.tensor([1 / 2, -1 / 3, -1 / 6]))
    fedavg, _ = fit(tmp_path, FedAvg(), sizes, seeds, **kwargs)
    torch.testing.assert_close(global_weights(fedavg)[3], LR * torch.tensor([1 / 3, -1 / 12, -1 / 4]))


def test_bad_settings_are_refused_at_set_up(tmp_path):
    with pytest.raises(ConfigError, match=r"--strategy.init_args.head='net.tail' is no submodule"):
        fit(tmp_path, FedRoD(head="net.tail"))
    # the hidden layer gives 5 features, not the 3 logits
    with pytest.raises(ConfigError, match=r"must be the nn.Linear giving the 3 logits"):
        fit(tmp_path, FedRoD(head="net.encoder.1"))
    assert not list(tmp_path.rglob("*.ckpt"))
    # the personalised heads train with an optimizer like the client's: it must configure one
    data = FederatedDataModule(ClientImages(SIZES, SEEDS), batch_size=1000)
    client = make_client()
    client.optimizer = lambda params: [torch.optim.SGD(params, lr=LR)]
    trainer = FederatedTrainer(rounds=1, clients_per_round=2, logger=None, default_root_dir=tmp_path)
    with pytest.raises(ConfigError, match="configure_optimizers returns list, not one optimizer"):
        trainer.fit(client, data, FedRoD())
    assert not trainer.history
