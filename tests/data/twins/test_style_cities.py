import numpy as np
import pytest
import torch
from sklearn.metrics import adjusted_rand_score

from fedlight.data.partition import Natural
from fedlight.data.style.fda import client_style, extract_style
from fedlight.data.twins.style_cities import CITIES, Appearance, StyleCities, city_of
from fedlight.errors import ConfigError
from fedlight.strategies.clustering import route_to_cluster, select_style_clusters

SIZE = 32


@pytest.fixture(scope="module")
def cities():
    dataset = StyleCities(num_clients_per_city=5, num_test_per_city=20, image_size=SIZE, normalise=False, seed=1)
    return dataset.load_train(), dataset.load_test()


def test_many_small_clients_in_four_cities(cities):
    train, _ = cities
    ids, sizes = np.unique(train.groups, return_counts=True)
    assert len(ids) == 20 and sizes.min() >= 17 and sizes.max() <= 37
    assert sorted({city_of(i) for i in ids}) == sorted(CITIES)
    assert train.inputs.shape == (len(train), 3, SIZE, SIZE) and train.targets.shape == (len(train), SIZE, SIZE)
    assert train.inputs.min() >= 0 and train.inputs.max() <= 1  # raw, for styles
    for mask, label in zip(train.targets, train.labels, strict=True):
        assert set(mask.unique().tolist()) <= {0, int(label)}  # background and the image's one object class
    clients = Natural()(train.partition_labels(), 6, np.random.default_rng(0), groups=train.groups)
    assert len(clients) == 20 and sorted(len(c) for c in clients) == sorted(sizes.tolist())


def test_client_styles_cluster_by_city_and_test_images_route_to_their_city(cities):
    train, test = cities
    ids = np.unique(train.groups)
    styles = np.stack([client_style([train.inputs[train.groups == i]], b=1, size=(SIZE, SIZE)).numpy() for i in ids])
    city = np.array([list(CITIES).index(city_of(i)) for i in ids])
    clustering = select_style_clusters(styles, k_range=range(2, 8))
    assert clustering.k == 4 and adjusted_rand_score(city, clustering.labels) == 1.0
    majority = np.array([np.bincount(city[clustering.labels == c]).argmax() for c in range(4)])
    routed = route_to_cluster(extract_style(test.inputs, b=1, size=(SIZE, SIZE)), clustering.centroids).numpy()
    assert (np.array(list(CITIES))[majority[routed]] == test.groups).mean() > 0.7  # one image's style is noisier


def test_one_client_per_city_merges_each_citys_clients_and_keeps_their_images():
    kwargs = dict(num_clients_per_city=3, num_test_per_city=0, image_size=SIZE, seed=4)
    clients, cities = StyleCities(**kwargs).load_train(), StyleCities(**kwargs, one_client_per_city=True).load_train()
    assert torch.equal(clients.inputs, cities.inputs) and torch.equal(clients.targets, cities.targets)
    assert cities.groups.tolist() == [city_of(client) for client in clients.groups]
    partition = Natural()(cities.partition_labels(), 6, np.random.default_rng(0), groups=cities.groups)
    for city, client in zip(sorted(CITIES), partition, strict=True):  # Natural orders the clients by id
        members = [i for i, c in enumerate(clients.groups) if city_of(c) == city]
        assert client.tolist() == members and len({clients.groups[i] for i in members}) == 3


def test_source_is_one_labelled_client_and_shares_the_test_set():
    source = StyleCities(domain="source", num_source_samples=60, num_test_per_city=3, image_size=SIZE, seed=2)
    target = StyleCities(domain="target", num_clients_per_city=1, num_test_per_city=3, image_size=SIZE, seed=2)
    pool = source.load_train()
    assert len(pool) == 60 and set(pool.groups) == {"source"} and source.num_classes == 6
    assert pool.inputs.min() >= -1 and pool.inputs.max() <= 1  # normalised with mean = std = 0.5
    test = source.load_test()
    assert torch.equal(test.inputs, target.load_test().inputs)
    assert test.groups.tolist() == [city for city in CITIES for _ in range(3)]  # the city of each test image


