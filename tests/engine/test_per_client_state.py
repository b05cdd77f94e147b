"""Per-client state through the engine: each client's fit starts from its own slots and the engine keeps what the
fit leaves; the state survives a kill and resume bit for bit, does not depend on the memory budget, and gives each
client's own model to the personal evaluation. (One and two processes: ``test_per_client_state_processes.py``.)"""

import os
import shutil
import signal

import pytest
import torch

from fedlight.callbacks import RoundCallback
from fedlight.client_state import Slot
from fedlight.clients import ClassificationClient
from fedlight.data import FederatedDataModule, Synthetic
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError, RunInterrupted
from fedlight.strategies import FedAvg, FedPer
from fedlight.testing import Kill, KillAfterRound

ROUNDS = 4


class Tally(FedAvg):
    """Keeps each client's head (a local slot) and how many fits it ran (a vector slot), which enters its loss."""

    personalised = True

    def __init__(self):
        super().__init__()
        self.starts, self.ends = {}, {}  # (round, client) → (fits so far, head) when the fit starts / ends
        self._fits = None

    def client_state_slots(self, context):
        self._head = context.layout.mask([n for n in context.layout.names if ".head." in n])
        return {"head": Slot.local(self._head), "fits": Slot.vector(1)}

    def on_client_fit_start(self, context, module, plan):
        self._fits = context.client_state["fits"].clone()
        head = context.layout.flatten(module)[self._head]
        self.starts[context.round, plan.client] = (self._fits.item(), head)

    def training_loss(self, module, batch, outputs):
        # a client's loss depends on its own state: 0.01 · fits · Σ p
        return outputs["loss"] + 0.01 * self._fits.sum() * sum(p.sum() for p in module.parameters())

    def on_client_fit_end(self, context, module, update):
        context.client_state["fits"] = self._fits + 1
        self.ends[context.round, update.client] = context.layout.flatten(module)[self._head]


def data():
    return FederatedDataModule(Synthetic(num_clients=8, dim=12, seed=1), batch_size=10)


def model(seed=0):
    torch.manual_seed(seed)
    return ClassificationClient(num_classes=10, input_shape=(12,), model="mlp", model_kwargs={"hidden": [16]})


def fit(root, strategy, callbacks=None, ckpt_path=None, **kwargs):
    settings = {"clients_per_round": 4, "local_epochs": 1, "checkpoint_every": 2, "logger": "csv", **kwargs}
    trainer = FederatedTrainer(
        rounds=ROUNDS, default_root_dir=root, callbacks=callbacks, enable_progress_bar=False, **settings
    )
    trainer.fit(model(), data(), strategy, ckpt_path=ckpt_path)
    return trainer


def timeless(history):
    return [{key: value for key, value in row.items() if key != "round/time_s"} for row in history]


def states(trainer):
    store = trainer.model.client_states
    return {client: store.get(client) for client in sorted(store.index)}


def test_each_fit_starts_from_the_clients_own_slots_and_leaves_them_for_its_next(tmp_path):
    trainer = fit(tmp_path, Tally())
    rule = trainer.run.strategy
    trained = {}  # client → rounds it trained in, in order
    for round_idx, client in sorted(rule.starts):
        trained.setdefault(client, []).append(round_idx)
    assert len(trained) > 1 and any(len(rounds) > 1 for rounds in trained.values())
    for client, rounds in trained.items():
        for i, round_idx in enumerate(rounds):
            fits, head = rule.starts[round_idx, client]
            assert fits == i  # one more fit counted per round the client trained in
            if i:  # its head is where its own previous fit left it, not W^t's
                torch.testing.assert_close(head, rule.ends[rounds[i - 1], client], rtol=0, atol=0)
    store = trainer.model.client_states
    assert store.index == {client: rounds[-1] + 1 for client, rounds in trained.items()}
    for client, rounds in trained.items():
        assert store.get(client)["fits"].item() == len(rounds)
    # the files a checkpoint names, and no other: each client's current state and those of previous.ckpt
    names = {p.name for p in (trainer.run_dir / "client_state").iterdir()}
    assert {f"{client}-{version}.pt" for client, version in store.index.items()} <= names
    assert len(names) <= 2 * len(store.index)


