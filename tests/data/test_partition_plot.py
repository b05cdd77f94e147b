"""Fig. 4's per-client class counts and their scatter plot."""

import matplotlib

matplotlib.use("Agg")

import numpy as np

from fedlight.data.partition import Dirichlet
from fedlight.data.partition.plot import class_counts, plot_class_counts


def test_counts_cover_the_partition_and_dots_follow_them():
    targets = np.random.default_rng(0).integers(0, 10, 2000)
    parts = Dirichlet(num_clients=20, alpha=0.1, min_size=10)(targets, 10, np.random.default_rng(1))
    counts = class_counts(parts, targets, 10)
    assert counts.shape == (20, 10) and counts.sum() == 2000
    assert counts[3].tolist() == np.bincount(targets[parts[3]], minlength=10).tolist()
    figure = plot_class_counts(counts, title="Dir(0.1)")
    dots = figure.axes[0].collections[0]
    clients, classes = np.nonzero(counts)
    np.testing.assert_array_equal(dots.get_offsets(), np.stack([clients, classes], axis=1))
    areas = dots.get_sizes()
    assert areas.max() == 60.0 and np.allclose(areas / areas.max(), counts[clients, classes] / counts.max())
    assert figure.axes[0].get_title() == "Dir(0.1)"
