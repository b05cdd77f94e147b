"""Teachers: frozen models a strategy hands to the client's loss, one copy per role, checkpointed with it."""

import pytest
import torch
from torch import nn

from fedlight import checkpoint as ckpt_io
from fedlight.data import FederatedDataModule
from fedlight.engine.trainer import FederatedTrainer
from fedlight.state import FlatState
from fedlight.strategies import FedAvg
from fedlight.teachers import Teachers
from fedlight.testing import ScalarClient, ScalarDataset


class DistilledScalar(ScalarClient):
    """½(w − y)² + ½(w − w_T)² with w_T the teacher's w: a full-batch SGD step with lr 1 lands on ȳ + w_T − w."""

    def training_step(self, batch, batch_idx):
        teacher = self.teachers["kd"]
        assert not teacher.w.requires_grad and not teacher.training
        loss = super().training_step(batch, batch_idx)["loss"]
        return {"loss": loss + 0.5 * (self.w - teacher.w) ** 2}


class FixedTeacher(FedAvg):
    """Hands every client the same teacher, w_T = 3, held by the strategy."""

    def __init__(self):
        super().__init__()
        self.teachers = Teachers()
        self.handed = []

    def on_fit_start(self, context):
        if "kd" not in self.teachers:
            self.teachers.set("kd", torch.full_like(context.global_state, 3.0))

    def client_teachers(self, context, plan):
        teacher = self.teachers.module("kd", context.module, context.layout)
        self.handed.append(teacher)
        return {"kd": teacher}

    def state_dict(self):
        return {"teachers": self.teachers.state_dict()}

    def load_state_dict(self, state):
        self.teachers.load_state_dict(state["teachers"])


def test_a_teacher_is_used_inside_the_clients_loss_and_checkpointed(tmp_path):
    # two clients with targets 1 (n = 2) and 3 (n = 6) train on their whole split in one batch
    data = FederatedDataModule(ScalarDataset([4, 12], [1.0, 3.0]), batch_size=100, test_fraction=0.5)
    strategy = FixedTeacher()
    settings = {"clients_per_round": 2, "local_epochs": 1, "logger": "csv", "enable_progress_bar": False}
    trainer = FederatedTrainer(rounds=2, default_root_dir=tmp_path, **settings)
    model = DistilledScalar()
    trainer.fit(model, data, strategy)
    # round 1 from w = 0: clients land on 1 + 3 = 4 and 3 + 3 = 6, averaged (2·4 + 6·6)/8 = 5.5;
    # round 2 from 5.5: 1 + 3 − 5.5 = −1.5 and 3 + 3 − 5.5 = 0.5, averaged (2·(−1.5) + 6·0.5)/8 = 0
    assert trainer.global_state.item() == pytest.approx(0.0, abs=1e-6)
    assert len(strategy.handed) == 4 and all(t is strategy.handed[0] for t in strategy.handed)  # one copy
    assert dict(model.teachers) == {}  # handed for the length of a local fit only
    state = ckpt_io.load(trainer.run_dir / "checkpoints" / "last.ckpt")["strategy"]["state"]
    assert state["teachers"]["states"]["kd"].tolist() == [3.0]


def test_a_running_mean_teacher_averages_parameters_and_batchnorm_statistics():
    net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    layout = FlatState(net)
    states = [torch.randn(layout.numel) for _ in range(4)]
    teachers = Teachers()
    for state in states:
        teachers.average_in("swa", state)
    mean = torch.stack(states).mean(dim=0)
    torch.testing.assert_close(teachers.states["swa"], mean)
    teacher = teachers.module("swa", net, layout)
    torch.testing.assert_close(layout.flatten(teacher), mean)
    assert teacher is not net and not teacher.training
    assert teacher[1].running_var.tolist() == pytest.approx(mean[-2:].tolist())


def test_a_running_mean_teacher_after_n_states_is_their_arithmetic_mean_and_leaves_them_alone():
    generator = torch.Generator().manual_seed(4)
    states = [torch.randn(6, generator=generator) for _ in range(5)]
    originals = [state.clone() for state in states]
    teachers = Teachers()
    for n, state in enumerate(states):
        teachers.average_in("swa", state)
        torch.testing.assert_close(teachers.states["swa"], torch.stack(states[: n + 1]).mean(0))
        assert teachers.counts["swa"] == n + 1
    for state, original in zip(states, originals, strict=True):
        assert torch.equal(state, original)


def test_the_first_state_averaged_in_is_kept_exactly():
    teachers = Teachers()
    teachers.set("swa", torch.tensor([1e8, -5.0, 0.0]))
    teachers.counts["swa"] = 0  # as if reset: the next state overwrites
    new = torch.tensor([0.1, 1e-8, 3.3])
    teachers.average_in("swa", new)
    assert torch.equal(teachers.states["swa"], new)
