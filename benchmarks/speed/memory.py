"""Memory: fedlight's resident memory must not grow with rounds, nor with clients beyond their data.

Two measurements, each in a fresh process:

1. **Rounds.** Workload (a) (Synthetic(1,1), MLP, 10 clients per round, F = 20, batch 10) for 200
   rounds. After every round the process's resident memory (``VmRSS``) is read; at round 10 and at the
   last round the live tensors are counted too. No per-client state may pile up: RSS at round 200 ≈ RSS
   at round 10.
2. **Clients.** The MNIST protocol (PowerLaw, two classes per client, one base sample) on the digits
   pool, with 100 and with 1000 clients, 2-conv CNN, 10 clients per round, F = 20, 20 rounds. Both
   partitions hold the same pool: scikit-learn's 1,797 digits repeated 4 times (7,188 images), since
   1000 clients × 2 classes need more than the ~180 images per class of one copy. The peak RSS of the
   two runs may differ only by the clients' index vectors.

    python benchmarks/speed/memory.py                 # 200 rounds; 100 vs 1000 clients
    python benchmarks/speed/memory.py --rounds 30     # a quicker look
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
COPIES = 4


def status_mb(field: str) -> float:
    """``VmRSS`` (resident now) or ``VmHWM`` (peak resident) of this process, in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def live_tensors() -> tuple[int, float]:
    """Number and MiB of the tensors the garbage collector can see."""
    gc.collect()
    tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.device.type == "cpu"}
    return len(tensors), sum(storages.values()) / 2**20


def run_child(args: argparse.Namespace) -> dict:
    from fedlight.callbacks.base import RoundCallback
    from fedlight.clients import ClassificationClient
    from fedlight.data import Digits, FederatedDataModule, LabelledTensors, Synthetic
    from fedlight.data.partition import PowerLaw
    from fedlight.engine.trainer import FederatedTrainer
    from fedlight.strategies import FedAvg

    class TiledDigits(Digits):
        """The digits pool repeated, so that 1000 two-class clients fit the MNIST protocol."""

        def load_train(self) -> LabelledTensors:
            pool = super().load_train()
            return LabelledTensors(pool.inputs.repeat(COPIES, 1, 1, 1), pool.targets.repeat(COPIES))

    class Probe(RoundCallback):
        def __init__(self) -> None:
            self.rss: list[float] = []
            self.tensors: dict[int, tuple[int, float]] = {}

        def on_fit_start(self, context) -> None:
            self.start_rss = status_mb("VmRSS")

        def on_round_end(self, context, round_idx, metrics) -> None:
            if round_idx + 1 in (10, args.rounds):
                self.tensors[round_idx + 1] = live_tensors()

        def on_round_start(self, context, round_idx) -> None:
            if round_idx > 0:
                self.rss.append(status_mb("VmRSS"))  # after round_idx − 1, its log and checkpoint included

        def on_fit_end(self, context) -> None:
            self.rss.append(status_mb("VmRSS"))

    torch.set_num_threads(1)
    torch.manual_seed(0)
    if args.child == "rounds":
        data = FederatedDataModule(Synthetic(alpha=1.0, beta=1.0), batch_size=10)
        model = ClassificationClient(num_classes=10, input_shape=(60,), model="mlp")
    else:
        partitioner = PowerLaw(num_clients=args.clients, classes_per_client=2, base_samples=1)
        data = FederatedDataModule(TiledDigits(), partitioner, batch_size=10)
        model = ClassificationClient(num_classes=10, input_shape=(1, 8, 8), model="cnn")
    probe = Probe()
    with tempfile.TemporaryDirectory() as root:
        trainer = FederatedTrainer(
            rounds=args.rounds,
            clients_per_round=10,
            local_epochs=20,
            default_root_dir=root,
            logger="csv",
            enable_progress_bar=False,
            callbacks=[probe],
            seed=0,
        )
        trainer.fit(model, data, FedAvg())
    index_bytes = sum(ix.numel() * ix.element_size() for ix in data.client_train)
    index_bytes += data.held_out_index.numel() * 8 + data.held_out_group.numel() * 8
    pool_bytes = data.pool.inputs.numel() * 4 + data.pool.targets.numel() * 8
    return {
        "clients": data.num_clients,
        "pool_samples": len(data.pool),
        "pool_mb": pool_bytes / 2**20,
        "index_mb": index_bytes / 2**20,
        "start_rss_mb": probe.start_rss,
        "rss_mb": probe.rss,
        "tensors": probe.tensors,
        "peak_rss_mb": status_mb("VmHWM"),
    }


def launch(script: str, mode: str, rounds: int, clients: int, out: Path) -> dict:
    result = out / f"memory_{mode}_{clients}.json"
    command = [sys.executable, script, "--child", mode, "--rounds", str(rounds), "--clients", str(clients)]
    command += ["--result", str(result)]
    env_log = out / f"memory_{mode}_{clients}.log"
    with env_log.open("w") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT)
    return json.loads(result.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=200, help="rounds of the first measurement")
    parser.add_argument("--client-rounds", type=int, default=20, help="rounds of each run of the second")
    parser.add_argument("--out", type=Path, default=HERE / "out")
    parser.add_argument("--child", choices=["rounds", "clients"], help=argparse.SUPPRESS)
    parser.add_argument("--clients", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        Path(args.result).write_text(json.dumps(run_child(args)))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    summary: dict = {}

    by_rounds = launch(__file__, "rounds", args.rounds, 0, args.out)
    rss = by_rounds["rss_mb"]
    at10, last = rss[min(9, len(rss) - 1)], rss[-1]
    tensors = {int(k): v for k, v in by_rounds["tensors"].items()}
    print(f"(a) Synthetic(1,1) MLP, {args.rounds} rounds: RSS at fit start {by_rounds['start_rss_mb']:.1f} MiB")
    print(f"    RSS after round 10: {at10:.1f} MiB, after round {args.rounds}: {last:.1f} MiB ({last - at10:+.1f} MiB)")
    print(f"    largest RSS after any round ≥ 10: {max(rss[9:] or rss):.1f} MiB")
    print(f"    peak RSS: {by_rounds['peak_rss_mb']:.1f} MiB")
    for round_idx, (count, mb) in sorted(tensors.items()):
        print(f"    live tensors after round {round_idx}: {count} ({mb:.2f} MiB of CPU storage)")
    summary["rounds"] = by_rounds | {"rss_round_10_mb": at10, "rss_last_mb": last}

    by_clients = {n: launch(__file__, "clients", args.client_rounds, n, args.out) for n in (100, 1000)}
    small, large = by_clients[100], by_clients[1000]
    print(f"\n(b) digits ×{COPIES} ({small['pool_samples']} images, {small['pool_mb']:.2f} MiB), MNIST protocol, CNN, ")
    print(f"    {args.client_rounds} rounds, 10 clients/round, F = 20:")
    for n, run in by_clients.items():
        print(
            f"    {n:>5} clients: RSS at fit start {run['start_rss_mb']:.1f} MiB, after the last round "
            f"{run['rss_mb'][-1]:.1f} MiB, peak {run['peak_rss_mb']:.1f} MiB; index vectors {run['index_mb']:.3f} MiB"
        )
    growth = large["peak_rss_mb"] - small["peak_rss_mb"]
    print(
        f"    1000 − 100 clients: peak RSS {growth:+.1f} MiB; index vectors "
        f"{large['index_mb'] - small['index_mb']:+.3f} MiB"
    )
    summary["clients"] = {str(n): run for n, run in by_clients.items()}
    (args.out / "memory.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
