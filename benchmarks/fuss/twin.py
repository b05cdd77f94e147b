"""FUSS end to end on the offline street-scene twin: FedAvg vs FedCC and Table 4's aggregation ablation.

Every run is the whole FUSS pipeline through the engine: a frozen patch-8 backbone whose features are cached
per client with their kNN lists (:class:`~fedlight.callbacks.BackboneFeatureCache`), STEGO's head, centroids
and linear probe trained with three Adams on every client (:class:`~fedlight.clients.UnsupervisedSegmentationClient`),
and the server of :class:`~fedlight.strategies.FedCC`. Clients are cities of :class:`~fedlight.data.StreetScenes`
with their own palettes, textures and class frequencies; the test set comes from further cities.

The backbone is a small ViT with patch 8, randomly initialised (no DINO weights can be had here): its features
separate classes only weakly, so absolute scores are far below the paper's and only orderings can be compared.
All its patch features lie near one common direction (cosine ≈ 0.8 between any two), which makes every code
collapse onto one cluster; the mean feature over the pooled training patches is therefore subtracted once, as
a frozen part of the backbone (``PatchFeatures.center``). STEGO's shifts b are then re-measured for it: b_self,
b_knn and b_rand are the mean correlations of the three pairings on 64 training images, b_rand raised by 0.05
so that random pairs are pushed apart (STEGO tunes b per dataset in the same spirit).

    python benchmarks/fuss/twin.py             # the README's table (about 5 minutes on two busy CPU cores)
    python benchmarks/fuss/twin.py --reduced   # CI: 12 classes, 3 cities, 2 rounds
"""

from __future__ import annotations

import argparse
import time

import torch

from fedlight.callbacks import BackboneFeatureCache
from fedlight.clients import UnsupervisedSegmentationClient
from fedlight.clients.stego import _correlation, sample_at, sample_coordinates
from fedlight.data import FederatedDataModule, StreetScenes
from fedlight.data.knn import knn_indices
from fedlight.models.patch_features import build_patch_backbone
from fedlight.state import FlatState
from fedlight.strategies import FedCC
from fedlight.trainer import FederatedTrainer


@torch.no_grad()
def measured_shifts(dataset: StreetScenes, backbone: torch.nn.Module, samples: int, margin: float = 0.05) -> dict:
    """b of the three pairings: their mean feature correlation on (up to) 64 training images, b_rand + ``margin``."""
    images = dataset.load_train().inputs[:64]
    feats = backbone.eval()(images)  # [n, C, h, w], n ≤ 64
    n = len(feats)
    partner = knn_indices(feats.mean(dim=(2, 3)), 2)[:, 1]
    generator = torch.Generator().manual_seed(0)
    c1, c2 = sample_coordinates(n, samples, generator), sample_coordinates(n, samples, generator)
    anchor = sample_at(feats, c1)
    pairs = {
        "b_self": anchor,
        "b_knn": sample_at(feats[partner], c2),
        "b_rand": sample_at(feats[torch.randperm(n, generator=generator)], c2),
    }
    shifts = {key: round(_correlation(anchor, other).mean().item(), 4) for key, other in pairs.items()}
    shifts["b_rand"] = round(shifts["b_rand"] + margin, 4)
    return shifts


