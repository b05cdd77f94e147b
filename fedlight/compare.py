"""``fedlight compare RUN_A RUN_B``: is B better than A on the same test images? FUSS's paired tests (Sec. 5.4).

Both runs must have written per-image scores (:class:`~fedlight.callbacks.per_image_scores.PerImageScores`,
``<run_dir>/per_image.csv``). The scores are paired by image id, which includes a digest of the image's
pixels, so the runs must have scored the very same images; otherwise the comparison is refused. For the
chosen metric the command prints n, both means, the mean difference B − A, and the two-sided p-values of
the paired t-test (``scipy.stats.ttest_rel``) and of the Wilcoxon signed-rank test (``scipy.stats.wilcoxon``).
Images whose score is undefined in either run (NaN: no valid pixel) are left out of both. When every score is 0
or 1 (a classifier's per-image accuracy), McNemar's exact test is added: the two-sided binomial test of the images
only A got right against those only B got right (``scipy.stats.binomtest``), the test for paired binary outcomes.

    fedlight compare runs/fedlight/version_0 runs/fedlight/version_1
    fedlight compare a/per_image.csv b/per_image.csv --metric acc
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from fedlight.callbacks.per_image_scores import PER_IMAGE_FILE, read_per_image
from fedlight.errors import ConfigError

METRICS = ("miou", "acc")


def _scores_file(run: str | Path) -> Path:
    path = Path(run)
    path = path / PER_IMAGE_FILE if path.is_dir() else path
    if not path.is_file():
        raise ConfigError(
            f"No per-image scores at {path}. Pass a run folder holding {PER_IMAGE_FILE} (or the file itself); "
            "runs write it with --trainer.callbacks+=fedlight.callbacks.per_image_scores.PerImageScores."
        )
    return path


def paired_test(run_a: str | Path, run_b: str | Path, metric: str = "miou") -> dict:
    """n, means, mean difference B − A, and the t-test's and Wilcoxon's statistics and p-values."""
    if metric not in METRICS:
        raise ConfigError(f"Expected --metric one of {', '.join(METRICS)}, got {metric!r}.")
    files = [_scores_file(run) for run in (run_a, run_b)]
    a, b = (read_per_image(path) for path in files)
    if a["image"] != b["image"]:
        only_a = sorted(set(a["image"]) - set(b["image"]))
        only_b = sorted(set(b["image"]) - set(a["image"]))
        raise ConfigError(
            f"{files[0]} and {files[1]} do not score the same images ({len(a['image'])} and {len(b['image'])} "
            f"rows; only in A: {only_a[:3]}, only in B: {only_b[:3]}). A paired test needs both runs evaluated "
            "on one test set in one order: compare runs of the same --data."
        )
    x, y = a[metric], b[metric]
    keep = ~(np.isnan(x) | np.isnan(y))
    x, y = x[keep], y[keep]
    if metric == "miou" and not keep.any() and not np.isnan(a["acc"]).all():
        raise ConfigError(
            f"{files[0]} and {files[1]} hold no per-image mIoU: they are a classifier's scores. Pass --metric acc."
        )
    if len(x) < 2:
        raise ConfigError(f"{files[0]} and {files[1]} share {len(x)} images with a defined {metric}; need ≥ 2.")
    from scipy import stats  # seconds to import; only this command needs it

    t = stats.ttest_rel(y, x)
    differences = y - x
    if np.any(differences != 0):
        w = stats.wilcoxon(y, x)
        w_statistic, w_p = float(w.statistic), float(w.pvalue)
    else:  # identical scores: no signed rank to test
        w_statistic, w_p = float("nan"), 1.0
    binary = bool(np.isin(x, (0.0, 1.0)).all() and np.isin(y, (0.0, 1.0)).all())
    only_a, only_b = int(((x == 1) & (y == 0)).sum()), int(((x == 0) & (y == 1)).sum())
    mcnemar = stats.binomtest(only_b, only_a + only_b, 0.5).pvalue if binary and only_a + only_b else 1.0
    return {
        "metric": metric,
        "n": len(x),
        "binary": binary,
        "only_a": only_a,
        "only_b": only_b,
        "mcnemar_pvalue": float(mcnemar),
        "mean_a": float(x.mean()),
        "mean_b": float(y.mean()),
        "mean_difference": float(differences.mean()),
        "t_statistic": float(t.statistic),
        "t_pvalue": float(t.pvalue) if np.isfinite(t.pvalue) else 1.0,
        "wilcoxon_statistic": w_statistic,
        "wilcoxon_pvalue": w_p,
    }


def format_result(result: dict, run_a: str, run_b: str) -> str:
    m = result["metric"]
    mcnemar = [
        f"McNemar's exact test: {result['only_a']} images right only in A, {result['only_b']} only in B, "
        f"p = {result['mcnemar_pvalue']:.4g}"
    ]
    return "\n".join(
        [
            f"A: {run_a}",
            f"B: {run_b}",
            f"per-image {m} over n = {result['n']} images: A {100 * result['mean_a']:.2f} %, "
            f"B {100 * result['mean_b']:.2f} %",
            f"mean difference B − A: {100 * result['mean_difference']:+.2f} points",
            f"paired t-test: t = {result['t_statistic']:.3f}, p = {result['t_pvalue']:.4g}",
            f"Wilcoxon signed-rank: W = {result['wilcoxon_statistic']:.1f}, p = {result['wilcoxon_pvalue']:.4g}",
            *(mcnemar if result["binary"] else []),
        ]
    )


#: what ``fedlight compare`` does, in the words of ``fedlight --help`` and ``fedlight compare --help``
DESCRIPTION = (
    "Is run B better than run A on the same test images? The paired t-test and Wilcoxon signed-rank test of their "
    "per-image scores (FUSS, Sec. 5.4), which runs write with the callback fedlight.callbacks.PerImageScores."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's arguments, on its own parser and on the ``fedlight`` parser's ``compare`` subcommand."""
    parser.add_argument("run_a", help="run folder (or its per_image.csv) of the baseline A")
    parser.add_argument("run_b", help="run folder (or its per_image.csv) of the contender B")
    parser.add_argument("--metric", default="miou", choices=METRICS, help="the per-image score compared")


def main(args: list[str]) -> None:
    """``fedlight compare RUN_A RUN_B [--metric miou|acc]``."""
    parser = argparse.ArgumentParser(prog="fedlight compare", description=DESCRIPTION)
    add_arguments(parser)
    options = parser.parse_args(args)
    result = paired_test(options.run_a, options.run_b, options.metric)
    print(format_result(result, options.run_a, options.run_b))
