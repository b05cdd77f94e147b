"""A round's clients trained as one vectorised model give the sequential run's clients, plans and model."""

import pytest
import torch

from fedlight.clients import ClassificationClient
from fedlight.data import FederatedDataModule
from fedlight.engine.batched import BatchedLocalFit, batching_blocker
from fedlight.engine.stacked import InGraphUpdate
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.state import FlatState
from fedlight.strategies import FedAvg, FedProx
from fedlight.testing import ClientImages, PlainPrecision

# trainers built without a default_root_dir write into the test's own runs/
pytestmark = pytest.mark.usefixtures("runs_in_tmp")

# Summation order inside a batched matrix product differs from K separate ones. In fp32 an ulp of
# difference per step compounds through small-batch SGD over a run (measured: 4e-4 after 5 rounds of 5
# epochs), so equivalence is checked where rounding cannot hide a wrong step: one local step in fp32, and
# whole runs in fp64 (the global state stays fp32 between rounds, as always).
ONE_STEP_ATOL = 1e-6
RUN_ATOL = 1e-6


class Recording(FedAvg):
    """FedAvg that keeps every round's (client, epochs, steps) — server-side only, so batching stays on."""

    def __init__(self):
        super().__init__(tolerate_stragglers=True)
        self.rounds = []

    def on_round_end(self, context, round_idx, updates):
        self.rounds.append([(u.client, u.epochs, u.num_steps) for u in updates])
        return {}


def images():
    """Eight clients of 17 to 52 one-channel 8×8 images of 3 classes; batches of 10 leave short last batches."""
    sizes = [23, 31, 40, 17, 52, 28, 35, 44]
    return FederatedDataModule(ClientImages(sizes, list(range(8))), batch_size=10, test_fraction=0.0)


MLP = {"num_classes": 3, "input_shape": (1, 8, 8), "model": "mlp", "model_kwargs": {"hidden": [32, 16]}}
CNN = {"num_classes": 3, "input_shape": (1, 8, 8), "model": "cnn", "model_kwargs": {"hidden": 32}}


def run(data, model_kwargs, optimizer, batching, rounds=4, precision="64-true", **settings):
    torch.manual_seed(0)
    model = ClassificationClient(optimizer=optimizer, **model_kwargs)
    strategy = Recording()
    settings = {"clients_per_round": 6, "local_epochs": 3, "straggler_fraction": 0.5, **settings}
    trainer = FederatedTrainer(
        rounds=rounds, logger=None, enable_progress_bar=False, client_batching=batching, precision=precision,
        **settings,
    )  # fmt: skip
    trainer.fit(model, data, strategy)
    return trainer, strategy


SGD = pytest.param(lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), id="sgd")
ADAM = pytest.param(lambda p: torch.optim.Adam(p, lr=1e-3), id="adam")


@pytest.mark.parametrize("optimizer", [SGD, ADAM])
@pytest.mark.parametrize("batching", [3, 8])
def test_batched_mlp_rounds_equal_the_sequential_ones(optimizer, batching):
    sequential, plans = run(images(), MLP, optimizer, None)
    batched, batched_plans = run(images(), MLP, optimizer, batching)
    assert not isinstance(batched.run.pieces.fits.vectorised, str)  # it did run vectorised
    assert batched_plans.rounds == plans.rounds  # the same clients, straggler epochs and step counts
    assert len({steps for rounds in plans.rounds for _, _, steps in rounds}) > 1  # clients stop at different steps
    torch.testing.assert_close(batched.global_state, sequential.global_state, rtol=0, atol=RUN_ATOL)
    for a, b in zip(sequential.history, batched.history, strict=True):
        assert a["train/loss"] == pytest.approx(b["train/loss"], abs=1e-6)


@pytest.mark.parametrize("sequential_below", [0, 3, 6])
def test_vectorised_plain_and_tail_steps_mix_to_the_sequential_rounds(monkeypatch, sequential_below):
    """0: every step vectorised, even one client's; 3: groups of up to 3 clients (short last batches, the
    round's tail) take plain steps sliced out of the stack and written back; 6: every client alone."""
    monkeypatch.setattr(BatchedLocalFit, "sequential_below", sequential_below)
    optimizer = lambda p: torch.optim.Adam(p, lr=1e-2)  # noqa: E731  (per-client moments and step count)
    sequential, plans = run(images(), MLP, optimizer, None, rounds=3)
    batched, batched_plans = run(images(), MLP, optimizer, 8, rounds=3)
    assert batched_plans.rounds == plans.rounds
    torch.testing.assert_close(batched.global_state, sequential.global_state, rtol=0, atol=RUN_ATOL)


