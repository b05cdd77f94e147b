"""FedLC through the engine against Eq. 7 of Zhang et al. (ICML 2022) written out in plain torch: a one-hidden-layer
ReLU MLP over ClientImages, full-batch SGD, rounds of partial participation, and the calibrated cross-entropy of
logits shifted by −τ n_{k,c}^{−1/4} (a class the client lacks at −∞), the local models averaged by n_k."""

import math

import pytest
import torch

from fedlight.clients import ClassificationClient
from fedlight.data import FederatedDataModule
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.strategies.fedavg import FedAvg
from fedlight.strategies.fedlc import FedLC
from fedlight.testing import ClientImages, ScalarClient, ScalarDataset

# client 0 holds no sample of class 2, client 3 none of class 1 (asserted below)
SIZES, SEEDS = [6, 10, 12, 6], [8, 3, 5, 15]
LR, EPOCHS, ROUNDS, TAU = 0.1, 2, 3, 0.8


class Recorded(FedLC):
    """FedLC that notes each round's clients, for the reference to replay."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rounds = []

    def on_round_start(self, context, round_idx, plans):
        self.rounds.append([plan.client for plan in plans if not plan.dropped])


def make_client(zero=False):
    torch.manual_seed(0)
    client = ClassificationClient(
        num_classes=3, input_shape=(1, 8, 8), model="mlp", model_kwargs={"hidden": [5]},
        optimizer=lambda params: torch.optim.SGD(params, lr=LR),
    )  # fmt: skip
    if zero:
        with torch.no_grad():
            for p in client.parameters():
                p.zero_()
    return client


def fit(root, rule, sizes=SIZES, seeds=SEEDS, rounds=ROUNDS, epochs=EPOCHS, clients_per_round=2, zero=False):
    data = FederatedDataModule(ClientImages(sizes, seeds), batch_size=1000, test_fraction=0.0)
    trainer = FederatedTrainer(
        rounds=rounds, clients_per_round=clients_per_round, local_epochs=epochs, logger=None,
        enable_progress_bar=False, default_root_dir=root,
    )  # fmt: skip
    client = make_client(zero)
    start = {name: p.detach().clone() for name, p in client.net.named_parameters()}
    trainer.fit(client, data, rule)
    return trainer, start


def weights(trainer):
    """The global model's parameters by name (``net.`` dropped)."""
    state = trainer.model.layout.to_state_dict(trainer.global_state, {})
    return {name.removeprefix("net."): value for name, value in state.items()}


def reference(data, rounds, start, tau):
    """The global MLP after ``rounds`` (each a list of sampled clients) of E full-batch SGD steps on Eq. 7."""
    w1, b1, w2, b2 = (start[k] for k in ("encoder.1.weight", "encoder.1.bias", "head.weight", "head.bias"))
    for clients in rounds:
        trained, sizes = [], []
        for k in clients:
            x = data.pool.inputs[data.client_train[k]].flatten(1)
            y = data.pool.targets[data.client_train[k]]
            counts = torch.stack([(y == c).sum() for c in range(3)]).float()  # n_{k,c}
            margin = tau * counts.pow(-0.25) if tau > 0 else torch.zeros(3)  # τ n^{−1/4}: ∞ where n = 0
            params = [t.clone().requires_grad_() for t in (w1, b1, w2, b2)]
            for _ in range(EPOCHS):
                a1, c1, a2, c2 = params
                logits = torch.relu(x @ a1.T + c1) @ a2.T + c2 - margin  # f_c(x) − τ n_{k,c}^{−1/4}
                log_probs = logits - torch.logsumexp(logits, dim=1, keepdim=True)
                loss = -log_probs[torch.arange(len(y)), y].mean()
                grads = torch.autograd.grad(loss, params)
                params = [(p - LR * g).detach().requires_grad_() for p, g in zip(params, grads, strict=True)]
            trained.append([p.detach() for p in params])
            sizes.append(len(y))
        total = sum(sizes)
        w1, b1, w2, b2 = (sum(n / total * t[i] for n, t in zip(sizes, trained, strict=True)) for i in range(4))
    return {"encoder.1.weight": w1, "encoder.1.bias": b1, "head.weight": w2, "head.bias": b2}


