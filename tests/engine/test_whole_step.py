"""The compiled whole step's update equals torch.optim's, step by step, and it refuses what it does not compute.

The reference is torch.optim itself: the same module, batches and settings trained by the eager loop
(``zero_grad``, ``backward``, ``step``), in fp64 so that any difference is a wrong update, not rounding.
"""

import pytest
import torch
from torch import nn

from fedlight.engine.whole_step import WholeStep, whole_step_blocker
from fedlight.testing import PlainPrecision


class Client(nn.Module):
    def __init__(self, norm: bool = False) -> None:
        super().__init__()
        layers = [nn.Linear(6, 8), nn.BatchNorm1d(8)] if norm else [nn.Linear(6, 8)]
        self.net = nn.Sequential(*layers, nn.Tanh(), nn.Linear(8, 3))

    def training_step(self, batch, batch_idx):
        return {"loss": nn.functional.cross_entropy(self.net(batch[0]), batch[1])}


def batches(seed: int):
    """Five batches of 4 and a short last one of 3, fp64."""
    generator = torch.Generator().manual_seed(seed)
    sizes = [4, 4, 4, 4, 4, 3]
    return [
        (torch.randn(n, 6, generator=generator, dtype=torch.float64), torch.randint(0, 3, (n,), generator=generator))
        for n in sizes
    ]


def eager_fit(module, optimizer, data):
    total = 0.0
    for batch in data:
        loss = module.training_step(batch, 0)["loss"]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        total += loss.item()
    return total


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "sgd-momentum-dampening-decay": lambda p: torch.optim.SGD(
        p, lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.01
    ),
    "sgd-nesterov": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.8, nesterov=True),
    "adam-l2": lambda p: torch.optim.Adam(p, lr=0.01, betas=(0.8, 0.99), weight_decay=0.02),
    "adam-decoupled": lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.1, decoupled_weight_decay=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_two_clients_fits_equal_torch_optim_with_a_fresh_optimizer_each(name):
    make = OPTIMIZERS[name]
    torch.manual_seed(0)
    compiled, eager = Client().double(), Client().double()
    eager.load_state_dict(compiled.state_dict())
    step = WholeStep(compiled, lambda module, batch, outputs: outputs["loss"], PlainPrecision())
    for client in range(2):  # the second client's optimizer state starts from zero again, as a new optimizer's
        data = batches(client)
        loss_sum, steps = step.run(make(compiled.parameters()), iter(data))
        expected = eager_fit(eager, make(eager.parameters()), data)
        assert steps == len(data)
        assert loss_sum.item() == pytest.approx(expected, abs=1e-5)  # summed in fp32, as the eager fit's log is
        for (key, a), b in zip(compiled.state_dict().items(), eager.state_dict().values(), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=f"{name}, client {client}: {key}")
    assert step.steps_run == 2 * len(data)


def test_batchnorm_statistics_and_a_frozen_layer_follow_the_eager_fit():
    torch.manual_seed(1)
    compiled, eager = Client(norm=True).double(), Client(norm=True).double()
    eager.load_state_dict(compiled.state_dict())
    for module in (compiled, eager):
        module.net[0].requires_grad_(False)
    make = OPTIMIZERS["sgd-momentum-dampening-decay"]
    trainable = [p for p in compiled.parameters() if p.requires_grad]
    step = WholeStep(compiled, lambda module, batch, outputs: outputs["loss"], PlainPrecision())
    step.run(make(trainable), iter(batches(3)))
    eager_fit(eager, make([p for p in eager.parameters() if p.requires_grad]), batches(3))
    running_mean = compiled.net[1].running_mean
    assert running_mean.abs().sum() > 0  # the statistics did move
    for (key, a), b in zip(compiled.state_dict().items(), eager.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=key)


class IndexedClient(Client):
    """A loss that depends on the batch index, so a step run with another step's index would differ."""

    def training_step(self, batch, batch_idx):
        return {"loss": (1 + 0.25 * batch_idx) * nn.functional.cross_entropy(self.net(batch[0]), batch[1])}


def eager_indexed_fit(module, optimizer, data):
    total = 0.0
    for batch_idx, batch in enumerate(data):
        loss = module.training_step(batch, batch_idx)["loss"]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        total += loss.item()
    return total


