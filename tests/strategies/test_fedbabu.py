"""FedBABU through the engine: a small MLP over ClientImages with two of four clients per round against Algorithm 1
written out in plain torch (the body averaged by n_k, the head never trained; every client scored after τ epochs of
fine-tuning from the global model), and one round of a two-scalar client worked out by hand."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedlight.clients import ClassificationClient
from fedlight.clients.base import FederatedClient
from fedlight.data import FederatedDataModule
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.strategies.fedbabu import FedBABU
from fedlight.testing import ClientImages, MeanSquaredError, ScalarDataset

SIZES, SEEDS = [10, 14, 8, 12], [1, 2, 3, 4]
LR, EPOCHS, ROUNDS, TAU = 0.2, 2, 3, 2
BODY = ["net.encoder.1.weight", "net.encoder.1.bias"]  # Flatten → Linear(64, 5) → ReLU
HEAD = ["net.head.weight", "net.head.bias"]  # Linear(5, 3)


class Recorded(FedBABU):
    """FedBABU that notes each round's clients, for the reference to replay."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rounds = []

    def on_round_start(self, context, round_idx, plans):
        self.rounds.append([plan.client for plan in plans])


def fit_images(root, rule, batch_size=10_000):
    data = FederatedDataModule(ClientImages(SIZES, SEEDS), batch_size=batch_size, test_fraction=0.25)
    trainer = FederatedTrainer(
        rounds=ROUNDS, clients_per_round=2, local_epochs=EPOCHS, logger=None, enable_progress_bar=False,
        default_root_dir=root,
    )  # fmt: skip
    client = make_client()
    initial = {name: t.detach().clone() for name, t in client.state_dict().items()}
    trainer.fit(client, data, rule)
    return trainer, initial


def make_client():
    torch.manual_seed(0)
    return ClassificationClient(
        num_classes=3, input_shape=(1, 8, 8), model="mlp", model_kwargs={"hidden": [5]},
        optimizer=lambda params: torch.optim.SGD(params, lr=LR),
    )  # fmt: skip


def logits(params, x):
    hidden = torch.relu(x.flatten(1) @ params[BODY[0]].T + params[BODY[1]])  # [B, 5]
    return hidden @ params[HEAD[0]].T + params[HEAD[1]]  # [B, 3]


def client_data(data, client, split):
    xs, ys = zip(*data.client_batches(client, split), strict=True)
    return torch.cat(xs), torch.cat(ys)


def sgd(params, trained, x, y, epochs):
    """``epochs`` full-batch SGD steps of the entries ``trained`` on the cross-entropy; the others stay."""
    params = dict(params)
    for _ in range(epochs):
        leaves = {n: params[n].detach().requires_grad_() for n in trained}
        loss = F.cross_entropy(logits({**params, **leaves}, x), y)
        grads = torch.autograd.grad(loss, list(leaves.values()))
        params.update({n: (t - LR * g).detach() for (n, t), g in zip(leaves.items(), grads, strict=True)})
    return params


def algorithm_1(initial, rounds, data):
    """The global model: each sampled client trains the body from W^t with the head at its initialisation, and the
    server averages the bodies by n_k."""
    model = {n: initial[n] for n in BODY + HEAD}
    for clients in rounds:
        bodies = [sgd(model, BODY, *client_data(data, k, "train"), EPOCHS) for k in clients]
        weights = [float(data.num_samples[k]) for k in clients]
        model.update({n: sum(w * b[n] for w, b in zip(weights, bodies, strict=True)) / sum(weights) for n in BODY})
    return model


