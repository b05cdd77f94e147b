"""Bad user input is a ConfigError naming the flag or file, also under ``python -O``, which strips asserts."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fedlight.data.base import LabelledTensors
from fedlight.data.datasets.npz import NpzDataset
from fedlight.errors import ConfigError
from fedlight.strategies.functional import server_momentum

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
    done = subprocess.run([sys.executable, "-O", "-c", script], env=env, capture_output=True, text=True, timeout=120)
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
