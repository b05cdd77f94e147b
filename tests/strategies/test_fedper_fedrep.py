"""FedPer and FedRep against step-by-step references on a two-scalar client: prediction w + b, loss ½(w + b − y)²,
w the shared body and b the head each client keeps (full-batch SGD, every client every round)."""

import pytest
import torch
from torch import nn

from fedlight.clients.base import FederatedClient
from fedlight.data import FederatedDataModule
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.strategies import FedPer, FedRep
from fedlight.testing import MeanSquaredError, ScalarDataset

SIZES, VALUES = [6, 10, 8], [1.0, -2.0, 4.0]
LR, EPOCHS, ROUNDS = 0.3, 2, 3


class BodyAndHead(FederatedClient):
    """Prediction w + b with loss ½(w + b − y)²."""

    def __init__(self, num_classes: int = 1, input_shape: tuple[int, ...] = (1,)) -> None:
        super().__init__()
        self.body = nn.Parameter(torch.tensor(0.5))
        self.head = nn.Parameter(torch.tensor(-0.25))

    def training_step(self, batch, batch_idx):
        return {"loss": 0.5 * ((self.body + self.head - batch[1]) ** 2).mean()}

    def validation_step(self, batch, batch_idx):
        return {"loss": 0.5 * (self.body + self.head - batch[1]) ** 2}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)

    def evaluation_metric(self, num_groups):
        return MeanSquaredError()


def fit(tmp_path, rule):
    data = FederatedDataModule(ScalarDataset(SIZES, VALUES), batch_size=10_000, test_fraction=0.5)
    trainer = FederatedTrainer(
        rounds=ROUNDS, clients_per_round=3, local_epochs=EPOCHS, logger=None, enable_progress_bar=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(BodyAndHead(), data, rule)
    return trainer


def reference(sizes, head_epochs=0):
    """Every round, each client from the shared body and its own head (W's head before its first round): FedPer's
    joint steps, or FedRep's ``head_epochs`` head steps then body steps. The server averages both by n_k."""
    body, head = 0.5, -0.25
    heads = [None] * len(VALUES)
    for _ in range(ROUNDS):
        bodies, new_heads = [], []
        for k, y in enumerate(VALUES):
            w, b = body, head if heads[k] is None else heads[k]
            if head_epochs:
                for _ in range(head_epochs):
                    b -= LR * (w + b - y)
                for _ in range(EPOCHS):
                    w -= LR * (w + b - y)
            else:
                for _ in range(EPOCHS):
                    r = w + b - y
                    w, b = w - LR * r, b - LR * r
            bodies.append(w)
            new_heads.append(b)
        heads = new_heads
        total = sum(sizes)
        body = sum(n * w for n, w in zip(sizes, bodies, strict=True)) / total
        head = sum(n * b for n, b in zip(sizes, heads, strict=True)) / total
    return body, head, heads


@pytest.mark.parametrize("rule", ["fedper", "fedrep"])
def test_three_rounds_match_the_reference(tmp_path, rule):
    trainer = fit(tmp_path, FedPer(head="head") if rule == "fedper" else FedRep(head_epochs=3, head="head"))
    sizes = trainer.run.datamodule.num_samples.tolist()
    body, head, heads = reference(sizes, head_epochs=3 if rule == "fedrep" else 0)
    assert trainer.global_state.tolist() == pytest.approx([body, head], abs=1e-6)  # entries: body, head
    store = trainer.model.client_states
    assert [store.get(k)["local"].item() for k in range(3)] == pytest.approx(heads, abs=1e-6)
    # each client's own model, w^T with its head, on its held-out samples (target y_k): ½(w + b_k − y_k)²
    held_out = [n_all - n for n_all, n in zip(SIZES, sizes, strict=True)]
    personal = sum(m * 0.5 * (body + b - y) ** 2 for m, b, y in zip(held_out, heads, VALUES, strict=True))
    assert trainer.history[-1]["clients/personal/loss"] == pytest.approx(personal / sum(held_out), rel=1e-5)


def test_a_head_that_matches_nothing_is_refused_at_set_up(tmp_path):
    with pytest.raises(ConfigError, match=r"--strategy\.init_args\.head"):
        fit(tmp_path, FedPer(head="classifier"))
    assert not any(tmp_path.iterdir())  # before the run folder exists
    with pytest.raises(ConfigError, match="head_epochs"):
        FedRep(head_epochs=0)
