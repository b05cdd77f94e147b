"""benchmarks/fedproto/mnist_subset.py: the table reads each run's last round and pairs the rules cell by cell."""

import sys
from pathlib import Path

import numpy as np
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "fedproto"))
from mnist_subset import Run, command, table


def _write(root: Path, run: Run, accuracies: list[float]) -> None:
    folder = root / run.name / "version_0"
    folder.mkdir(parents=True)
    rows = ["round,test/acc", *(f"{i + 1},{a}" for i, a in enumerate(accuracies))]
    (folder / "metrics.csv").write_text("\n".join(rows) + "\n")


def test_the_table_pairs_final_accuracies_over_seed_and_delta_cells(tmp_path):
    final = {  # final test accuracy per (method, seed, δ)
        ("fedavg", 0, 0): 0.50, ("fedavg", 1, 0): 0.60, ("fedavg", 0, 80): 0.40, ("fedavg", 1, 80): 0.45,
        ("fedproto", 0, 0): 0.58, ("fedproto", 1, 0): 0.66, ("fedproto", 0, 80): 0.49, ("fedproto", 1, 80): 0.55,
        ("fedprox", 0, 0): 0.5, ("fedprox", 1, 0): 0.5, ("fedprox", 0, 80): 0.5, ("fedprox", 1, 80): 0.5,
        ("fedatt", 0, 0): 0.5, ("fedatt", 1, 0): 0.5, ("fedatt", 0, 80): 0.5, ("fedatt", 1, 80): 0.5,
    }  # fmt: skip
    runs = [Run(method, seed, delta, rounds=2, local_epochs=2) for method, seed, delta in final]
    for run in runs:
        _write(tmp_path, run, [0.1, final[(run.method, run.seed, run.delta)]])  # only the last round counts
    text = table(runs, tmp_path, "test")
    differences = [100 * (final[("fedproto", s, d)] - final[("fedavg", s, d)]) for s in (0, 1) for d in (0, 80)]
    mean, se = np.mean(differences), stats.sem(differences)
    row = next(line for line in text.splitlines() if line.startswith("| FedProto − FedAvg |"))
    assert f"{mean:+.2f} ± {se:.2f}" in row and "n = 4" in row
    assert row.endswith("| yes |")  # +8.25 ± 0.75, above 2 se, the paper's sign (+4.5)
    fedavg = next(line for line in text.splitlines() if line.startswith("| FedAvg |"))
    assert f"{np.mean([50, 60, 40, 45]):.1f} ± {np.std([50, 60, 40, 45], ddof=1):.1f}" in fedavg


def test_an_unfinished_run_is_left_out_and_a_run_resumes_its_checkpoint(tmp_path):
    run = Run("fedavg", 0, 50, rounds=3, local_epochs=2)
    _write(tmp_path, run, [0.1, 0.2])  # two of three rounds
    text = table([run], tmp_path, "test")
    assert "| FedAvg | 0 |" in text
    checkpoint = tmp_path / run.name / "version_0" / "checkpoints" / "last.ckpt"
    checkpoint.parent.mkdir()
    checkpoint.write_bytes(b"")
    args = command(run, tmp_path)
    assert f"--ckpt_path={checkpoint}" in args and "--trainer.local_epochs=2" in args
    assert any(arg.endswith("conf/fedproto/mnist/fedavg_delta50.yaml") for arg in args)
