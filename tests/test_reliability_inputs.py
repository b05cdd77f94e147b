"""Bad user input is a ConfigError naming the flag or file, also under ``python -O``, which strips asserts."""

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from processes import run_within

from fedlight.data.base import LabelledTensors
from fedlight.data.datasets.npz import NpzDataset
from fedlight.errors import ConfigError
from fedlight.strategies.functional import server_momentum

# trainers built without a default_root_dir write into the test's own runs/
pytestmark = pytest.mark.usefixtures("runs_in_tmp")

REPO = Path(__file__).resolve().parents[1]


def test_an_npz_with_arrays_of_different_lengths_is_refused_under_python_O(tmp_path):
    path = tmp_path / "bad.npz"
    np.savez(path, inputs=np.zeros((5, 3), np.float32), targets=np.zeros(4, np.int64))
    script = (
        "from fedlight.data.datasets.npz import NpzDataset\n"
        "from fedlight.errors import ConfigError\n"
        "import sys\n"
        "try:\n"
        f"    NpzDataset({str(path)!r})\n"
        "except ConfigError as err:\n"
        "    print(err); sys.exit(3)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = run_within([sys.executable, "-O", "-c", script], cpu_budget=240, env=env, capture_output=True, text=True)
    assert done.returncode == 3, done.stderr[-2000:]
    assert f"--data.dataset.init_args.path={path} holds 5 inputs, 4 targets" in done.stdout


def test_an_npz_with_too_few_group_ids_is_refused(tmp_path):
    path = tmp_path / "groups.npz"
    np.savez(path, inputs=np.zeros((4, 3)), targets=np.zeros(4, np.int64), groups=np.zeros(3, np.int64))
    with pytest.raises(ConfigError, match="holds 4 inputs, 4 targets, 3 groups"):
        NpzDataset(str(path))


def test_labelled_tensors_of_different_lengths_name_both_counts():
    with pytest.raises(ConfigError, match="3 inputs but 2 targets"):
        LabelledTensors(torch.zeros(3, 1), torch.zeros(2))
    with pytest.raises(ConfigError, match="1 group ids for 2 samples"):
        LabelledTensors(torch.zeros(2, 1), torch.zeros(2), groups=np.zeros(1))


def test_an_unknown_server_momentum_form_names_the_flag():
    with pytest.raises(ConfigError, match=r"--strategy\.init_args\.form"):
        server_momentum(torch.zeros(1), torch.zeros(1), torch.zeros(1), beta=0.5, form="nesterov")


@pytest.mark.parametrize("content", [b"inputs,targets\n1,2\n", b"", b"PK\x03\x04 truncated"])
def test_a_file_that_is_not_an_npz_archive_is_named(tmp_path, content):
    path = tmp_path / "data.npz"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=rf"--data.dataset.init_args.path={path} is not a readable \.npz archive"):
        NpzDataset(str(path))
    np.save(tmp_path / "one.npy", np.zeros(3))
    (tmp_path / "one.npy").rename(path)
    with pytest.raises(ConfigError, match=r"holds a single array, not an \.npz archive"):
        NpzDataset(str(path))


def test_garbage_mnist_files_are_named_instead_of_a_bare_assertion(tmp_path):
    from fedlight.data import MNIST

    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte"):
        (raw / name).write_bytes(bytes(range(256)) * 16)
    (raw / "t10k-labels-idx1-ubyte").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"/train-images-idx3-ubyte does not start with the header of a 3-dim"):
        MNIST(str(tmp_path)).load_train()


@pytest.mark.parametrize(
    ("accelerator", "message", "present"),
    [
        ("gpuu", "Expected --trainer.accelerator to be one of auto, cpu, cuda, gpu, mps, tpu, got 'gpuu'.", False),
        ("cuda", "--trainer.accelerator=cuda, but this machine has no usable CUDA GPU", torch.cuda.is_available()),
        ("tpu", "--trainer.accelerator=tpu, but no TPU is reachable here", False),
    ],
)
def test_an_accelerator_that_is_not_there_is_one_message(accelerator, message, present):
    from fedlight.engine.trainer import FederatedTrainer

    if present:  # a machine that has it builds the trainer; the message is checked where it is missing
        FederatedTrainer(accelerator=accelerator, logger=None)
        return
    with pytest.raises(ConfigError) as err:
        FederatedTrainer(accelerator=accelerator, logger=None)
    assert message in str(err.value) and "auto" in str(err.value)