COMPILED_OPTIMIZERS = [
    # dampening: SGD's first step sets the buffer to d itself, later ones μ b + (1 − dampening) d
    pytest.param(lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.3, weight_decay=1e-3), id="sgd"),
    pytest.param(lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=1e-2), id="adam"),
]


@pytest.mark.parametrize("optimizer", COMPILED_OPTIMIZERS)
def test_compiled_batched_rounds_equal_the_sequential_ones(optimizer, capsys):
    """Compiled, the stack keeps spare positions as clients finish (10 → 8 → 4 → 2 → 1 positions); steps of full
    batches update inside the graph, steps with short batches take the eager optimizer on the same state, and
    the rounds still equal the sequential ones."""
    sequential, plans = run(images(), MLP, optimizer, None, rounds=2)
    batched, batched_plans = run(images(), MLP, optimizer, 8, rounds=2, compile_batched=True)
    fit = batched.run.pieces.fits.vectorised
    assert fit._compiled is not None and fit._whole.steps > 0
    assert "compiles forward, backward and the optimizer's update as one graph" in capsys.readouterr().out
    assert batched_plans.rounds == plans.rounds
    torch.testing.assert_close(batched.global_state, sequential.global_state, rtol=0, atol=RUN_ATOL)


def test_several_stacked_steps_per_call_equal_the_sequential_rounds(monkeypatch):
    """With steps_per_call, runs of full batches of every stacked client take several steps per compiled call
    (4, or 2 where fewer are left before a short batch or a client's end); SGD's first step still runs alone."""
    sizes = []
    several = InGraphUpdate.several

    def recording(self, stacked, optimizer, xs, ys):
        sizes.append(len(xs))
        return several(self, stacked, optimizer, xs, ys)

    monkeypatch.setattr(InGraphUpdate, "several", recording)
    optimizer = COMPILED_OPTIMIZERS[0].values[0]  # SGD with momentum and dampening
    sequential, plans = run(images(), MLP, optimizer, None, rounds=2)
    batched, batched_plans = run(images(), MLP, optimizer, 8, rounds=2, compile_batched=True, steps_per_call=4)
    assert set(sizes) == {2, 4}
    assert batched_plans.rounds == plans.rounds
    torch.testing.assert_close(batched.global_state, sequential.global_state, rtol=0, atol=RUN_ATOL)


def test_the_in_graph_update_alternates_with_eager_steps_on_one_state():
    """Three stacked steps, in the graph, eager, in the graph, equal three steps of torch.optim per client in fp64:
    the state the compiled update creates and writes is the one torch.optim reads, and the reverse."""
    torch.manual_seed(0)
    client = ClassificationClient(**MLP).double()
    layout = FlatState(client)
    fit = BatchedLocalFit(client, layout, PlainPrecision(), compile=True, whole_step=True)
    starts = [torch.randn(layout.numel, dtype=torch.float64) * 0.1 for _ in range(3)]
    batches = [(torch.randn(3, 4, 1, 8, 8, dtype=torch.float64), torch.randint(0, 3, (3, 4))) for _ in range(3)]
    for make in (
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.5),
        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    ):
        stacked = [
            torch.stack([s[e.offset : e.offset + e.numel].reshape(e.shape) for s in starts]).requires_grad_(True)
            for e in layout.entries
        ]
        optimizer = make(stacked)
        for step, (x, y) in enumerate(batches):
            if step == 1:  # the eager path: gradients, then torch.optim's step on the stacked state
                grads, _ = fit._grads(dict(zip(fit._names, [p.detach() for p in stacked], strict=True)), x, y)
                for p, name in zip(stacked, fit._names, strict=True):
                    p.grad = grads[name]
                optimizer.step()
            else:
                fit._whole(stacked, optimizer, x, y)
        for k in range(3):
            layout.load(client, starts[k])
            reference = make(list(client.parameters()))
            for x, y in batches:
                reference.zero_grad()
                client.training_step((x[k], y[k]), 0)["loss"].backward()
                reference.step()
            for p, e in zip(stacked, layout.entries, strict=True):
                torch.testing.assert_close(p.detach()[k], dict(client.named_parameters())[e.name], rtol=0, atol=1e-12)


