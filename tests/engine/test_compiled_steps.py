"""Compiled client steps (``--trainer.compile_steps``) train the clients the eager steps train.

A compiled graph may fuse and reorder sums, so whole runs are compared in fp64, where rounding cannot hide a
wrong step, and in fp32 within a tolerance that a wrong step (a missed proximal term, a stale weight) exceeds
by orders of magnitude.
"""

import pytest
import torch

from fedlight.clients import ClassificationClient
from fedlight.data import FederatedDataModule
from fedlight.engine.trainer import FederatedTrainer
from fedlight.strategies import FedAvg, FedProx
from fedlight.testing import ClientImages

FP64_ATOL = 1e-9
FP32_ATOL = 1e-6  # measured 1.5e-8 after 2 rounds of the MLP


def images():
    """Six clients of 17 to 44 one-channel 8×8 images of 3 classes; batches of 10 leave short last batches."""
    sizes = [23, 31, 40, 17, 28, 44]
    return FederatedDataModule(ClientImages(sizes, list(range(6))), batch_size=10, test_fraction=0.0)


def run(model, strategy, precision, compile_steps):
    torch.manual_seed(0)
    client = ClassificationClient(
        num_classes=3, input_shape=(1, 8, 8), model=model, optimizer=lambda p: torch.optim.SGD(p, lr=0.05)
    )
    trainer = FederatedTrainer(
        rounds=2, clients_per_round=4, local_epochs=2, logger=None, enable_progress_bar=False,
        precision=precision, compile_steps=compile_steps,
    )  # fmt: skip
    trainer.fit(client, images(), strategy)
    return trainer


@pytest.mark.parametrize(
    ("model", "strategy"),
    [("mlp", FedAvg), ("cnn", lambda: FedProx(mu=0.5))],
    ids=["mlp-fedavg", "cnn-fedprox"],
)
def test_compiled_steps_train_as_the_eager_steps(model, strategy):
    eager = run(model, strategy(), "64-true", False)
    compiled = run(model, strategy(), "64-true", True)
    assert compiled.training._compiled is not None and eager.training._compiled is None
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


def test_an_unknown_compile_mode_is_refused_naming_the_flag(capsys):
    from fedlight.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", "conf/digits/fedavg.yaml", "--trainer.compile_steps=fastest", "--print_config"])
    assert exit_info.value.code != 0
    assert "compile_steps" in capsys.readouterr().err