def test_personal_evaluation_scores_each_client_with_its_own_model(tmp_path):
    trainer = fit(tmp_path, Tally(), eval_every=ROUNDS)
    metrics = trainer.history[-1]
    for name in ("acc", "loss", "acc_mean", "acc_min", "acc_p10", "acc_std"):
        assert f"clients/personal/{name}" in metrics and f"clients/{name}" in metrics
    # independently: W^T with each client's head, on its own held-out samples
    store, module, data_module = trainer.model.client_states, trainer.model.module, trainer.run.datamodule
    correct = count = 0
    per_client = []
    for client in range(data_module.num_clients):
        state = trainer.global_state.clone()
        own = store.get(client)
        if own is not None:
            state[trainer.run.strategy._head] = own["head"]
        trainer.model.layout.load(module, state)
        module.eval()
        hits = [(module(x).argmax(1) == y) for x, y in data_module.client_batches(client, "held_out")]
        hits = torch.cat(hits)
        correct, count = correct + int(hits.sum()), count + len(hits)
        per_client.append(hits.float().mean().item())
    assert metrics["clients/personal/acc"] == pytest.approx(correct / count, abs=1e-6)
    assert metrics["clients/personal/acc_min"] == pytest.approx(min(per_client), abs=1e-6)
    assert metrics["clients/personal/acc"] != metrics["clients/acc"]  # the heads differ from W^T's


def test_killed_and_resumed_run_keeps_every_clients_state_bit_for_bit(tmp_path):
    reference = fit(tmp_path / "reference", Tally())
    with pytest.raises(Kill):  # after round 3 trained and wrote its clients' states, before its checkpoint
        fit(tmp_path / "killed", Tally(), callbacks=[KillAfterRound(2)])
    killed_dir = next((tmp_path / "killed").glob("*/version_0"))
    resumed = fit(tmp_path / "killed", Tally(), ckpt_path=killed_dir / "checkpoints" / "last.ckpt")
    torch.testing.assert_close(resumed.global_state, reference.global_state, rtol=0, atol=0)
    assert timeless(resumed.history) == timeless(reference.history)  # personal metrics included
    expected, got = states(reference), states(resumed)
    assert expected.keys() == got.keys()
    for client in expected:
        for name in expected[client]:
            torch.testing.assert_close(got[client][name], expected[client][name], rtol=0, atol=0)


def test_results_do_not_depend_on_the_memory_budget(tmp_path):
    roomy = fit(tmp_path / "roomy", Tally())
    one_state = roomy.model.client_states.client_nbytes
    tight = fit(tmp_path / "tight", Tally(), client_state_budget_mb=1.5 * one_state / 2**20)
    assert tight.model.client_states.peak_cache_nbytes == one_state  # never more than one state in memory
    assert roomy.model.client_states.peak_cache_nbytes > one_state
    torch.testing.assert_close(tight.global_state, roomy.global_state, rtol=0, atol=0)
    assert tight.history[-1]["clients/personal/acc"] == roomy.history[-1]["clients/personal/acc"]


def test_a_rule_with_local_slots_only_trains_vectorised(tmp_path, capsys):
    sequential = fit(tmp_path / "sequential", FedPer(head="net.head.*"))
    vectorised = fit(tmp_path / "vectorised", FedPer(head="net.head.*"), client_batching=4)
    assert "one after another" not in capsys.readouterr().out
    torch.testing.assert_close(vectorised.global_state, sequential.global_state, rtol=1e-4, atol=1e-6)
    one, other = states(sequential), states(vectorised)
    assert one.keys() == other.keys()
    for client in one:
        torch.testing.assert_close(other[client]["local"], one[client]["local"], rtol=1e-4, atol=1e-6)


