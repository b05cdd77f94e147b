"""Per-image scores and ``fedlight compare``: FUSS's paired t-test and Wilcoxon test between two runs."""

import numpy as np
import pytest
import torch
from scipy import stats

from fedlight.callbacks.per_image_scores import image_id, per_image_scores, read_per_image, write_per_image
from fedlight.cli import main
from fedlight.compare import paired_test
from fedlight.errors import ConfigError


def write_run(folder, ids, miou, acc=None):
    folder.mkdir(parents=True, exist_ok=True)
    acc = miou if acc is None else acc
    write_per_image({"image": ids, "miou": np.asarray(miou), "acc": np.asarray(acc)}, folder / "per_image.csv")
    return folder


def test_p_values_are_scipy_s_on_the_paired_arrays(tmp_path):
    rng = np.random.default_rng(0)
    a, b = rng.uniform(0.1, 0.5, 30), rng.uniform(0.15, 0.55, 30)
    ids = [f"{i:06d}-x" for i in range(30)]
    result = paired_test(write_run(tmp_path / "a", ids, a), write_run(tmp_path / "b", ids, b))
    assert result["n"] == 30
    assert result["mean_difference"] == pytest.approx(np.mean(b - a))
    assert result["t_pvalue"] == pytest.approx(stats.ttest_rel(b, a).pvalue, rel=1e-12)
    assert result["wilcoxon_pvalue"] == pytest.approx(stats.wilcoxon(b, a).pvalue, rel=1e-12)


def test_images_without_a_score_in_either_run_are_left_out_of_both(tmp_path):
    a, b = np.array([0.1, np.nan, 0.3, 0.2, 0.5]), np.array([0.2, 0.4, np.nan, 0.4, 0.4])
    ids = [str(i) for i in range(5)]
    result = paired_test(write_run(tmp_path / "a", ids, a), write_run(tmp_path / "b", ids, b))
    kept_a, kept_b = np.array([0.1, 0.2, 0.5]), np.array([0.2, 0.4, 0.4])
    assert result["n"] == 3 and result["mean_a"] == pytest.approx(kept_a.mean())
    assert result["t_pvalue"] == pytest.approx(stats.ttest_rel(kept_b, kept_a).pvalue)


def test_runs_on_different_images_are_refused(tmp_path):
    a = write_run(tmp_path / "a", ["000000-aa", "000001-bb", "000002-cc"], [0.1, 0.2, 0.3])
    b = write_run(tmp_path / "b", ["000000-aa", "000001-bb", "000002-dd"], [0.1, 0.2, 0.3])
    with pytest.raises(ConfigError, match="do not score the same images"):
        paired_test(a, b)
    with pytest.raises(ConfigError, match=r"per_image\.csv"):
        paired_test(a, tmp_path / "missing")


def test_image_ids_tell_different_pixels_apart():
    image = torch.zeros(3, 4, 4)
    assert image_id(0, image) == image_id(0, image.clone())
    assert image_id(0, image) != image_id(0, image + 1e-3) and image_id(0, image) != image_id(1, image)


class Clusters(torch.nn.Module):
    """A stand-in unsupervised model: its clusters are the batch's first channel."""

    num_clusters = 2

    def validation_step(self, batch, batch_idx):
        return {"clusters": batch[0][:, 0].long(), "target": batch[1]}


def test_per_image_scores_use_the_set_s_hungarian_match():
    # image 0: clusters swap the classes everywhere; image 1: half right under the swap
    clusters = torch.tensor([[[1, 1, 0, 0]], [[1, 1, 1, 1]]]).float()
    target = torch.tensor([[[0, 0, 1, 1]], [[0, 0, 1, 1]]])
    images = clusters[:, None].expand(-1, 3, -1, -1)
    scores = per_image_scores(Clusters().eval(), [(images, target, None)], num_classes=2)
    # the set's match maps cluster 1 → class 0, cluster 0 → class 1 (6 of 8 pixels right)
    assert scores["acc"].tolist() == [1.0, 0.5]
    assert scores["miou"].tolist() == pytest.approx([1.0, (2 / 4 + 0 / 2) / 2])
    assert scores["image"][1].startswith("000001-")


def test_compare_end_to_end_on_two_tiny_twin_runs(tmp_path, capsys):
    common = [
        "--data.dataset=fedlight.data.StreetScenes", "--data.dataset.num_classes=12",
        "--data.dataset.num_cities=2", "--data.dataset.images_per_city=8", "--data.dataset.num_test_samples=6",
        "--data.dataset.image_size=16", "--data.partitioner=fedlight.data.partition.Natural",
        "--data.batch_size=4", "--data.test_fraction=0.0", "--data.return_index=true",
        "--model=fedlight.clients.UnsupervisedSegmentationClient", "--model.backbone=conv_patch8",
        "--model.backbone_kwargs={out_channels: 8}", "--model.dim=3", "--model.feature_samples=2",
        "--model.num_negatives=1", "--trainer.rounds=1", "--trainer.clients_per_round=2",
        "--trainer.local_steps=2", "--trainer.enable_progress_bar=false",
        "--trainer.callbacks+=fedlight.callbacks.BackboneFeatureCache", "--trainer.callbacks.k=3",
        "--trainer.callbacks+=fedlight.callbacks.per_image_scores.PerImageScores",
        "--strategy=fedlight.strategies.FedCC",
    ]  # fmt: skip
    runs = []
    for rule in ("average", "maximin"):
        root = tmp_path / rule
        main(["fit", *common, f"--trainer.default_root_dir={root}", f"--strategy.centroids={rule}"])
        (run,) = root.glob("*/version_*")
        runs.append(run)
    capsys.readouterr()
    main(["compare", str(runs[0]), str(runs[1])])
    printed = capsys.readouterr().out
    a, b = (read_per_image(run / "per_image.csv") for run in runs)
    assert len(a["image"]) == 6 and a["image"] == b["image"]
    keep = ~(np.isnan(a["miou"]) | np.isnan(b["miou"]))
    expected = stats.ttest_rel(b["miou"][keep], a["miou"][keep]).pvalue
    assert f"n = {keep.sum()} images" in printed
    assert (f"p = {expected:.4g}" if np.isfinite(expected) else "p = 1") in printed


