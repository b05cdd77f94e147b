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


def test_table3_runs_every_row_at_every_delta_for_every_seed():
    from mnist_subset import TABLE3_METHODS, table3_runs

    runs = table3_runs(seeds=[0, 1, 2], deltas=[0, 50, 80], rounds=3, local_epochs=2)
    assert len(runs) == 10 * 3 * 3 and len(TABLE3_METHODS) == 10
    assert len({run.name for run in runs}) == len(runs)
    for run in runs[:10]:  # every row has a config for every δ
        for delta in (0, 50, 80):
            run.delta = delta
            assert any(arg.endswith(f"mnist/{run.method}_delta{delta}.yaml") and Path(arg).exists()
                       for arg in command(run, Path("/nonexistent")))  # fmt: skip


def test_the_paper_table3_avg_and_std_are_its_per_delta_values_with_ddof_1():
    from mnist_subset import PAPER_TABLE3

    ddof0_matches = 0
    for method, (*cells, mean, std) in PAPER_TABLE3.items():
        assert abs(np.mean(cells) - mean) <= 0.05 + 1e-9, method
        assert abs(np.std(cells, ddof=1) - std) <= 0.05 + 1e-9, method
        ddof0_matches += abs(np.std(cells, ddof=0) - std) <= 0.05 + 1e-9
    assert ddof0_matches < len(PAPER_TABLE3)  # the check tells ddof = 1 from ddof = 0


def test_table3_pairs_cells_and_gives_verdicts_and_the_cells_a_paper_sized_difference_needs(tmp_path):
    from mnist_subset import TABLE3_METHODS, TABLE3_ORDERINGS, table3, table3_runs

    runs = table3_runs(seeds=[0, 1], deltas=[0, 80], rounds=2, local_epochs=2)
    cells = [(0, 0), (0, 80), (1, 0), (1, 80)]  # (seed, δ)
    fedavg = np.array([50.0, 42.0, 48.0, 41.0])
    final = {method: fedavg + np.array([1.0, -1.0, 2.0, -2.0]) for method in TABLE3_METHODS}  # mean 0: unresolved
    final["fedavg"] = fedavg
    final["fedproto"] = fedavg + np.array([5.4, 4.6, 5.2, 4.8])  # the paper's sign, far beyond 2 se
    final["fairness"] = fedavg - 3.0  # 3 points below in every cell, where the paper has it above
    final["fedproto_apm_only"] = final["fedproto"] + np.array([2.0, -2.0, -1.0, 1.5])
    for run in runs:
        _write(tmp_path, run, [0.1, final[run.method][cells.index((run.seed, run.delta))] / 100])
    lines = table3(runs, tmp_path, "test").splitlines()

    def row(start: str) -> str:
        return next(line for line in lines if line.startswith(f"| {start} |"))

    per_delta = f"{np.mean(fedavg[[0, 2]]):.1f} | {np.mean(fedavg[[1, 3]]):.1f}"
    ours = f"{np.mean(fedavg):.1f} ± {np.std(fedavg, ddof=1):.1f}"
    assert row("FedAvg") == f"| FedAvg | 4 | {per_delta} | {ours} | 92.7 / 88.7 / 85.1 | 88.8 ± 3.8 |"

    differences = final["fedproto"] - fedavg
    paper = np.mean([93.5 - 92.7, 93.1 - 85.1])  # the paper's per-δ differences, at the δ that ran
    needed = int(np.ceil((2 * np.std(differences, ddof=1) / paper) ** 2))  # n ≈ (2·sd/Δ)²
    assert row("FedProto − FedAvg") == (
        f"| FedProto − FedAvg | {paper:+.1f} | {np.mean(differences):+.2f} ± {stats.sem(differences):.2f} (se; sd "
        f"{np.std(differences, ddof=1):.2f}, n = 4, resolved) | resolved, the paper's sign | {max(2, needed)} (1) |"
    )
    assert "| resolved, against the paper's sign |" in row("Fairness − FedAvg")
    assert "| not resolved |" in row("FedProto − FedProto (APM only)")  # −0.12 ± 0.98
    assert "| not resolved |" in row("FedAvg + toleration − FedAvg")
    assert len([line for line in lines if line.startswith("| ") and " − " in line]) == 15
    agree, against, unresolved = (line.split(": ")[1].split(", ") for line in lines[-3:])
    assert {"FedProto − FedAvg", "FedProto − FedProto (no toleration)", "Fairness + toleration − Fairness"} <= set(
        agree
    )
    assert {"Fairness − FedAvg", "Fairness − Fairness sampling i.i.d."} <= set(against)
    assert {"FedProto − FedProto (APM only)", "FedAvg + toleration − FedAvg"} <= set(unresolved)
    assert sorted(agree + against + unresolved) == sorted(
        f"{TABLE3_METHODS[a]} − {TABLE3_METHODS[b]}" for a, b in TABLE3_ORDERINGS
    )
