"""benchmarks/rows/cost.py: the work it counts for a row (client sizes, steps per round, evaluations, one-off work)
against the data module and hand computations, and a reduced run of one cheap row end to end."""

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks" / "rows"))
import cost  # noqa: E402
import workload  # noqa: E402


@pytest.fixture(scope="module")
def parser():
    from fedlight.cli import build_parser

    return build_parser()


def test_synthetic_clients_and_batches_are_the_data_modules(parser):
    row = cost.read_row(parser, REPO / "conf/fedproto/synthetic/fedavg_delta0.yaml", seeds=1)
    data = parser.instantiate(parser.parse_args(["fit", "--config", str(row.path)]))["fit"].data
    data.setup()  # Synthetic(1, 1) is generated: no files
    assert np.array_equal(row.federation.train, data.num_samples)
    assert row.federation.test == len(data.held_out_index)  # no test set: the held-out splits are scored
    batches = [workload.batches_per_epoch(int(n), 10, drop_last=False) for n in row.federation.train]
    assert batches == [data.num_batches(k) for k in range(data.num_clients)]


def test_round_work_by_hand():
    plan = workload.RoundPlan(4, 3, None, 0.5, True, False, 10, drop_last=True)
    # 4 clients of 25 samples, all sampled: 2 batches of 10 per epoch (the last 5 dropped); 2 stragglers run
    # F' ∈ {1, 2} epochs, 1.5 on average, the others F = 3
    work = workload.round_work(np.full(4, 25), plan, draws=4000)
    assert work.steps == pytest.approx(2 * 3 * 2 + 2 * 1.5 * 2, rel=0.02)
    assert work.clients == 4 and work.samples == 100
    dropped = workload.round_work(np.full(4, 25), replace(plan, tolerate_stragglers=False))
    assert (dropped.steps, dropped.clients) == (2 * 3 * 2, 2)
    steps = workload.round_work(np.array([5, 500, 50, 7]), replace(plan, local_steps=10, straggler_fraction=0))
    assert steps.steps == 40  # local steps: every client trains exactly I batches, whatever its size


def test_a_fedsls_run_is_rounds_of_steps_evaluations_and_its_static_weights(parser):
    row = cost.read_row(parser, REPO / "conf/fedsls/cifar10/fedsls_alpha0.5.yaml", seeds=5)
    assert row.federation.train.sum() == 50_000 and len(row.federation.train) == 100
    measured = cost.Measured(step=2.0, batchnorm=True, eval_sample=1e-3, eval_images=1024, saliency_image=1e-2)
    run = cost.row_cost(row, measured)
    # 10 clients × I = 10 steps in each of 2,000 rounds; the 10,000 test images after every round; before the
    # first round one epoch of full batches on every client and one guided pass over its 50,000 images
    warmup = sum(n // 64 if n >= 64 else 1 for n in row.federation.train)
    expected = 2000 * 100 * 2.0 + 2000 * 10_000 * 1e-3 + warmup * 2.0 + 50_000 * 1e-2
    assert run.steps == 100 and run.run == pytest.approx(expected)
    assert run.total == pytest.approx(5 * expected)  # five seeds


def test_a_reduced_run_of_one_row_prints_its_family_and_its_table(parser):
    table = cost.Table("one row", (str(REPO / "conf/fedproto/synthetic/fedprox_delta50.yaml"),))
    text = cost.run(parser, [table], reduced=True)
    assert "REDUCED RUN" in text
    family = next(line for line in text.splitlines() if line.startswith("| one row | mlp"))
    assert "+ proximal term | 1 | 1 | 200 | 10 × " in family  # FedProx keeps its 5 stragglers: 10 clients train
    summary = next(line for line in text.splitlines() if line.startswith("| one row | 1 | 1 |"))
    assert "about" in summary and summary.endswith("| not measured (no GPU) |")
