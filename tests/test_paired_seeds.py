"""benchmarks/paired.py: the summary of per-seed differences and the seeds a difference needs."""

import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from paired import paired, seeds_needed


def test_paired_summary_against_numpy():
    d = [0.4, -1.2, 2.5, 0.9, -0.3]
    p = paired(d)
    assert p.mean == pytest.approx(np.mean(d)) and p.sd == pytest.approx(np.std(d, ddof=1))
    assert p.se == pytest.approx(stats.sem(d)) and p.n == 5
    assert not p.resolved and paired([1.0, 1.1, 0.9, 1.0]).resolved


@pytest.mark.parametrize(("delta", "sd", "alpha", "power"), [(1.0, 2.0, 0.05, 0.8), (0.5, 0.7, 0.05, 0.9)])
def test_seeds_needed_reach_the_power_they_promise(delta, sd, alpha, power):
    n = seeds_needed(delta, sd, alpha, power)
    z = stats.norm.ppf
    assert n == int(np.ceil(((z(1 - alpha / 2) + z(power)) * sd / delta) ** 2))
    # simulated: n paired differences ~ N(δ, sd²), a two-sided z-test at level α rejects with probability ≥ power
    rng = np.random.default_rng(0)
    means = rng.normal(delta, sd, size=(20_000, n)).mean(axis=1)
    rejected = np.abs(means) / (sd / np.sqrt(n)) > z(1 - alpha / 2)
    assert power - 0.015 < rejected.mean() < power + 0.05
    fewer = rng.normal(delta, sd, size=(20_000, n - 2)).mean(axis=1)
    assert (np.abs(fewer) / (sd / np.sqrt(n - 2)) > z(1 - alpha / 2)).mean() < rejected.mean()