def test_a_learning_rate_of_zero_is_refused_at_set_up(tmp_path):
    from functools import partial

    from fedlight.clients import ClassificationClient
    from fedlight.data import FederatedDataModule
    from fedlight.engine.trainer import FederatedTrainer
    from fedlight.strategies import FedAvg
    from fedlight.testing import ClientImages

    model = ClassificationClient(3, (1, 8, 8), model="mlp", optimizer=partial(torch.optim.SGD, lr=0.0))
    trainer = FederatedTrainer(rounds=1, clients_per_round=2, logger="csv", default_root_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"--model.init_args.optimizer has lr=0 \(SGD\): no local step"):
        trainer.fit(model, FederatedDataModule(ClientImages([10, 10], [0, 1])), FedAvg())
    assert not list(tmp_path.rglob("version_*"))


@pytest.mark.parametrize("subcommand", ["validate", "test"])
def test_scoring_without_a_checkpoint_or_weights_is_refused(tmp_path, subcommand):
    from fedlight.cli import run

    config = REPO / "conf" / "fedproto" / "synthetic" / "fedavg_delta0.yaml"
    with pytest.raises(ConfigError, match=rf"fedlight {subcommand} scores a trained model, but neither --ckpt_path"):
        run([subcommand, "--config", str(config), f"--trainer.default_root_dir={tmp_path}"])


def test_a_set_up_error_is_reported_by_the_first_process_only(monkeypatch, capsys):
    from fedlight import cli

    def fails(args):
        err = ConfigError("--data.x is wrong.")
        err.every_process = True
        raise err

    monkeypatch.setattr(cli, "run", fails)
    for rank, expected in (("0", "fedlight: error: --data.x is wrong.\n"), ("1", "")):
        monkeypatch.setenv("LOCAL_RANK", rank)
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["fit"])
        assert exit_info.value.code == 2 and capsys.readouterr().err == expected


def test_a_process_without_a_signal_names_the_one_another_process_received():
    from fedlight.engine.stopping import StopRequest

    got, other = StopRequest(announce=False), StopRequest(announce=False)
    got.requested = "SIGINT"
    summed = [a + b for a, b in zip(got.flags(), other.flags(), strict=True)]  # what the all-reduce adds
    assert other.adopt(*summed) and other.requested == "SIGINT"
    assert not StopRequest(announce=False).adopt(0.0, 0.0)


def test_adaptive_clipping_with_too_little_count_noise_is_refused_before_the_run_folder(tmp_path):
    from fedlight.clients import ClassificationClient
    from fedlight.data import FederatedDataModule
    from fedlight.engine.trainer import FederatedTrainer
    from fedlight.strategies import DPFedAvg
    from fedlight.testing import ClientImages

    trainer = FederatedTrainer(rounds=1, clients_per_round=4, logger="csv", default_root_dir=tmp_path)
    strategy = DPFedAvg(adaptive=True, noise_multiplier=1.0)  # σ_b = K'/20 = 0.2 ≤ z/2 = 0.5
    with pytest.raises(ConfigError, match=r"count noise σ_b = 0\.2 .* must exceed noise_multiplier / 2 = 0\.5"):
        trainer.fit(
            ClassificationClient(3, (1, 8, 8), model="mlp"),
            FederatedDataModule(ClientImages([10] * 4, [0] * 4)),
            strategy,
        )
    assert not list(tmp_path.rglob("version_*"))


def test_a_network_that_does_not_fit_the_data_is_refused_at_set_up(tmp_path, capsys):
    from fedlight.cli import main

    config = REPO / "conf" / "digits" / "fedavg.yaml"  # 1×8×8 grey digits; torchvision's ResNet wants 3 channels
    flags = [f"--trainer.default_root_dir={tmp_path}", "--model.init_args.model=torchvision.models.resnet18"]
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config), *flags])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "--model's network (ResNet) cannot take --data's training inputs" in err
    assert "shape (1, 8, 8)" in err and "expected input[2, 1, 8, 8] to have 3 channels" in err
    assert not list(tmp_path.iterdir()), "refused before the run folder exists"
