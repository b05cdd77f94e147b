"""LG-FedAvg through the engine: a small MLP over ClientImages with two of four clients per round against Algorithm 1
written out in plain torch (each client's own body, the global head averaged by n_k), and one round of a two-scalar
client worked out by hand."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedlight.clients import ClassificationClient
from fedlight.clients.base import FederatedClient
from fedlight.data import FederatedDataModule
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.strategies.lg_fedavg import LGFedAvg
from fedlight.testing import ClientImages, MeanSquaredError, ScalarDataset

SIZES, SEEDS = [10, 14, 8, 12], [1, 2, 3, 4]
LR, EPOCHS, ROUNDS = 0.2, 2, 4
BODY = ["net.encoder.1.weight", "net.encoder.1.bias"]  # ℓ: Flatten → Linear(64, 5) → ReLU
HEAD = ["net.head.weight", "net.head.bias"]  # g: Linear(5, 3)


class Recorded(LGFedAvg):
    """LGFedAvg that notes each round's clients, for the reference to replay."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rounds = []

    def on_round_start(self, context, round_idx, plans):
        self.rounds.append([plan.client for plan in plans])


def fit_images(root, rule):
    data = FederatedDataModule(ClientImages(SIZES, SEEDS), batch_size=10_000, test_fraction=0.25)
    trainer = FederatedTrainer(
        rounds=ROUNDS, clients_per_round=2, local_epochs=EPOCHS, logger=None, enable_progress_bar=False,
        default_root_dir=root,
    )  # fmt: skip
    torch.manual_seed(0)
    client = ClassificationClient(
        num_classes=3, input_shape=(1, 8, 8), model="mlp", model_kwargs={"hidden": [5]},
        optimizer=lambda params: torch.optim.SGD(params, lr=LR),
    )  # fmt: skip
    initial = {name: t.detach().clone() for name, t in client.state_dict().items()}
    trainer.fit(client, data, rule)
    return trainer, initial


def logits(params, x):
    hidden = torch.relu(x.flatten(1) @ params[BODY[0]].T + params[BODY[1]])  # [B, 5]
    return hidden @ params[HEAD[0]].T + params[HEAD[1]]  # [B, 3]


def client_data(data, client, split):
    xs, ys = zip(*data.client_batches(client, split), strict=True)
    return torch.cat(xs), torch.cat(ys)


def sgd(params, x, y, epochs):
    """``epochs`` full-batch SGD steps of every entry on the cross-entropy."""
    for _ in range(epochs):
        leaves = {n: t.detach().requires_grad_() for n, t in params.items()}
        grads = torch.autograd.grad(F.cross_entropy(logits(leaves, x), y), list(leaves.values()))
        params = {n: (t - LR * g).detach() for (n, t), g in zip(leaves.items(), grads, strict=True)}
    return params


def algorithm_1(initial, rounds, data):
    """Every device's ℓ_m starts from ℓ^0; a sampled device trains (ℓ_m, g) jointly by full-batch SGD for E epochs
    from its ℓ_m and the server's g, and the server averages the round's g_m by n_k. Returns g and the ℓ_m."""
    head = {n: initial[n] for n in HEAD}
    bodies = {}
    for clients in rounds:
        heads, weights = [], []
        for k in clients:
            own = bodies.get(k, {n: initial[n] for n in BODY})  # ℓ_m, or ℓ^0 before the device's first round
            params = sgd({**own, **head}, *client_data(data, k, "train"), EPOCHS)
            bodies[k] = {n: params[n] for n in BODY}
            heads.append({n: params[n] for n in HEAD})
            weights.append(float(data.num_samples[k]))
        head = {n: sum(w * h[n] for w, h in zip(weights, heads, strict=True)) / sum(weights) for n in HEAD}
    return head, bodies