class Classes(torch.nn.Module):
    """A stand-in supervised model: its predicted classes are the batch's first channel."""

    def validation_step(self, batch, batch_idx):
        return {"preds": batch[0][:, 0].long(), "target": batch[1]}


def test_supervised_predictions_are_scored_without_a_match():
    preds = torch.tensor([[[1, 1, 0, 0]], [[0, 0, 1, 1]]]).float()
    target = torch.tensor([[[0, 0, 1, 255]], [[0, 0, 1, 1]]])
    images = preds[:, None].expand(-1, 3, -1, -1)
    scores = per_image_scores(Classes().eval(), [(images, target, None)], num_classes=2)
    # image 0 is wrong on its 3 valid pixels (no swap is made); image 1 is right everywhere
    assert scores["acc"].tolist() == [0.0, 1.0] and scores["miou"].tolist() == [0.0, 1.0]


def test_the_commands_help_lists_compare_and_its_own_help_is_plain_text(capsys):
    for args in (["--help"], ["compare", "--help"]):
        with pytest.raises(SystemExit):
            main(args)
        text = capsys.readouterr().out
        assert "Is run B better than run A on the same test images?" in text
        assert "``" not in text and ":class:" not in text and ":func:" not in text
    assert "usage: fedlight {fit,validate,test,compare,sweep}" in " ".join(_help_usage(["--help"], capsys).split())


def _help_usage(args, capsys):
    with pytest.raises(SystemExit):
        main(args)
    return capsys.readouterr().out.splitlines()[0]


def test_binary_scores_add_mcnemar_s_exact_test(tmp_path):
    # A alone right on image 0, B alone right on images 3–6: the discordant pairs are 1 and 4
    a = [1, 1, 0, 0, 0, 0, 0, 1]
    b = [0, 1, 0, 1, 1, 1, 1, 1]
    ids = [str(i) for i in range(8)]
    result = paired_test(write_run(tmp_path / "a", ids, a), write_run(tmp_path / "b", ids, b), metric="acc")
    assert result["binary"] and (result["only_a"], result["only_b"]) == (1, 4)
    # two-sided exact binomial with n = 5, p = 1/2: 2 · P(X ≥ 4) = 2 · (5 + 1) / 32
    assert result["mcnemar_pvalue"] == pytest.approx(12 / 32)
    continuous = paired_test(write_run(tmp_path / "c", ids, np.full(8, 0.5)), tmp_path / "b", metric="acc")
    assert not continuous["binary"]


def test_a_classifier_run_scores_each_test_image_and_compare_pairs_two(tmp_path, capsys):
    common = [
        "--config", "conf/fedproto/synthetic/fedavg_delta0.yaml", "--trainer.rounds=1", "--trainer.local_epochs=1",
        "--trainer.clients_per_round=3", "--trainer.enable_progress_bar=false", "--trainer.logger=csv",
        "--trainer.callbacks+=fedlight.callbacks.per_image_scores.PerImageScores",
    ]  # fmt: skip
    runs = []
    for lr in ("0.01", "0.5"):
        root = tmp_path / lr
        main(["fit", *common, f"--trainer.default_root_dir={root}", f"--model.init_args.optimizer.init_args.lr={lr}"])
        (run,) = root.glob("*/version_*")
        runs.append(run)
    a, b = (read_per_image(run / "per_image.csv") for run in runs)
    assert a["image"] == b["image"] and len(a["image"]) > 100
    assert set(a["acc"]) <= {0.0, 1.0} and np.isnan(a["miou"]).all()
    metrics = np.genfromtxt(runs[0] / "metrics.csv", delimiter=",", names=True)
    assert a["acc"].mean() == pytest.approx(float(np.atleast_1d(metrics["testacc"])[-1]))
    capsys.readouterr()
    main(["compare", str(runs[0]), str(runs[1]), "--metric", "acc"])
    only_a = int(((a["acc"] == 1) & (b["acc"] == 0)).sum())
    only_b = int(((a["acc"] == 0) & (b["acc"] == 1)).sum())
    expected = stats.binomtest(only_b, only_a + only_b).pvalue
    assert f"{only_a} images right only in A, {only_b} only in B, p = {expected:.4g}" in capsys.readouterr().out
    with pytest.raises(ConfigError, match=r"classifier.s scores\. Pass --metric acc"):
        paired_test(runs[0], runs[1], metric="miou")
