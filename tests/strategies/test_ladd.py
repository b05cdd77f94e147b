"""LADD on the engine: style clusters, teachers and their cadence, routed evaluation, checkpoints."""

import copy
import json

import numpy as np
import pytest
import torch
from ladd_run import CITY_KW, SIZE, Recording, fit, ladd, make_data, make_model  # noqa: F401

from fedlight import checkpoint as ckpt_io
from fedlight.clients import SourcePretrainingClient
from fedlight.data import FederatedDataModule
from fedlight.data.style.fda import client_style, extract_style
from fedlight.data.style.style_augment import StyleAugment
from fedlight.data.twins.style_cities import StyleCities
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.state import FlatState
from fedlight.strategies import LADD, FedAvg
from fedlight.strategies.clustering import select_style_clusters
from fedlight.testing import Kill, KillAfterRound


def raw_client_styles():
    """Every client's mean style from the raw images, by client id, without the engine."""
    raw = StyleCities(**CITY_KW, normalise=False).load_train()
    ids = np.unique(raw.groups)
    return ids, torch.stack(
        [client_style([raw.inputs[torch.from_numpy(raw.groups == i)]], b=1, size=(SIZE, SIZE)) for i in ids]
    )


def test_clusters_are_chosen_from_the_raw_images_styles(tmp_path):
    strategy = ladd()
    trainer, _ = fit(tmp_path, strategy, rounds=1)
    ids, styles = raw_client_styles()
    torch.testing.assert_close(strategy.styles, styles, rtol=1e-6, atol=0)  # normalisation undone (fp32)
    expected = select_style_clusters(styles.numpy(), range(2, 4), n_init=2, seed=0)
    assert strategy.clusters == expected.labels.tolist()
    assert trainer.model.bank.num_clusters == expected.k
    written = json.loads((trainer.run_dir / "clusters.json").read_text())
    assert {client: int(c) for c, members in written.items() for client in members} == dict(
        zip(ids.tolist(), expected.labels.tolist(), strict=True)
    )


def test_a_cluster_file_replaces_the_clustering(tmp_path):
    path = tmp_path / "clusters.json"
    path.write_text(json.dumps({"0": ["cool0", "cool1", "dim0", "dim1"], "1": ["grey0", "grey1", "warm0", "warm1"]}))
    strategy = ladd(clusters_file=str(path))
    fit(tmp_path, strategy, rounds=1)
    assert strategy.clusters == [0, 0, 0, 0, 1, 1, 1, 1]  # sorted ids: cool, dim, grey, warm
    _, styles = raw_client_styles()
    torch.testing.assert_close(strategy.centroids, torch.stack([styles[:4].mean(0), styles[4:].mean(0)]))


def test_kd_teacher_is_w0_and_pseudo_teachers_refresh_every_omega_rounds(tmp_path):
    strategy = ladd(Recording, teacher_step=2)
    fit(tmp_path, strategy, rounds=5)
    for round_idx, handed in strategy.handed.items():
        refreshed = round_idx - round_idx % 2  # the last round r ≥ 1 with r mod ω = 0
        for client, teachers in handed.items():
            assert torch.equal(teachers["kd"], strategy.initial)
            if refreshed == 0:
                assert "pseudo" not in teachers  # no cluster model yet: the student labels itself
            else:
                member = strategy.members[refreshed][strategy.clusters[client]]
                assert torch.equal(teachers["pseudo"], member)
    assert not torch.equal(strategy.members[2][0], strategy.members[4][0])  # the refresh did change the teacher


def test_swa_teacher_after_n_refreshes_is_the_mean_of_the_cluster_models(tmp_path):
    strategy = ladd(Recording, teacher_step=1, swa_start=2)
    fit(tmp_path, strategy, rounds=5)
    for cluster in range(len(strategy.members[0])):
        averaged = torch.stack([strategy.members[r][cluster] for r in (2, 3, 4)]).double().mean(0)
        torch.testing.assert_close(strategy.teachers.states[f"swa/{cluster}"].double(), averaged, rtol=0, atol=1e-5)
        assert strategy.teachers.counts[f"swa/{cluster}"] == 3
        # before t_start the teacher was the cluster model of round 1; from round 2 on the SWA teacher
        assert torch.equal(strategy.teachers.states[f"pseudo/{cluster}"], strategy.members[1][cluster])
    for client, teachers in strategy.handed[4].items():
        assert torch.equal(teachers["pseudo"], strategy.teachers.states[f"swa/{strategy.clusters[client]}"])