def test_a_compiled_stack_shrinks_through_powers_of_two():
    fit = BatchedLocalFit.__new__(BatchedLocalFit)
    fit._compiled = object()
    assert [fit._stack_size(active, 10) for active in (10, 9, 8, 5, 4, 3, 2, 1)] == [10, 10, 8, 8, 4, 4, 2, 1]
    assert [fit._stack_size(active, 6) for active in (6, 5, 4, 3, 1)] == [6, 6, 4, 4, 1]
    fit._compiled = None
    assert fit._stack_size(7, 10) == 7


def test_one_batched_fp32_step_equals_the_sequential_one():
    settings = {"local_steps": 1, "straggler_fraction": 0.0, "precision": "32-true"}
    optimizer = lambda p: torch.optim.SGD(p, lr=0.5)  # noqa: E731
    sequential, _ = run(images(), MLP, optimizer, None, rounds=1, **settings)
    batched, _ = run(images(), MLP, optimizer, 8, rounds=1, **settings)
    torch.testing.assert_close(batched.global_state, sequential.global_state, rtol=0, atol=ONE_STEP_ATOL)


def test_batched_cnn_rounds_equal_the_sequential_ones():
    optimizer = lambda p: torch.optim.SGD(p, lr=0.05)  # noqa: E731
    sequential, plans = run(images(), CNN, optimizer, None, rounds=3)
    batched, batched_plans = run(images(), CNN, optimizer, 8, rounds=3)
    assert batched_plans.rounds == plans.rounds
    torch.testing.assert_close(batched.global_state, sequential.global_state, rtol=0, atol=RUN_ATOL)


def test_rounds_that_cannot_be_vectorised_run_sequentially_and_say_why_once_on_the_console(capsys):
    torch.manual_seed(0)
    model = ClassificationClient(**MLP)
    trainer = FederatedTrainer(
        rounds=2, clients_per_round=3, local_epochs=1, logger=None, enable_progress_bar=False, client_batching=8
    )
    trainer.fit(model, images(), FedProx(mu=0.1))
    lines = [line for line in capsys.readouterr().out.splitlines() if "clients train one after another" in line]
    assert len(lines) == 1 and "FedProx overrides on_client_fit_start" in lines[0]
    assert trainer.run.pieces.fits.vectorised.startswith("FedProx")


def test_blockers_name_the_module_or_optimizer():
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2), torch.nn.Dropout(0.5))
    sgd = torch.optim.SGD(net.parameters(), lr=0.1)
    assert "1 is a BatchNorm" in batching_blocker(net, FlatState(net), FedAvg(), sgd)
    del net[1]
    assert "1 is an active dropout" in batching_blocker(net, FlatState(net), FedAvg(), sgd)
    net[1].p = 0.0
    assert batching_blocker(net, FlatState(net), FedAvg(), sgd) is None
    rmsprop = torch.optim.RMSprop(net.parameters())
    assert "RMSprop" in batching_blocker(net, FlatState(net), FedAvg(), rmsprop)


def test_a_chunk_below_one_is_refused():
    with pytest.raises(ConfigError, match="client_batching ≥ 1"):
        FederatedTrainer(client_batching=0)


def test_compiling_without_batching_is_refused_at_set_up():
    with pytest.raises(ConfigError, match=r"compile_batched=true .* --trainer\.client_batching=K or auto"):
        FederatedTrainer(compile_batched=True)


def auto_choice(capsys, model_kwargs, data, clients_per_round):
    """The console line of ``client_batching=auto`` on a CPU, and whether the run vectorised."""
    torch.manual_seed(0)
    trainer = FederatedTrainer(
        rounds=1, clients_per_round=clients_per_round, local_epochs=1, logger=None, enable_progress_bar=False,
        client_batching="auto", accelerator="cpu",
    )  # fmt: skip
    trainer.fit(ClassificationClient(**model_kwargs), data, FedAvg())
    lines = [line for line in capsys.readouterr().out.splitlines() if "client_batching" in line]
    assert len(lines) == 1, lines
    return lines[0], not isinstance(trainer.run.pieces.fits.vectorised, str)


