"""Paired differences over seeds, and the seeds a difference needs: what a twin's comparison can support.

A twin compares two rows seed by seed (same data, same pre-training, same client draws), so the quantity to
read is the per-seed difference d_s = B_s − A_s: its mean, its sample standard deviation sd and the standard
error sd/√n. A difference is resolved when its mean lies outside mean ± 2 standard errors of 0 (a two-sided
test at about 5 %); otherwise it is "not resolved", whatever its sign.

How many seeds would resolve a difference of a given size δ (a paper's) at the spread the twin shows? For a
two-sided test at level α with power 1 − β, the normal approximation gives

    n = ((z_{1−α/2} + z_{1−β}) · sd / δ)²,

rounded up (z from the standard normal; α = 0.05 and power 0.8 by default, so z-sum = 2.80). It uses sd as
if known; with few seeds the t distribution asks for a few more.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist


@dataclass(frozen=True)
class Paired:
    """Summary of per-seed differences: mean, sample standard deviation, standard error, number of seeds."""

    mean: float
    sd: float
    se: float
    n: int

    @property
    def resolved(self) -> bool:
        """Whether the mean differs from 0 by more than two standard errors."""
        return self.n > 1 and abs(self.mean) > 2 * self.se

    def __str__(self) -> str:
        verdict = "resolved" if self.resolved else "not resolved"
        return f"{self.mean:+.2f} ± {self.se:.2f} (se; sd {self.sd:.2f}, n = {self.n}, {verdict})"


def paired(differences: Sequence[float]) -> Paired:
    """The mean, sample sd and standard error of per-seed differences.

    >>> p = paired([1.0, 2.0, 3.0])
    >>> (p.mean, p.sd, round(p.se, 4), p.n)
    (2.0, 1.0, 0.5774, 3)
    """
    n = len(differences)
    assert n >= 1, "no difference to summarise"
    mean = sum(differences) / n
    sd = math.sqrt(sum((d - mean) ** 2 for d in differences) / (n - 1)) if n > 1 else math.nan
    return Paired(mean, sd, sd / math.sqrt(n) if n > 1 else math.nan, n)


def seeds_needed(delta: float, sd: float, alpha: float = 0.05, power: float = 0.8) -> int:
    """Seeds for a two-sided paired test at level ``alpha`` to detect a true difference ``delta`` with ``power``,
    when the per-seed differences spread by ``sd``: ⌈((z_{1−α/2} + z_{power}) · sd / δ)²⌉.

    >>> seeds_needed(delta=1.0, sd=1.0)  # (1.960 + 0.842)² = 7.85
    8
    >>> seeds_needed(delta=1.26, sd=2.39)
    29
    """
    assert delta != 0 and sd >= 0, f"need a non-zero difference and a spread, got δ = {delta}, sd = {sd}"
    z = NormalDist().inv_cdf
    return max(2, math.ceil(((z(1 - alpha / 2) + z(power)) * sd / abs(delta)) ** 2))
