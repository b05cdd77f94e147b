"""A paper row on a machine without network: one message naming the weights and the data, before any run folder.

The network is cut where the row would reach it: the Hugging Face Hub's endpoint and CIFAR-10's mirror both point
at a closed port on this machine, so the test behaves the same with or without network.
"""

from pathlib import Path

import pytest
from torchvision.datasets import CIFAR10 as TorchvisionCIFAR10

from fedlight.cli import main

REPO = Path(__file__).resolve().parents[2]
CLOSED = "http://127.0.0.1:9"  # the discard port: nothing listens there


def test_fedsls_row_offline_names_weights_and_data_before_a_run_folder(tmp_path, monkeypatch, capsys):
    from huggingface_hub import constants

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", CLOSED)
    monkeypatch.setattr(TorchvisionCIFAR10, "url", f"{CLOSED}/cifar-10-python.tar.gz")
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--config", str(REPO / "conf/fedsls/cifar10/fedsls_alpha0.5.yaml")])
    assert stop.value.code == 2
    error = capsys.readouterr().err
    assert error.count("fedlight: error:") == 1, error
    assert "resnet18.tv_in1k" in error and "cannot be reached" in error and "HF_HUB_OFFLINE=1" in error
    assert "CIFAR10" in error and "data/cifar10" in error
    assert not (tmp_path / "runs").exists(), "a run folder was created before the run could start"
