"""GradientDissimilarity against the direct formula with per-client autograd gradients computed here."""

import pytest
import small_run
import torch
import torch.nn.functional as F
from small_run import make_model, make_trainer

from fedlight.callbacks import GradientDissimilarity, RoundCallback
from fedlight.callbacks.gradient_dissimilarity import dissimilarity_from_sums
from fedlight.errors import ConfigError
from fedlight.strategies import FedAvg, FedProx


def make_data():
    # evaluation-sized batches of 16: a client's full-batch gradient is assembled from several batches
    return small_run.make_data(eval_batch_size=16)


class StartStates(RoundCallback):
    """Keeps W^t as each round starts."""

    def __init__(self):
        self.states = {}

    def on_round_start(self, trainer, round_idx):
        self.states[round_idx] = trainer.global_state.clone()


class GradsAndMode(RoundCallback):
    """Records the resident module's ``.grad`` and training flag as each round starts."""

    def __init__(self):
        self.seen = []

    def on_round_start(self, trainer, round_idx):
        grads = [None if p.grad is None else p.grad.clone() for p in trainer.module.parameters()]
        self.seen.append((grads, trainer.module.training))


def direct_dissimilarity(model, data):
    """(1/K) Σ_k ‖∇L_k − ∇L‖², ∇L = Σ_k (n_k/n) ∇L_k, each ∇L_k from one autograd call on all of k's data."""
    params = list(model.parameters())
    gradients, sizes = [], []
    for indices in data.client_train:
        loss = F.cross_entropy(model(data.pool.inputs[indices]), data.pool.targets[indices])
        gradients.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]).double())
        sizes.append(len(indices))
    weights = torch.tensor(sizes, dtype=torch.float64) / sum(sizes)
    mean = sum(w * g for w, g in zip(weights, gradients, strict=True))
    return torch.stack([(g - mean).square().sum() for g in gradients]).mean().item()


def test_closed_form_equals_the_direct_formula():
    generator = torch.Generator().manual_seed(0)
    g = torch.randn(7, 50, generator=generator, dtype=torch.float64)  # [K, P]
    n = torch.randint(1, 100, (7,), generator=generator).double()
    mean = (n[:, None] * g).sum(dim=0) / n.sum()
    direct = (g - mean).square().sum(dim=1).mean()
    closed = dissimilarity_from_sums(g.square().sum(), g.sum(dim=0), mean, num_clients=7)
    torch.testing.assert_close(closed, direct)


@pytest.mark.parametrize("strategy", [FedAvg, FedProx])
def test_dissimilarity_at_the_round_start_model_over_all_clients(tmp_path, strategy):
    states = StartStates()
    trainer = make_trainer(tmp_path, callbacks=[states, GradientDissimilarity()])
    trainer.fit(make_model(), make_data(), strategy())
    for round_idx, row in enumerate(trainer.history):
        model = make_model()
        trainer.model.layout.load(model, states.states[round_idx])
        expected = direct_dissimilarity(model, trainer.run.datamodule)
        assert expected > 0
        assert row["analysis/gradient_dissimilarity"] == pytest.approx(expected, rel=1e-4)


def test_measuring_leaves_the_training_trajectory_unchanged(tmp_path):
    plain = make_trainer(tmp_path / "plain", rounds=3)
    plain.fit(make_model(), make_data(), FedAvg())
    before, after = GradsAndMode(), GradsAndMode()
    callbacks = [before, GradientDissimilarity(every_n_rounds=2), after]
    measured = make_trainer(tmp_path / "measured", rounds=3, callbacks=callbacks)
    measured.fit(make_model(), make_data(), FedAvg())
    torch.testing.assert_close(measured.global_state, plain.global_state, rtol=0, atol=0)
    for with_cb, without in zip(measured.history, plain.history, strict=True):
        assert with_cb["train/loss"] == without["train/loss"] and with_cb["test/acc"] == without["test/acc"]
    # due in round 1 (every 2) and in the last round
    assert ["analysis/gradient_dissimilarity" in row for row in measured.history] == [False, True, True]
    # the module's gradients (the previous local step's) and mode are put back as they were
    for (grads_before, mode_before), (grads_after, mode_after) in zip(before.seen, after.seen, strict=True):
        assert mode_after == mode_before
        for grad_before, grad_after in zip(grads_before, grads_after, strict=True):
            torch.testing.assert_close(grad_after, grad_before, rtol=0, atol=0)
    assert before.seen[1][0][0] is not None  # round 1 starts with gradients left by round 0


def test_bad_cadence_names_the_flag():
    message = r"--trainer.callbacks \(fedlight.callbacks.GradientDissimilarity\) init_args.every_n_rounds ≥ 1, got 0"
    with pytest.raises(ConfigError, match=message):
        GradientDissimilarity(every_n_rounds=0)
