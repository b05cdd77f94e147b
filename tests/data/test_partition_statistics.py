import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

from fedlight.data.labels import VOC_CLASSES, voc_colormap
from fedlight.data.partition import DirichletPowerLaw
from fedlight.data.partition.summary import partition_figure, partition_statistics, plot_partition_summary


def _voc_like_labels(rng):
    # an imbalanced 20-class pool of 3,000 single-object images, classes 1…20 as in VOC (person most frequent)
    prior = rng.dirichlet(np.full(20, 2.0))
    prior[14] += 0.3
    return 1 + rng.choice(20, size=3000, p=prior / prior.sum())


@pytest.fixture(scope="module")
def by_alpha():
    rng = np.random.default_rng(0)
    labels = _voc_like_labels(rng)
    out = {}
    for alpha in (0.01, 0.1, 1.0, 100.0):
        parts = DirichletPowerLaw(num_clients=100, alpha=alpha, gamma=3.0)(labels, 21, np.random.default_rng(1))
        out[alpha] = partition_statistics(labels, parts, 21)
    return out


def test_lower_alpha_means_fewer_classes_per_client(by_alpha):
    # α = 0.01 and 0.1 are both near one class per client (Fig. S1), so the order is checked from 0.1 up
    alphas = (0.1, 1.0, 100.0)
    classes = [by_alpha[a].classes_per_client.mean() for a in alphas]
    dominant = [by_alpha[a].dominant_share.mean() for a in alphas]
    clients_per_class = [by_alpha[a].clients_per_class.mean() for a in alphas]
    assert classes == sorted(classes) and classes[-1] > 10
    assert dominant == sorted(dominant, reverse=True)
    assert clients_per_class == sorted(clients_per_class)
    assert by_alpha[0.01].classes_per_client.mean() < 2.0 and by_alpha[0.01].dominant_share.mean() > 0.85


def test_size_statistics(by_alpha):
    for stats in by_alpha.values():
        sizes = np.array([part_size for part_size in stats.counts.sum(axis=1)], dtype=float)
        assert sizes.sum() == 3000 and stats.summary()["size_cv"] == pytest.approx(sizes.std() / sizes.mean())
    # the sizes are drawn before the class mixes, so α does not change them
    assert len({tuple(stats.sizes) for stats in by_alpha.values()}) == 1


def test_counts_are_per_client_and_class():
    labels = np.array([1, 1, 2, 3, 3, 3, 2])
    stats = partition_statistics(labels, [np.array([0, 2, 6]), np.array([1, 3, 4, 5])], 4)
    assert stats.counts.tolist() == [[0, 1, 2, 0], [0, 1, 0, 3]]
    assert stats.dominant_share.tolist() == [2 / 3, 3 / 4]
    assert stats.summary()["size_mean"] == 3.5


def test_plot_writes_a_png(by_alpha, tmp_path):
    colours = voc_colormap()[:21] / 255
    path = plot_partition_summary(by_alpha[0.1], tmp_path / "s1.png", VOC_CLASSES, colours, title="alpha=0.1")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_counts_tick_at_integers_only():
    # three clients holding 1, 2 and 3 classes: a float axis would tick at 1.0, 1.5, 2.0, …
    labels = np.array([1, 1, 2, 1, 2, 3])
    stats = partition_statistics(labels, [np.array([0, 1]), np.array([2, 3]), np.array([4, 5, 0])], 4)
    assert stats.classes_per_client.tolist() == [1, 2, 3]
    figure = partition_figure(stats, VOC_CLASSES[:4], voc_colormap()[:4] / 255)
    FigureCanvasAgg(figure).draw()
    left, middle, _ = figure.axes
    for ticks in (middle.get_xticks(), middle.get_yticks(), left.get_yticks()):
        assert len(ticks) >= 2 and np.array_equal(ticks, np.round(ticks)), ticks
    assert [t for t in middle.get_xticks() if 1 <= t <= 3] == [1, 2, 3]
