"""Compiled client steps (``--trainer.compile_steps``) train the clients the eager steps train: the whole step
compiled (SGD) and the forward pass and loss alone (an optimizer the whole step does not compute).

A compiled graph may fuse and reorder sums, so whole runs are compared in fp64, where rounding cannot hide a
wrong step, and in fp32 within a tolerance that a wrong step (a missed proximal term, a stale weight) exceeds
by orders of magnitude.
"""

import os
import tempfile
from pathlib import Path

import pytest
import torch

from fedlight.clients import ClassificationClient
from fedlight.data import FederatedDataModule
from fedlight.engine.trainer import FederatedTrainer
from fedlight.strategies import SCAFFOLD, FedAvg, FedDyn, FedProx
from fedlight.testing import ClientImages

# trainers built without a default_root_dir write into the test's own runs/
pytestmark = pytest.mark.usefixtures("runs_in_tmp")

FP64_ATOL = 1e-9
FP32_ATOL = 1e-6  # measured 1.5e-8 after 2 rounds of the MLP


def images():
    """Six clients of 17 to 44 one-channel 8×8 images of 3 classes; batches of 10 leave short last batches."""
    sizes = [23, 31, 40, 17, 28, 44]
    return FederatedDataModule(ClientImages(sizes, list(range(6))), batch_size=10, test_fraction=0.0)


def sgd(params):
    return torch.optim.SGD(params, lr=0.05)


def run(model, strategy, precision, compile_steps, optimizer=sgd, **settings):
    torch.manual_seed(0)
    client = ClassificationClient(num_classes=3, input_shape=(1, 8, 8), model=model, optimizer=optimizer)
    trainer = FederatedTrainer(
        rounds=2, clients_per_round=4, local_epochs=2, logger=None, enable_progress_bar=False,
        precision=precision, compile_steps=compile_steps, **settings,
    )  # fmt: skip
    trainer.fit(client, images(), strategy)
    return trainer


@pytest.mark.parametrize(
    ("model", "strategy"),
    [("mlp", FedAvg), ("cnn", lambda: FedProx(mu=0.5)), ("mlp", SCAFFOLD), ("mlp", lambda: FedDyn(alpha=0.1))],
    ids=["mlp-fedavg", "cnn-fedprox", "mlp-scaffold", "mlp-feddyn"],
)
def test_compiled_steps_train_as_the_eager_steps(model, strategy):
    eager = run(model, strategy(), "64-true", False)
    compiled = run(model, strategy(), "64-true", True)
    assert (
        compiled.run.pieces.training._whole.steps_run > 0 and eager.run.pieces.training._whole is None
    )  # forward, backward and update
    torch.testing.assert_close(compiled.global_state, eager.global_state, rtol=0, atol=FP64_ATOL)
    for a, b in zip(eager.history, compiled.history, strict=True):
        assert a["train/loss"] == pytest.approx(b["train/loss"], abs=1e-9)
    assert eager.history[0]["train/loss"] != eager.history[-1]["train/loss"]  # the clients did train


def test_compiled_steps_in_fp32_stay_within_rounding_of_the_eager_ones():
    eager = run("mlp", FedProx(mu=0.5), "32-true", False)
    compiled = run("mlp", FedProx(mu=0.5), "32-true", "default")
    difference = (compiled.global_state - eager.global_state).abs().max().item()
    assert difference < FP32_ATOL
    # the tolerance is far below what a wrong loss does: the proximal term alone moves the model more
    without_proximal = run("mlp", FedProx(mu=0.0), "32-true", False)
    assert (without_proximal.global_state - eager.global_state).abs().max().item() > 1000 * FP32_ATOL


def test_several_steps_per_compiled_call_train_as_the_eager_steps(capsys):
    eager = run("mlp", FedProx(mu=0.5), "64-true", False)
    compiled = run("mlp", FedProx(mu=0.5), "64-true", True, steps_per_call=3)
    whole = compiled.run.pieces.training._whole
    assert whole.steps_per_call == 3 and whole.steps_run > 0
    torch.testing.assert_close(compiled.global_state, eager.global_state, rtol=0, atol=FP64_ATOL)
    for a, b in zip(eager.history, compiled.history, strict=True):
        assert a["train/loss"] == pytest.approx(b["train/loss"], abs=1e-9)
    assert "3 steps of equal-shape batches per call" in capsys.readouterr().out


def test_auto_keeps_a_short_run_eager_and_says_on_what_estimate(capsys):
    eager = run("mlp", FedProx(mu=0.5), "64-true", False)
    auto = run("mlp", FedProx(mu=0.5), "64-true", "auto")
    training = auto.run.pieces.training
    assert training.auto_compiles is False and training._whole is None and training._compiled is None
    torch.testing.assert_close(auto.global_state, eager.global_state, rtol=0, atol=0)  # the eager steps, bit for bit
    out = capsys.readouterr().out
    # 2 rounds of 4 clients on one process: the first fit is timed, 7 fits are left
    assert "--trainer.compile_steps=auto: the first fit took" in out and "other 7 fits" in out
    assert "the steps stay eager" in out