def test_routed_metrics_score_each_test_image_with_the_cluster_nearest_its_style(tmp_path):
    strategy = ladd()
    trainer, model = fit(tmp_path, strategy, rounds=2)
    metrics = trainer.history[-1]
    test = StyleCities(**CITY_KW, normalise=False).load_test()
    styles = extract_style(test.inputs, b=1, size=(SIZE, SIZE))  # [N, 27] from the raw test images
    routes = ((styles[:, None] - strategy.centroids[None]) ** 2).sum(-1).argmin(1)
    x = (test.inputs - 0.5) / 0.5
    metric = model.evaluation_metric(1)
    for cluster in range(trainer.model.bank.num_clusters):
        member = copy.deepcopy(model)
        trainer.model.layout.load(member, trainer.model.bank.member(cluster), trainer.model.integers)
        member.eval()
        chosen = routes == cluster
        group = torch.zeros(int(chosen.sum()), dtype=torch.long)
        with torch.no_grad():
            metric.update(**member.validation_step((x[chosen], test.targets[chosen], group), 0))
    routed = metric.compute()
    assert metrics["test/routed/miou"] == pytest.approx(routed["miou"].item(), abs=1e-9)
    # each class's routed IoU too, named after the style cities' classes
    for name in ("background", "aeroplane", "bicycle"):
        key = f"iou_{name}"
        assert metrics[f"test/routed/{key}"] == pytest.approx(routed[key].item(), abs=1e-9, nan_ok=True)
    assert metrics["test/routed/loss"] != pytest.approx(metrics["test/loss"], abs=1e-6)
    assert len(set(routes.tolist())) > 1  # the test cities do go to different clusters


def test_without_clustering_one_global_model_keeps_the_teachers(tmp_path):
    strategy = ladd(Recording, clustering=False, teacher_step=1)
    trainer, _ = fit(tmp_path, strategy, rounds=3)
    assert trainer.model.bank.num_clusters == 0 and "test/routed/miou" not in trainer.history[-1]
    for teachers in strategy.handed[2].values():
        assert torch.equal(teachers["pseudo"], strategy.teachers.states["pseudo/0"])


def test_a_killed_run_resumes_to_the_same_model_and_teachers(tmp_path):
    whole = ladd(teacher_step=1, swa_start=2)
    trainer, _ = fit(tmp_path / "whole", whole, rounds=3)
    with pytest.raises(Kill):
        fit(tmp_path / "killed", ladd(teacher_step=1, swa_start=2), rounds=3, callbacks=[KillAfterRound(1)])
    checkpoint = next((tmp_path / "killed").rglob("last.ckpt"))
    assert ckpt_io.load(checkpoint)["round"] == 1  # SWA starts after the resume
    resumed_strategy = ladd(teacher_step=1, swa_start=2)
    resumed, _ = fit(tmp_path / "killed", resumed_strategy, rounds=3, ckpt_path=checkpoint)
    assert torch.equal(resumed.global_state, trainer.global_state)
    assert torch.equal(resumed.model.bank.clusters, trainer.model.bank.clusters)
    for name, state in whole.teachers.states.items():
        assert torch.equal(resumed_strategy.teachers.states[name], state), name
    assert resumed_strategy.clusters == whole.clusters


def test_bad_options_name_their_flags():
    with pytest.raises(ConfigError, match="teacher_step") as error:
        LADD(teacher_step=0, swa_start=0, k_range=(5, 4))
    assert "swa_start" in str(error.value) and "k_range" in str(error.value)


def test_source_pretraining_with_restyled_images_seeds_w0_and_the_kd_teacher(tmp_path):
    source = FederatedDataModule(
        StyleCities(domain="source", num_source_samples=8, num_test_per_city=1, image_size=SIZE, num_object_classes=2),
        batch_size=4, test_fraction=0.0, drop_last=True,
        train_transform=StyleAugment(str(tmp_path / "styles.pt"), target=StyleCities(**CITY_KW), size=(SIZE, SIZE)),
    )  # fmt: skip
    torch.manual_seed(1)
    pretraining = SourcePretrainingClient(num_classes=3, input_shape=(3, SIZE, SIZE), model="mini_deeplab")
    start = FlatState(pretraining).flatten(pretraining)
    pretrainer = FederatedTrainer(
        rounds=2, clients_per_round=1, local_epochs=1, logger="csv", enable_progress_bar=False,
        default_root_dir=tmp_path, name="pretrain",
    )  # fmt: skip
    pretrainer.fit(pretraining, source, FedAvg())
    assert (tmp_path / "styles.pt").is_file()  # the clients' style pool, written on first use
    assert not torch.equal(pretrainer.global_state, start)
    strategy = ladd(Recording)
    fit(tmp_path, strategy, rounds=1, init_from=pretrainer.run_dir / "checkpoints" / "last.ckpt")
    assert torch.equal(strategy.initial, pretrainer.global_state)
    assert torch.equal(strategy.teachers.states["kd"], pretrainer.global_state)