def test_the_grey_city_is_less_colourful_than_the_source_and_the_neutral_look_changes_nothing():
    source = StyleCities(domain="source", num_source_samples=40, image_size=SIZE, normalise=False, seed=3)
    pool = source.load_train()
    as_grey = CITIES["grey"](pool.inputs)  # the source's scenes as the grey city shows them
    colourfulness = lambda x: (x - x.mean(dim=1, keepdim=True)).abs().mean().item()  # noqa: E731
    assert colourfulness(as_grey) < 0.5 * colourfulness(pool.inputs)
    torch.testing.assert_close(Appearance()(pool.inputs), pool.inputs, atol=1e-6, rtol=0)  # the neutral look


def test_blur_keeps_the_mean_and_removes_high_frequencies():
    x = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(0)) * 0.5 + 0.25
    blurred = Appearance(blur=1.0)(x)
    torch.testing.assert_close(blurred.mean(dim=(2, 3)), x.mean(dim=(2, 3)), atol=0.01, rtol=0)
    high = lambda im: torch.fft.fft2(im).abs()[..., 4:13, 4:13].sum()  # noqa: E731  frequencies far from DC
    assert high(blurred) < 0.3 * high(x)


def test_same_seed_same_data_other_seed_other_data():
    make = lambda seed: StyleCities(num_clients_per_city=1, image_size=16, seed=seed).load_train()  # noqa: E731
    first, again, other = make(0), make(0), make(1)
    assert torch.equal(first.inputs, again.inputs) and (first.groups == again.groups).all()
    assert first.inputs.shape != other.inputs.shape or not torch.equal(first.inputs, other.inputs)


def test_bad_settings_are_reported_together():
    with pytest.raises(ConfigError) as error:
        StyleCities(num_clients_per_city=0, client_size=(37, 17), client_jitter=-1.0, class_skew=0.0)
    assert len(error.value.problems) == 4 and "client_size as (min, max)" in str(error.value)
    assert "class_skew in (0, 1]" in str(error.value)


def test_with_a_class_skew_each_city_favours_its_own_classes_and_the_source_stays_uniform():
    kwargs = dict(num_object_classes=4, image_size=16, class_skew=0.5, num_test_per_city=200, seed=4)
    target = StyleCities(num_clients_per_city=20, **kwargs)
    train, test = target.load_train(), target.load_test()
    city = np.array([list(CITIES).index(city_of(i)) for i in train.groups])
    for index in range(4):
        expected = 0.5 ** ((np.arange(4) - index) % 4) / (1 + 0.5 + 0.25 + 0.125)  # city i starts at class i·4/4 = i
        shares = np.bincount(train.labels[city == index] - 1, minlength=4) / (city == index).sum()
        assert np.abs(shares - expected).max() < 0.06  # ~550 images a city: a few points of sampling error
        assert np.bincount(test.labels[test.groups == list(CITIES)[index]] - 1, minlength=4).argmax() == index
    source = StyleCities(domain="source", num_source_samples=2000, **kwargs).load_train()
    assert np.abs(np.bincount(source.labels - 1, minlength=4) / 2000 - 0.25).max() < 0.04


def test_sensor_noise_is_white_and_leaves_the_fda_window_almost_unchanged():
    source = StyleCities(domain="source", num_source_samples=40, image_size=SIZE, normalise=False, seed=5)
    clean = source.load_train().inputs * 0.8 + 0.1  # away from 0 and 1, so clipping does not bias the noise
    noisy = Appearance(noise=0.08)(clean, torch.Generator().manual_seed(0))
    assert abs((noisy - clean).std().item() - 0.08) < 0.005
    window = lambda x: extract_style(x, b=1, size=(SIZE, SIZE))  # noqa: E731  the 3×3 amplitudes FDA transfers
    power = lambda x: (torch.fft.fft2(x).abs() ** 2)[..., 8:25, 8:25].mean()  # noqa: E731  far from DC
    assert (window(noisy) - window(clean)).norm() < 0.05 * window(clean).norm()
    # white noise adds σ²·H·W of power at every frequency (Parseval)
    torch.testing.assert_close(power(noisy) - power(clean), torch.tensor(0.08**2 * SIZE**2), rtol=0.1, atol=0)