def run(args, dataset, shifts, center, strategy: FedCC, cache_dir: str) -> tuple[dict, FederatedTrainer]:
    data = FederatedDataModule(dataset, batch_size=8, test_fraction=0.0, return_index=True, eval_batch_size=64)
    torch.manual_seed(args.seed)  # one initial model (and backbone) for every rule
    model = UnsupervisedSegmentationClient(
        num_classes=dataset.num_classes,
        input_shape=dataset.input_shape,
        backbone="vit_tiny_patch8",
        pretrained=args.pretrained,
        correspondence=shifts,
        feature_samples=args.samples,
    )
    model.backbone.center.copy_(center)
    trainer = FederatedTrainer(
        rounds=args.rounds,
        clients_per_round=args.cities,
        local_steps=args.steps,
        logger=None,
        enable_progress_bar=False,
        default_root_dir=f"{cache_dir}/runs",
        eval_every=args.rounds,
        seed=args.seed,
        callbacks=[BackboneFeatureCache(directory=cache_dir)],
    )
    return trainer.fit(model, data, strategy), trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reduced", action="store_true", help="CI size: 12 classes, 3 cities, 2 rounds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache", default="/tmp/fedlight-fuss-twin", help="where features and runs go")
    parser.add_argument("--steps", type=int, default=None, help="local batches per round (default 20; 8 reduced)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 3; 2 reduced)")
    parser.add_argument("--main-rows-only", action="store_true", help="only the three W+E+C rows")
    parser.add_argument("--pretrained", default=None, help="weights of the small ViT (pretrain_tiny_vit.py)")
    args = parser.parse_args()
    steps, rounds = args.steps, args.rounds
    torch.set_num_threads(1)
    if args.reduced:
        args.classes, args.cities, args.images, args.rounds, args.steps, args.size = 12, 3, 16, 2, 8, 32
    else:
        args.classes, args.cities, args.images, args.rounds, args.steps, args.size = 27, 6, 40, 3, 20, 32
    args.steps, args.rounds = steps or args.steps, rounds or args.rounds
    args.samples = 7
    dataset = StreetScenes(
        num_classes=args.classes,
        num_cities=args.cities,
        images_per_city=args.images,
        num_test_samples=15 * args.cities,
        image_size=args.size,
        seed=args.seed,
    )
    torch.manual_seed(args.seed)
    backbone = build_patch_backbone("vit_tiny_patch8", args.size).eval()  # the runs' backbone: same seed
    if args.pretrained is not None:
        backbone.load_pretrained(args.pretrained)
    with torch.no_grad():
        center = backbone(dataset.load_train().inputs).mean(dim=(0, 2, 3))  # [C] over every training patch
    backbone.center.copy_(center)
    shifts = measured_shifts(dataset, backbone, args.samples)
    setting = f"{args.classes} classes, {args.cities} cities × {args.images} images of {args.size}²"
    print(f"{setting}, {args.rounds} rounds × {args.steps} batches of 8; measured shifts {shifts}")

    rows = {
        "FedAvg (W+E+C)": FedCC(centroids="average"),
        "FedCC-kMeans (W+E+C)": FedCC(centroids="kmeans"),
        "FedCC-Maximin (W+E+C)": FedCC(centroids="maximin"),
    }
    for rule, name in (
        [] if args.main_rows_only else [("average", "FedAvg"), ("kmeans", "FedCC-kMeans"), ("maximin", "FedCC-Maximin")]
    ):
        rows[f"{name} (E)"] = FedCC(centroids=rule, aggregated="encoder")
        rows[f"{name} (C)"] = FedCC(centroids=rule, aggregated="centroids")
    print("\n| run | mIoU % | acc % | linear mIoU % | time s |\n|---|---|---|---|---|")
    trainer = None
    for name, strategy in rows.items():
        started = time.perf_counter()
        metrics, trainer = run(args, dataset, shifts, center, strategy, args.cache)
        scores = [100 * metrics[f"test/{key}"] for key in ("miou", "acc", "linear/miou")]
        seconds = time.perf_counter() - started
        print(f"| {name} | {scores[0]:.2f} | {scores[1]:.1f} | {scores[2]:.2f} | {seconds:.0f} |", flush=True)

    cache = trainer.callbacks[0].cache
    print(f"\nfeature cache: {cache.nbytes / 2**20:.2f} MiB for {len(cache.stores)} clients "
          f"({cache.client_nbytes(0) / 2**10:.1f} KiB for client 0); aggregation buffers: "
          f"{trainer.aggregation_nbytes / 2**10:.1f} KiB")  # fmt: skip
    dino = UnsupervisedSegmentationClient(27, (3, 224, 224), pretrained="unused")  # ViT-B/8, weights not drawn
    layout = FlatState(dino, dino.frozen_modules)
    per_image = 768 * 28 * 28 * 2
    print(f"DINO ViT-B/8 setting: {layout.numel:,} federated entries (head, centroids, probe) → "
          f"{(12 * layout.numel + 8) / 2**20:.2f} MiB of aggregation buffers per round; cached features "
          f"{per_image / 2**20:.2f} MiB per 224² crop (fp16)")  # fmt: skip


if __name__ == "__main__":
    main()
