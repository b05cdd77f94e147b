"""LADD as its released code runs it: each behaviour of the preset against values derived by hand or by an
independent route (torch's DistributedSampler for the code's loader order, raw-image styles for the routes)."""

import copy
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from ladd_run import CITY_KW, SIZE, Recording, fit, ladd
from torch.utils.data.distributed import DistributedSampler

from fedlight.clients import SelfTrainingClient
from fedlight.data import FederatedDataModule
from fedlight.data.style.fda import extract_style
from fedlight.data.twins.style_cities import StyleCities
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.strategies import ladd_released as released


def own_test_clusters(strategy) -> torch.Tensor:
    """Each test image's cluster by its own style, from the raw test images (dataset order)."""
    test = StyleCities(**CITY_KW, normalise=False).load_test()
    styles = extract_style(test.inputs, b=1, size=(SIZE, SIZE))
    return ((styles[:, None] - strategy.centroids[None]) ** 2).sum(-1).argmin(1)


def test_the_code_scores_the_ith_image_it_visits_with_the_ith_images_cluster():
    own = torch.tensor([0, 0, 1, 2, 1, 0, 2])
    visited = list(DistributedSampler(range(7), num_replicas=1, rank=0, shuffle=True, seed=0))  # batch 1
    routes = released.released_routes(own, released.sampler_order(7))
    members = released.released_global_members(own, released.sampler_order(7))
    for i, image in enumerate(visited):
        assert routes[image] == own[i]
        assert members[image] == (-1 if i == 0 else own[i - 1])  # the previous image's cluster model


def test_the_last_listed_client_is_the_one_whose_samples_come_last():
    # clients listed b, c, a (their first samples at 0, 2, 3); fedlight numbers them a, b, c
    data = SimpleNamespace(pool=SimpleNamespace(groups=np.array(["b", "b", "c", "a", "a"])), num_clients=3)
    assert released.last_listed_client(data) == 0
    data.pool.groups = None
    assert released.last_listed_client(data) == 2


def test_chance_agreement_by_hand():
    assert released.chance_agreement(torch.tensor([0, 0, 0, 1])) == pytest.approx(0.75**2 + 0.25**2)


def test_every_client_is_taught_by_the_cluster_model_of_the_last_listed_client(tmp_path):
    # the pool lists grey, warm, cool, dim; fedlight numbers the clients cool0, cool1, dim0, dim1, grey0, …: dim1
    # (client 3) is listed last, and its cluster is 0, not the last cluster
    path = tmp_path / "clusters.json"
    path.write_text(json.dumps({"0": ["cool0", "cool1", "dim0", "dim1"], "1": ["grey0", "grey1", "warm0", "warm1"]}))
    strategy = ladd(Recording, teacher_step=1, shared_pseudo_teacher=True, clusters_file=str(path))
    fit(tmp_path, strategy, rounds=3)
    groups = StyleCities(**CITY_KW).load_train().groups
    _, first = np.unique(groups, return_index=True)
    last = int(np.argmax(first))  # the client whose first image comes last in the pool
    assert last == 3 and strategy.clusters[last] == 0 and strategy.num_clusters() == 2
    for round_idx in (1, 2):
        for teachers in strategy.handed[round_idx].values():
            assert torch.equal(teachers["pseudo"], strategy.members[round_idx][strategy.clusters[last]])


def test_the_codes_swa_teacher_copies_at_t_start_minus_one_and_averages_global_parameters(tmp_path):
    # ω = 1, t_start = 2: round 1 copies the model the code holds (the cluster model of the last test image, left
    # by its test loop) and teaches with it; rounds 2 and 3 average the global parameters in (the first overwrites)
    strategy = ladd(Recording, teacher_step=1, swa_start=2, swa_of_global=True)
    trainer, model = fit(tmp_path, strategy, rounds=4)
    held = strategy.members[1][int(own_test_clusters(strategy)[-1])]
    for teachers in strategy.handed[1].values():
        assert torch.equal(teachers["pseudo"], held)
    parameters = trainer.model.layout.parameter_mask(model)
    swa = strategy.teachers.states["swa/global"]
    torch.testing.assert_close(swa[parameters], (strategy.globals[2][parameters] + strategy.globals[3][parameters]) / 2)
    assert torch.equal(swa[~parameters], held[~parameters])  # BatchNorm statistics of the copy
    assert not torch.equal(held[~parameters], strategy.globals[1][~parameters])  # not the global model's
    for teachers in strategy.handed[3].values():
        assert torch.equal(teachers["pseudo"], swa)