def test_rounds_of_partial_participation_follow_algorithm_1(tmp_path):
    rule = Recorded()
    trainer, initial = fit_images(tmp_path, rule)
    data, layout = trainer.run.datamodule, trainer.model.layout
    assert [len(clients) for clients in rule.rounds] == [2] * ROUNDS
    trained = [k for clients in rule.rounds for k in clients]
    assert any(trained.count(k) > 1 for k in trained)  # a body carried over to a later round
    head, bodies = algorithm_1(initial, rule.rounds, data)

    # W: the averaged head over W^0's body, which a client starts from before its first round
    expected = {**{n: initial[n] for n in BODY}, **head}
    torch.testing.assert_close(
        trainer.global_state, torch.cat([expected[n].reshape(-1) for n in layout.names]), rtol=1e-5, atol=1e-6
    )
    store = trainer.model.client_states
    for k, body in bodies.items():
        torch.testing.assert_close(store.get(k)["local"], torch.cat([body[n].reshape(-1) for n in BODY]))

    # each client's own model: its own body (W^0's if it never trained) under the global head, on its held-out split
    total, count = 0.0, 0
    for k in range(len(SIZES)):
        x, y = client_data(data, k, "held_out")
        own = {**bodies.get(k, {n: initial[n] for n in BODY}), **head}
        total += F.cross_entropy(logits(own, x), y, reduction="sum").item()
        count += len(y)
    assert trainer.history[-1]["clients/personal/loss"] == pytest.approx(total / count, rel=1e-5)


class BodyAndHead(FederatedClient):
    """Prediction w + b with loss ½(w + b − y)²: w the body, b the head."""

    def __init__(self, num_classes: int = 1, input_shape: tuple[int, ...] = (1,)) -> None:
        super().__init__()
        self.body = nn.Parameter(torch.tensor(0.5))
        self.head = nn.Parameter(torch.tensor(-0.25))

    def training_step(self, batch, batch_idx):
        return {"loss": 0.5 * ((self.body + self.head - batch[1]) ** 2).mean()}

    def validation_step(self, batch, batch_idx):
        return {"loss": 0.5 * (self.body + self.head - batch[1]) ** 2}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def evaluation_metric(self, num_groups):
        return MeanSquaredError()


def fit_scalars(root, rule):
    # clients of 6 and 10 samples with targets 1 and −2, half of each held out: n = 3, 5
    data = FederatedDataModule(ScalarDataset([6, 10], [1.0, -2.0]), batch_size=10_000, test_fraction=0.5)
    trainer = FederatedTrainer(
        rounds=1, clients_per_round=2, local_epochs=1, logger=None, enable_progress_bar=False, default_root_dir=root
    )
    trainer.fit(BodyAndHead(), data, rule)
    return trainer


def test_one_round_by_hand(tmp_path):
    trainer = fit_scalars(tmp_path, LGFedAvg(global_layers="head"))
    # From (w, b) = (½, −¼), one step of lr ½ on ½(w + b − y)² moves both by −½ r, r = w + b − y:
    # y = 1: r = −¾ → (⅞, ⅛); y = −2: r = 2¼ → (−⅝, −1⅜). g = (3·⅛ + 5·(−1⅜)) / 8 = −13/16; w stays ½.
    assert trainer.global_state.tolist() == [0.5, -0.8125]  # entries: body, head
    store = trainer.model.client_states
    assert [store.get(k)["local"].item() for k in range(2)] == [0.875, -0.625]
    # own models: ⅞ − 13/16 against 1, −⅝ − 13/16 against −2: ½(15/16)², ½(9/16)² over 3 and 5 held-out samples
    personal = (3 * 0.5 * (15 / 16) ** 2 + 5 * 0.5 * (9 / 16) ** 2) / 8
    assert trainer.history[-1]["clients/personal/loss"] == pytest.approx(personal, rel=1e-6)


def test_global_layers_that_match_none_or_all_are_refused_at_set_up(tmp_path):
    with pytest.raises(ConfigError, match=r"--strategy\.init_args\.global_layers.*match none"):
        fit_scalars(tmp_path, LGFedAvg(global_layers="classifier"))
    with pytest.raises(ConfigError, match=r"--strategy\.init_args\.global_layers.*match every one"):
        fit_scalars(tmp_path, LGFedAvg(global_layers="*"))
    assert not any(tmp_path.iterdir())  # before the run folder exists