def test_auto_keeps_convolutions_sequential_on_a_cpu_and_says_so(capsys):
    line, vectorised = auto_choice(capsys, CNN, images(), 6)
    assert not vectorised and "stacked convolutions (" in line and "client_batching=K" in line


def test_auto_vectorises_equal_clients_and_keeps_unequal_ones_sequential_on_a_cpu(capsys):
    # eight unequal clients, each one epoch: Σ steps / max steps = (3+4+4+2+6+3+4+5) / 6 = 5.2 < 8
    line, vectorised = auto_choice(capsys, MLP, images(), 8)
    assert not vectorised and "Σ steps / max steps over its clients is 5.2" in line
    # ten equal clients: the bound is 10, where an uncompiled stack measured 1.45× sequential
    equal = FederatedDataModule(ClientImages([30] * 10, list(range(10))), batch_size=10, test_fraction=0.0)
    line, vectorised = auto_choice(capsys, MLP, equal, 10)
    assert vectorised and "clients train vectorised" in line and "10.0" in line


class FailsOnClient(Recording):
    """Client ``bad``'s batches raise as they are drawn, in the sequential and the vectorised loop alike."""

    def __init__(self, bad):
        super().__init__()
        self.bad = bad

    def transform_batch(self, context, client, batch):
        if client == self.bad:
            raise ValueError(f"a corrupt sample of client {client}")
        return batch


def test_one_failing_client_leaves_only_itself_out_of_its_vectorised_group(tmp_path):
    sgd = lambda p: torch.optim.SGD(p, lr=0.05)  # noqa: E731
    results = {}
    for batching in (None, 4):  # every client of the eight each round, vectorised in two groups of four
        torch.manual_seed(0)
        trainer = FederatedTrainer(
            rounds=2, clients_per_round=8, local_epochs=2, logger=None, enable_progress_bar=False,
            client_batching=batching, precision="64-true", default_root_dir=tmp_path / str(batching),
        )  # fmt: skip
        strategy = FailsOnClient(bad=2)
        with pytest.warns(UserWarning, match=r"1 of 8 clients failed .* client 2 \(ValueError"):
            trainer.fit(ClassificationClient(optimizer=sgd, **MLP), images(), strategy)
        results[batching] = trainer, strategy
    (sequential, plans), (batched, batched_plans) = results[None], results[4]
    assert not isinstance(batched.run.pieces.fits.vectorised, str)  # a client's failure does not stop vectorising
    assert [row["round/clients_failed"] for row in batched.history] == [1.0, 1.0]
    assert batched_plans.rounds == plans.rounds and [len(r) for r in plans.rounds] == [7, 7]
    torch.testing.assert_close(batched.global_state, sequential.global_state, rtol=0, atol=RUN_ATOL)


class Branchy(torch.nn.Module):
    """An MLP whose ReLU runs only when the hidden layer's sum is positive: control flow that depends on the data,
    which ``torch.func.vmap`` refuses."""

    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, 16), torch.nn.Linear(16, num_classes)

    def forward_features(self, x):
        h = self.a(x.flatten(1))
        return h.relu() if h.sum() > 0 else h

    def forward_head(self, features):
        return self.b(features)

    def forward(self, x):
        return self.forward_head(self.forward_features(x))


def test_a_network_that_cannot_be_vectorised_switches_the_run_to_the_sequential_loop(capsys):
    branchy = {**MLP, "model": f"{__name__}.Branchy", "model_kwargs": {}}
    sgd = lambda p: torch.optim.SGD(p, lr=0.05)  # noqa: E731
    sequential, plans = run(images(), branchy, sgd, None, rounds=2)
    capsys.readouterr()
    batched, batched_plans = run(images(), branchy, sgd, 6, rounds=2)
    lines = [line for line in capsys.readouterr().out.splitlines() if "clients train one after another" in line]
    assert len(lines) == 1 and "vectorising the network failed in round 1 (RuntimeError: vmap" in lines[0]
    assert [row["round/clients_failed"] for row in batched.history] == [0.0, 0.0]
    assert batched_plans.rounds == plans.rounds
    torch.testing.assert_close(batched.global_state, sequential.global_state, rtol=0, atol=0)