def test_auto_compiles_a_run_long_enough_to_repay_it(monkeypatch, capsys):
    from fedlight.engine import whole_step

    monkeypatch.setattr(whole_step, "AUTO_MIN_EAGER_S", 0.0)  # any run is long enough
    eager = run("mlp", FedProx(mu=0.5), "64-true", False)
    auto = run("mlp", FedProx(mu=0.5), "64-true", "auto")
    training = auto.run.pieces.training
    assert training.auto_compiles is True and training._whole.steps_run > 0
    torch.testing.assert_close(auto.global_state, eager.global_state, rtol=0, atol=FP64_ATOL)
    assert "the steps are compiled" in capsys.readouterr().out


def test_auto_keeps_a_fit_the_whole_step_cannot_take_eager(monkeypatch, capsys):
    from fedlight.engine import whole_step

    monkeypatch.setattr(whole_step, "AUTO_MIN_EAGER_S", 0.0)
    auto = run("mlp", FedAvg(), "64-true", "auto", optimizer=with_schedule)
    training = auto.run.pieces.training
    assert training.auto_compiles is False and training._compiled is None
    assert "the whole step cannot run: configure_optimizers returned a learning-rate scheduler" in (
        capsys.readouterr().out
    )


def test_steps_per_call_without_compiled_steps_is_refused_at_set_up():
    from fedlight.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--trainer.steps_per_call=4 .* needs --trainer.compile_steps"):
        FederatedTrainer(logger=None, steps_per_call=4)
    with pytest.raises(ConfigError, match=r"steps_per_call ≥ 1"):
        FederatedTrainer(logger=None, compile_steps=True, steps_per_call=0)


def test_an_unknown_compile_mode_is_refused_naming_the_flag(capsys):
    from fedlight.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "fit",
                "--config",
                str(Path(__file__).resolve().parents[2] / "conf/digits/fedavg.yaml"),
                "--trainer.compile_steps=fastest",
                "--print_config",
            ]
        )
    assert exit_info.value.code != 0
    assert "compile_steps" in capsys.readouterr().err


def with_schedule(params):
    optimizer = torch.optim.SGD(params, lr=0.05)
    return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=3)}


def test_a_fit_the_whole_step_cannot_take_compiles_its_forward_pass_and_says_why(capsys):
    eager = run("mlp", FedAvg(), "64-true", False, optimizer=with_schedule)
    compiled = run("mlp", FedAvg(), "64-true", True, optimizer=with_schedule)
    assert compiled.run.pieces.training._whole is None and compiled.run.pieces.training._compiled is not None
    out = capsys.readouterr().out
    assert out.count("the backward pass and the optimizer stay eager, because") == 1
    assert "learning-rate scheduler" in out
    # what compiling costs is said before it starts, with the folder that keeps the compiled code
    assert "compiles it before round 1 moves on" in out
    assert f"kept in {os.environ.get('TORCHINDUCTOR_CACHE_DIR', tempfile.gettempdir())}" in out
    torch.testing.assert_close(compiled.global_state, eager.global_state, rtol=0, atol=FP64_ATOL)


class AddressedLoss(FedAvg):
    """FedAvg whose loss asks for the memory address of a tensor, which a gradient transform's tensors lack."""

    def __init__(self):
        super().__init__()
        self.addresses = set()

    def training_loss(self, module, batch, outputs):
        self.addresses.add(outputs["loss"].data_ptr())
        return outputs["loss"]

    def loss_is_traceable(self):
        return True  # it reads the parameters through the module only


class UncompilableLossSaysWhyOnItsSecondLine(FedAvg):
    """A loss that refuses to be compiled with an error whose message starts with an empty line."""

    def training_loss(self, module, batch, outputs):
        if torch._C._functorch.is_functorch_wrapped_tensor(outputs["loss"]):  # inside the gradient transform
            raise RuntimeError("\n  no storage under the gradient transform")
        return outputs["loss"]

    def loss_is_traceable(self):
        return True  # it reads the parameters through the module only


class HeldParameters(FedAvg):
    """A rule whose loss uses the parameter objects it kept when the fit started, which the whole step refuses."""

    def on_client_fit_start(self, context, module, plan):
        self.held = list(module.parameters())

    def training_loss(self, module, batch, outputs):
        return outputs["loss"] + 0.1 * sum(p.square().sum() for p in self.held)


def test_a_loss_the_compiler_cannot_trace_trains_with_the_forward_pass_compiled_from_the_same_batch(capsys):
    eager = run("mlp", AddressedLoss(), "64-true", False)
    compiled = run("mlp", AddressedLoss(), "64-true", True)
    assert "compiling it failed" in capsys.readouterr().out
    assert compiled.run.pieces.training._whole.steps_run == 0
    # equal to the eager run: no batch was lost to the failed attempt, none was trained twice
    torch.testing.assert_close(compiled.global_state, eager.global_state, rtol=0, atol=FP64_ATOL)


def test_a_rule_that_keeps_parameter_objects_keeps_the_eager_backward_pass(capsys):
    eager = run("mlp", HeldParameters(), "64-true", False)
    compiled = run("mlp", HeldParameters(), "64-true", True)
    assert compiled.run.pieces.training._whole is None
    assert "HeldParameters's training_loss may use parameters it kept" in capsys.readouterr().out
    torch.testing.assert_close(compiled.global_state, eager.global_state, rtol=0, atol=FP64_ATOL)


def test_the_console_gives_the_reason_compiling_failed_from_its_first_non_empty_line(capsys):
    run("mlp", UncompilableLossSaysWhyOnItsSecondLine(), "64-true", True)
    assert "compiling it failed (RuntimeError: no storage under the gradient transform)" in capsys.readouterr().out