def test_a_negative_budget_is_one_message_naming_the_flag(tmp_path):
    with pytest.raises(ConfigError, match="client_state_budget_mb"):
        FederatedTrainer(client_state_budget_mb=-1, logger=None, default_root_dir=tmp_path)


class StoppedInRound(Tally):
    """Tally that asks the run to stop (SIGINT, as Ctrl-C) once the first client of round ``round_idx`` trained."""

    def __init__(self, round_idx):
        super().__init__()
        self.stop_round = round_idx

    def on_client_fit_end(self, context, module, update):
        super().on_client_fit_end(context, module, update)
        if context.round == self.stop_round:
            self.stop_round = None
            os.kill(os.getpid(), signal.SIGINT)


def test_a_round_stopped_after_a_client_trained_resumes_with_the_states_it_started_from(tmp_path):
    reference = fit(tmp_path / "reference", Tally(), checkpoint_every=10)
    with pytest.raises(RunInterrupted) as err:  # round 3 dropped: its first client's new state is not kept
        fit(tmp_path / "stopped", StoppedInRound(2), checkpoint_every=10)
    assert err.value.dropped and err.value.round == 2
    resumed = fit(tmp_path / "stopped", StoppedInRound(-1), checkpoint_every=10, ckpt_path=err.value.checkpoint)
    torch.testing.assert_close(resumed.global_state, reference.global_state, rtol=0, atol=0)
    assert timeless(resumed.history) == timeless(reference.history)
    expected, got = states(reference), states(resumed)
    assert expected.keys() == got.keys()
    for client in expected:
        for name in expected[client]:
            torch.testing.assert_close(got[client][name], expected[client][name], rtol=0, atol=0)


def test_validating_a_checkpoint_scores_each_clients_own_model_too(tmp_path):
    trainer = fit(tmp_path, Tally(), checkpoint_every=ROUNDS)
    checkpoint = trainer.run_dir / "checkpoints" / "last.ckpt"
    evaluator = FederatedTrainer(clients_per_round=4, logger=None, enable_progress_bar=False, default_root_dir=tmp_path)
    metrics = evaluator.validate(model(seed=1), data(), Tally(), ckpt_path=checkpoint)
    for name in ("acc", "acc_min", "loss"):
        assert metrics[f"clients/personal/{name}"] == trainer.history[-1][f"clients/personal/{name}"], name


class CopyCheckpointAtRound(RoundCallback):
    """Copies the run's last.ckpt aside as round ``round_idx`` starts (after the previous round's checkpoint)."""

    def __init__(self, round_idx, destination):
        self.round_idx, self.destination = round_idx, destination

    def on_round_start(self, context, round_idx):
        if round_idx == self.round_idx:
            shutil.copy(context.run_dir / "checkpoints" / "last.ckpt", self.destination)


@pytest.mark.parametrize("keep", [True, False])
def test_a_checkpoint_copied_aside_resumes_only_while_its_states_are_kept(tmp_path, keep):
    backup = tmp_path / "r2.ckpt"
    kept = {"keep_client_states": keep, "checkpoint_every": 1}
    reference = fit(tmp_path / "run", Tally(), callbacks=[CopyCheckpointAtRound(2, backup)], **kept)
    if keep:  # the run's clean-up left the states the copy names: rewinding to it gives the same run again
        rewound = fit(tmp_path / "run", Tally(), ckpt_path=backup, rewind=True, **kept)
        torch.testing.assert_close(rewound.global_state, reference.global_state, rtol=0, atol=0)
        return
    with pytest.raises(ConfigError, match=r"The checkpoint names \d+ client states that are not in .*client_state"):
        fit(tmp_path / "run", Tally(), ckpt_path=backup, rewind=True, **kept)
