"""FedSLS and MOON with two processes (CPU, gloo) must give the same run as with one.

FedSLS splits the static R_k over the ranks and sums them; MOON's previous local models are trained on
whichever rank hosts a client and must reach the rank that hosts it next time.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from processes import communicate_within

from fedlight import checkpoint as ckpt_io

REPO = Path(__file__).resolve().parents[2]
TINY = """config: {row}
trainer.rounds: 2
trainer.clients_per_round: 4
trainer.logger: csv
trainer.enable_progress_bar: false
data.dataset:
  class_path: fedlight.data.Scenes
  init_args:
    mode: classification
    num_object_classes: 4
    num_samples: 240
    num_test_samples: 40
    image_size: 16
data.partitioner.init_args.num_clients: 6
data.batch_size: 16
model.init_args.model_kwargs.channels: [4, 8, 8, 8]
model.init_args.model_kwargs.layers: [1, 1, 1, 1]
model.init_args.model_kwargs.stem_width: 4
model.init_args.model_kwargs.pretrained: false
"""


def start(tmp_path: Path, row: str, devices: int) -> subprocess.Popen:
    config = tmp_path / f"{row}.yaml"
    config.write_text(TINY.format(row=REPO / "conf/fedsls/cifar10" / f"{row}.yaml"))
    command = [
        sys.executable, "-m", "fedlight", "fit", "--config", str(config), f"--trainer.devices={devices}",
        f"--trainer.default_root_dir={tmp_path}", f"--trainer.name={row}_devices{devices}",
    ]  # fmt: skip
    # one thread in both runs: BatchNorm on 16 images amplifies the float differences of other thread counts
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(process: subprocess.Popen, tmp_path: Path, name: str) -> dict:
    output, _ = communicate_within(process, cpu_budget=1200)
    assert process.returncode == 0, output[-3000:]
    return ckpt_io.load(tmp_path / name / "version_0" / "checkpoints" / "last.ckpt")


@pytest.mark.parametrize("row", ["fedsls_alpha0.5", "moon_alpha0.5"])
def test_two_processes_give_the_same_run_as_one(tmp_path, row):
    processes = {devices: start(tmp_path, row, devices) for devices in (1, 2)}
    one, two = (finish(processes[d], tmp_path, f"{row}_devices{d}") for d in (1, 2))
    for name, value in one["global_state"].items():
        torch.testing.assert_close(two["global_state"][name], value, rtol=0, atol=1e-4)
    state_one, state_two = one["strategy"]["state"], two["strategy"]["state"]
    if row.startswith("fedsls"):
        torch.testing.assert_close(state_two["saliency"], state_one["saliency"], rtol=1e-6, atol=0)
        assert bool((state_one["saliency"] > 0).all())  # every client's R_k, whichever rank computed it
    else:
        assert sorted(state_two["previous"]) == sorted(state_one["previous"])
        for client, previous in state_one["previous"].items():
            torch.testing.assert_close(state_two["previous"][client], previous, rtol=0, atol=1e-4)
        # every rank holds every participant's model, not only those it trained
        counts = [row["moon/clients_with_previous_model"] for row in two["history"]]
        assert counts == [row["moon/clients_with_previous_model"] for row in one["history"]] and counts[0] == 4