def test_the_clients_lack_classes():
    labels = [ClientImages._draw(n, s)[1] for n, s in zip(SIZES, SEEDS, strict=True)]
    assert [torch.bincount(y, minlength=3).tolist() for y in labels] == [[3, 3, 0], [3, 5, 2], [4, 5, 3], [5, 0, 1]]


@pytest.mark.parametrize("tau", [TAU, 0.0])
def test_rounds_of_partial_participation_follow_eq_7(tmp_path, tau):
    rule = Recorded(tau=tau)
    trainer, start = fit(tmp_path, rule)
    assert len(rule.rounds) == ROUNDS and all(len(clients) == 2 for clients in rule.rounds)
    assert {0, 3} <= {k for clients in rule.rounds for k in clients}  # both clients that lack a class trained
    expected = reference(trainer.run.datamodule, rule.rounds, start, tau)
    got = weights(trainer)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)
    fedavg, _ = fit(tmp_path, FedAvg())
    if tau == 0:  # no calibration: FedAvg's loss, bit for bit
        assert torch.equal(trainer.global_state, fedavg.global_state)
    else:  # the calibration changed the training
        assert not torch.allclose(trainer.global_state, fedavg.global_state, atol=1e-4)


def test_one_round_from_zero_by_hand(tmp_path):
    # From all-zero weights every logit is 0 and only the head's bias moves, by −η (q_k − π_k) on client k, where q_k
    # is the softmax of the calibration and π_k the client's class shares. Client 0 (counts 3, 3, 0) has q = π = (½,
    # ½, 0): no step. Client 3 (5, 0, 1): calibrated logits −5^{−¼}, −∞, −1, so q = (s, 0, 1 − s) with
    # s = 1 / (1 + e^{5^{−¼} − 1}) = 0.58206, and π = (⅚, 0, ⅙). The average weighs both by 6/12.
    sizes, seeds = [6, 6], [8, 15]
    trainer, _ = fit(tmp_path, FedLC(tau=1.0), sizes, seeds, rounds=1, epochs=1, clients_per_round=2, zero=True)
    s = 1 / (1 + math.exp(5**-0.25 - 1))
    q, prior = torch.tensor([s, 0.0, 1 - s]), torch.tensor([5 / 6, 0.0, 1 / 6])
    got = weights(trainer)
    torch.testing.assert_close(got["head.bias"], -LR * 0.5 * (q - prior))
    assert got["head.bias"][0].item() == pytest.approx(0.1 * 0.5 * 0.25127, abs=1e-5)
    assert all(not value.any() for name, value in got.items() if name != "head.bias")
    # FedAvg's uniform softmax moves client 0 too: −η ((⅓ − π_0) + (⅓ − π_3)) / 2 = η (⅓, −1/12, −¼)
    fedavg, _ = fit(tmp_path, FedAvg(), sizes, seeds, rounds=1, epochs=1, clients_per_round=2, zero=True)
    torch.testing.assert_close(weights(fedavg)["head.bias"], LR * torch.tensor([1 / 3, -1 / 12, -1 / 4]))


def test_bad_settings_are_refused(tmp_path):
    for tau in (-0.5, float("nan")):
        with pytest.raises(ConfigError, match=r"--strategy.init_args.tau \(τ\) ≥ 0"):
            FedLC(tau=tau)
    # regression targets have no classes to count: refused at set-up, before any round
    data = FederatedDataModule(ScalarDataset([4, 6], [1.0, 2.0]), batch_size=100)
    trainer = FederatedTrainer(rounds=1, clients_per_round=2, logger=None, default_root_dir=tmp_path)
    with pytest.raises(ConfigError, match="FedLC calibrates each client's loss with its class counts"):
        trainer.fit(ScalarClient(), data, FedLC())
    assert not trainer.history