@pytest.mark.parametrize("name", ["sgd-momentum-dampening-decay", "adamw"])
@pytest.mark.parametrize("steps_per_call", [2, 4])
def test_several_steps_per_call_equal_the_eager_steps_in_fp64(name, steps_per_call):
    make = OPTIMIZERS[name]
    torch.manual_seed(2)
    compiled, eager = IndexedClient().double(), IndexedClient().double()
    eager.load_state_dict(compiled.state_dict())
    step = WholeStep(
        compiled, lambda module, batch, outputs: outputs["loss"], PlainPrecision(), steps_per_call=steps_per_call
    )
    calls = []
    several = step.compiled_steps
    step.compiled_steps = lambda *args: calls.append(args[-1]) or several(*args)
    for client in range(2):  # six batches: five of 4, a short last one of 3
        data = batches(10 + client)
        loss_sum, steps = step.run(make(compiled.parameters()), iter(data))
        expected = eager_indexed_fit(eager, make(eager.parameters()), data)
        assert steps == len(data)
        assert loss_sum.item() == pytest.approx(expected, abs=1e-5)
        for (key, a), b in zip(compiled.state_dict().items(), eager.state_dict().values(), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=f"{name}, client {client}: {key}")
    # per client, the five full batches run as calls of 2, 2 (k = 2) or of 4 (k = 4), the fifth and the short
    # last batch one by one
    assert calls == {2: [2, 2], 4: [4]}[steps_per_call] * 2
    assert step.steps_run == 2 * len(data)


def test_a_run_shorter_than_a_call_takes_calls_of_the_largest_powers_of_two():
    make = OPTIMIZERS["sgd-nesterov"]
    torch.manual_seed(3)
    compiled, eager = IndexedClient().double(), IndexedClient().double()
    eager.load_state_dict(compiled.state_dict())
    step = WholeStep(compiled, lambda module, batch, outputs: outputs["loss"], PlainPrecision(), steps_per_call=8)
    calls = []
    several = step.compiled_steps
    step.compiled_steps = lambda *args: calls.append(args[-1]) or several(*args)
    data = batches(20)[:5] + batches(21)[:2]  # seven batches of 4: fewer than a call of 8
    step.run(make(compiled.parameters()), iter(data))
    eager_indexed_fit(eager, make(eager.parameters()), data)
    assert calls == [4, 2]  # then the seventh alone
    for (key, a), b in zip(compiled.state_dict().items(), eager.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=key)


def test_what_the_whole_step_does_not_compute_is_refused_with_the_reason():
    module = Client()
    params = list(module.parameters())
    sgd = torch.optim.SGD(params, lr=0.1)
    assert whole_step_blocker(module, [sgd], [], PlainPrecision()) is None
    assert "2 optimizers" in whole_step_blocker(module, [sgd, sgd], [], PlainPrecision())
    schedule = torch.optim.lr_scheduler.StepLR(sgd, 2)
    assert "scheduler" in whole_step_blocker(module, [sgd], [schedule], PlainPrecision())
    assert "RMSprop" in whole_step_blocker(module, [torch.optim.RMSprop(params)], [], PlainPrecision())
    assert "amsgrad" in whole_step_blocker(module, [torch.optim.Adam(params, amsgrad=True)], [], PlainPrecision())
    assert "maximize" in whole_step_blocker(
        module, [torch.optim.SGD(params, lr=0.1, maximize=True)], [], PlainPrecision()
    )
    mixed = torch.optim.SGD([{"params": params[:2], "nesterov": True, "momentum": 0.9}, {"params": params[2:]}], lr=0.1)
    assert "differ in nesterov" in whole_step_blocker(module, [mixed], [], PlainPrecision())
    part = torch.optim.SGD(params[:2], lr=0.1)
    assert "exactly the module's trainable parameters" in whole_step_blocker(module, [part], [], PlainPrecision())

    class Scaled(PlainPrecision):
        scaler = torch.amp.GradScaler("cpu")

    assert "gradient scaler" in whole_step_blocker(module, [sgd], [], Scaled())