@pytest.mark.parametrize(("part", "finetuned"), [("full", BODY + HEAD), ("head", HEAD)])
def test_rounds_of_partial_participation_follow_algorithm_1(tmp_path, part, finetuned):
    rule = Recorded(finetune_epochs=TAU, finetune_part=part)
    trainer, initial = fit_images(tmp_path, rule)
    data, layout = trainer.run.datamodule, trainer.model.layout
    assert [len(clients) for clients in rule.rounds] == [2] * ROUNDS
    model = algorithm_1(initial, rule.rounds, data)
    expected = torch.cat([model[n].reshape(-1) for n in layout.names])
    torch.testing.assert_close(trainer.global_state, expected, rtol=1e-5, atol=1e-6)
    head = layout.mask(HEAD)
    assert torch.equal(trainer.global_state[head], expected[head])  # the head never moved, not even by rounding
    assert all(p.requires_grad for p in trainer.model.module.parameters())  # nothing left fixed

    # every client, trained or not, fine-tunes the global model (all of it, or its head) for τ epochs and is scored
    # with the result
    total, count = 0.0, 0
    for k in range(len(SIZES)):
        own = sgd(model, finetuned, *client_data(data, k, "train"), TAU)
        x, y = client_data(data, k, "held_out")
        total += F.cross_entropy(logits(own, x), y, reduction="sum").item()
        count += len(y)
    assert trainer.history[-1]["clients/personal/loss"] == pytest.approx(total / count, rel=1e-5)
    assert trainer.history[-1]["clients/loss"] != pytest.approx(total / count, rel=1e-3)  # fine-tuning did something


def test_scoring_the_checkpoint_repeats_the_run_s_fine_tuned_scores(tmp_path):
    # batches of 4: a client's fine-tuning depends on the order of its batches, which must be the run's
    trainer, _ = fit_images(tmp_path, FedBABU(finetune_epochs=TAU), batch_size=4)
    scorer = FederatedTrainer(clients_per_round=2, logger=None, enable_progress_bar=False, default_root_dir=tmp_path)
    data = FederatedDataModule(ClientImages(SIZES, SEEDS), batch_size=4, test_fraction=0.25)
    ckpt = trainer.run_dir / "checkpoints" / "last.ckpt"
    scores = scorer.validate(make_client(), data, FedBABU(finetune_epochs=TAU), ckpt)
    assert scores["clients/personal/loss"] == trainer.history[-1]["clients/personal/loss"]


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
        return torch.optim.SGD(self.parameters(), lr=0.25)

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


@pytest.mark.parametrize(("part", "kept"), [("full", 1 / 2), ("head", 3 / 4), ("body", 3 / 4)])
def test_one_round_by_hand(tmp_path, part, kept):
    trainer = fit_scalars(tmp_path, FedBABU(finetune_epochs=1, finetune_part=part, head="head"))
    # From (w, b) = (½, −¼) the residual r = w + b − y is −¾ (y = 1) and 2¼ (y = −2); one step of lr ¼ on w alone
    # gives w = 11/16 and −1/16, averaged (3·11/16 − 5/16) / 8 = 7/32, with b still −¼.
    assert trainer.global_state.tolist() == [7 / 32, -0.25]  # entries: body, head
    residuals = [7 / 32 - 0.25 - 1, 7 / 32 - 0.25 + 2]  # the global model's: −33/32 and 63/32
    global_loss = (3 * 0.5 * residuals[0] ** 2 + 5 * 0.5 * residuals[1] ** 2) / 8
    assert trainer.history[-1]["clients/loss"] == pytest.approx(global_loss, rel=1e-6)
    # one fine-tuning step of lr ¼ moves w + b by −½ r when both train and by −¼ r when one does: r becomes kept·r
    personal = (3 * 0.5 * (kept * residuals[0]) ** 2 + 5 * 0.5 * (kept * residuals[1]) ** 2) / 8
    assert trainer.history[-1]["clients/personal/loss"] == pytest.approx(personal, rel=1e-6)


def test_no_fine_tuning_scores_the_global_model(tmp_path):
    trainer = fit_scalars(tmp_path, FedBABU(finetune_epochs=0, head="head"))
    assert trainer.history[-1]["clients/personal/loss"] == pytest.approx(trainer.history[-1]["clients/loss"])


def test_bad_settings_are_refused():
    with pytest.raises(ConfigError) as err:
        FedBABU(finetune_epochs=-1, finetune_part="all")
    assert "--strategy.init_args.finetune_epochs" in str(err.value)
    assert "--strategy.init_args.finetune_part" in str(err.value)


def test_a_head_that_matches_none_or_all_is_refused_at_set_up(tmp_path):
    with pytest.raises(ConfigError, match=r"--strategy\.init_args\.head.*match none"):
        fit_scalars(tmp_path, FedBABU(head="classifier"))
    with pytest.raises(ConfigError, match=r"--strategy\.init_args\.head.*match every one"):
        fit_scalars(tmp_path, FedBABU(head="*"))
    assert not any(tmp_path.iterdir())  # before the run folder exists
