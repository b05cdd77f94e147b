"""Time per round and peak memory of LADD with CrossCity's number of clients (472), on the style-cities twin.

The clients are the twin's (118 per city, 17–37 images each, like CrossCity's 27 ± 10); every teacher is live
(the KD teacher, a pseudo-label teacher and an SWA teacher per cluster, from round 1 on). Reported: the time to
compute the 472 client styles and choose the clusters (the strategy's ``on_fit_start``), the median time of a
round (4 clients and the evaluation of the global and routed models), the bytes of the aggregation buffers and of
the teachers, and the process's peak resident memory (and peak GPU memory on CUDA)::

    python benchmarks/ladd/scale.py                                   # mini_deeplab, 32×32, CPU
    python benchmarks/ladd/scale.py --model deeplabv3_mobilenetv2 --image-size 512 --accelerator cuda
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile
import time

import torch

from fedlight.clients import SelfTrainingClient
from fedlight.data import FederatedDataModule, StyleCities
from fedlight.engine.trainer import FederatedTrainer
from fedlight.strategies import LADD


class TimedLADD(LADD):
    """LADD that records how long finding the style clusters took."""

    def on_fit_start(self, context) -> None:
        started = time.perf_counter()
        super().on_fit_start(context)
        self.fit_start_seconds = time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mini_deeplab")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--clients-per-city", type=int, default=118)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--cluster-layers", default="all")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    size = args.image_size
    data = FederatedDataModule(
        StyleCities(num_clients_per_city=args.clients_per_city, num_test_per_city=10, image_size=size),
        batch_size=args.batch_size, test_fraction=0.0, drop_last=True, eval_batch_size=8,
    )  # fmt: skip
    torch.manual_seed(0)
    model = SelfTrainingClient(num_classes=6, input_shape=(3, size, size), model=args.model)
    strategy = TimedLADD(cluster_layers=args.cluster_layers, fda_size=(size, size), teacher_step=1, swa_start=1)
    with tempfile.TemporaryDirectory() as root:
        trainer = FederatedTrainer(
            rounds=args.rounds, clients_per_round=4, local_epochs=1, logger="csv", enable_progress_bar=False,
            default_root_dir=root, accelerator=args.accelerator, checkpoint_every=args.rounds,
        )  # fmt: skip
        started = time.perf_counter()
        trainer.fit(model, data, strategy)
        total = time.perf_counter() - started
    rounds = [h["round/time_s"] for h in trainer.history]
    result = {
        "model": args.model,
        "image_size": size,
        "clients": data.num_clients,
        "clusters": trainer.model.bank.num_clusters,
        "parameters": trainer.model.layout.numel,
        "styles_and_clustering_s": round(strategy.fit_start_seconds, 2),
        "round_s_median": round(statistics.median(rounds), 3),
        "round_s_all": [round(r, 3) for r in rounds],
        "fit_s": round(total, 1),
        "aggregation_MiB": round(trainer.run.pieces.fits.aggregation_nbytes / 2**20, 1),
        "bank_MiB": round(trainer.model.bank.clusters.nbytes / 2**20, 1),
        "teachers_MiB": round(sum(t.nbytes for t in strategy.teachers.states.values()) / 2**20, 1),
        "peak_rss_MiB": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    if args.accelerator == "cuda":
        result["peak_cuda_MiB"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        result["device"] = torch.cuda.get_device_name()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