def test_without_clusters_the_codes_swa_teacher_copies_the_global_model(tmp_path):
    strategy = ladd(Recording, clustering=False, teacher_step=2, swa_start=4, swa_of_global=True)
    trainer, model = fit(tmp_path, strategy, rounds=5)
    buffers = ~trainer.model.layout.parameter_mask(model)
    swa = strategy.teachers.states["swa/global"]
    assert torch.equal(swa[buffers], strategy.globals[3][buffers])  # copied at round 3 = t_start − 1
    assert torch.equal(swa[~buffers], strategy.globals[4][~buffers])  # the refresh of round 4 overwrote them
    # round 3 is no refresh (ω = 2): the teacher stays the global model of round 2 until round 4
    for teachers in strategy.handed[3].values():
        assert torch.equal(teachers["pseudo"], strategy.globals[2])


def test_the_first_round_teacher_can_be_w0(tmp_path):
    strategy = ladd(Recording, teacher_step=2, first_round_teacher="global")
    fit(tmp_path, strategy, rounds=2)
    for round_idx in (0, 1):
        for teachers in strategy.handed[round_idx].values():
            assert torch.equal(teachers["pseudo"], strategy.initial)


def test_the_released_test_loop_scores_by_shuffled_routes_and_a_previous_global(tmp_path):
    strategy = ladd(test_routing="released")
    trainer, model = fit(tmp_path, strategy, rounds=2)
    metrics = trainer.history[-1]
    own = own_test_clusters(strategy)
    visited = list(DistributedSampler(range(len(own)), num_replicas=1, rank=0, shuffle=True, seed=0))
    test = StyleCities(**CITY_KW, normalise=False).load_test()
    x = (test.inputs - 0.5) / 0.5

    def score(member_of_visit):  # member_of_visit(i): the member scoring the i-th visited image (−1: global)
        metric = model.evaluation_metric(1)
        for i, image in enumerate(visited):
            member = copy.deepcopy(model)
            state = trainer.global_state if member_of_visit(i) == -1 else trainer.model.bank.member(member_of_visit(i))
            trainer.model.layout.load(member, state, trainer.model.integers)
            with torch.no_grad():
                batch = (x[image : image + 1], test.targets[image : image + 1], torch.zeros(1, dtype=torch.long))
                metric.update(**member.eval().validation_step(batch, 0))
        return metric.compute()["miou"].item()

    assert metrics["test/routed/miou"] == pytest.approx(score(lambda i: int(own[i])), abs=1e-9)
    assert metrics["test/released_global/miou"] == pytest.approx(
        score(lambda i: -1 if i == 0 else int(own[i - 1])), abs=1e-9
    )
    agreement = np.mean([int(own[i]) == int(own[visited[i]]) for i in range(len(own))])
    assert metrics["routing/released_agreement"] == pytest.approx(agreement)
    shares = np.bincount(own.numpy()) / len(own)
    assert metrics["routing/chance_agreement"] == pytest.approx((shares**2).sum())


class UnlabelledCities(StyleCities):
    train_labels = False


def test_kd_label_weights_are_refused_on_clients_without_labels(tmp_path):
    data = FederatedDataModule(UnlabelledCities(**CITY_KW), batch_size=2, test_fraction=0.0, drop_last=True)
    torch.manual_seed(0)
    model = SelfTrainingClient(num_classes=3, input_shape=(3, SIZE, SIZE), model="mini_deeplab", kd_label_weights=True)
    trainer = FederatedTrainer(rounds=1, clients_per_round=3, logger="csv", default_root_dir=tmp_path)
    with pytest.raises(ConfigError, match="kd_label_weights=false"):
        trainer.fit(model, data, ladd())
    assert list(tmp_path.iterdir()) == []


def test_an_evaluation_from_a_checkpoint_routes_as_the_run_did(tmp_path):
    trainer, _ = fit(tmp_path, ladd(test_routing="released"), rounds=1)
    evaluator = FederatedTrainer(
        clients_per_round=3, logger=None, enable_progress_bar=False, default_root_dir=tmp_path / "e"
    )
    torch.manual_seed(0)
    model = SelfTrainingClient(num_classes=3, input_shape=(3, SIZE, SIZE), model="mini_deeplab", lambda_kd=1.0)
    data = FederatedDataModule(
        StyleCities(**CITY_KW), batch_size=2, test_fraction=0.0, drop_last=True, eval_batch_size=5
    )
    result = evaluator.test(
        model, data, ladd(test_routing="released"), ckpt_path=trainer.run_dir / "checkpoints/last.ckpt"
    )
    assert result["test/routed/miou"] == pytest.approx(trainer.history[-1]["test/routed/miou"], abs=1e-9)
