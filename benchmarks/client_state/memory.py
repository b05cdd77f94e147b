"""Memory of the per-client store: peak resident memory against its budget, with many clients of a model-sized state.

Every client keeps one vector slot as large as the federated state of CIFAR-10's ResNet-18 (``resnet18``, 10
classes, as in ``conf/fedsls/cifar10``; ``--scale`` divides it): SCAFFOLD's c_k or Ditto's v_k. The benchmark
drives :class:`~fedlight.client_state.ClientStateStore` as the engine does, round after round: each of the
round's clients reads its state (from memory or from its file), changes it, writes it back, and the round commits;
every round ends with a checkpoint's clean-up, so the folder holds one file per client. ``--passes`` 2 makes every
client train twice, so that the second pass reads states evicted long before. Each setting runs in a fresh
process; its peak resident memory is reset when the rounds start (Linux's ``/proc/self/clear_refs``) and read
at their end (``VmHWM``), and the resident memory before the rounds (torch, one state and its copy) is subtracted
from it and compared with the budget. The values read back are checked against the number of fits of each client.

    python benchmarks/client_state/memory.py                          # 1,000 clients of ResNet-18 (44 GB on disk)
    python benchmarks/client_state/memory.py --clients 1000 --scale 16 --budgets 64 512
    python benchmarks/client_state/memory.py --reduced                # < 1 min: 100 clients at 1/64 size
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def resnet18_numel() -> int:
    sys.path.insert(0, str(REPO))
    from fedlight.models import create_model
    from fedlight.state import FlatState

    return FlatState(create_model("resnet18", input_shape=(3, 32, 32), num_classes=10)).numel


def _status_kb(field: str) -> int:
    """A ``/proc/self/status`` memory field, in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def one(numel: int, clients: int, per_round: int, passes: int, budget_mb: float, root: str) -> dict:
    import numpy as np
    import torch

    sys.path.insert(0, str(REPO))
    from fedlight.client_state import ClientStateStore, Slot

    torch.set_num_threads(1)
    store = ClientStateStore(
        {"control": Slot.vector(numel)}, Path(root) / "client_state", int(budget_mb * 2**20), clients
    )
    start = torch.zeros(numel)
    store.values(0, start)  # one state in hand, as during a fit
    Path("/proc/self/clear_refs").write_text("5")  # the peak resident memory restarts from the current one
    before = _status_kb("VmRSS") * 1024
    order = np.concatenate([np.random.default_rng(p).permutation(clients) for p in range(passes)])
    started = time.perf_counter()
    for version, first in enumerate(range(0, len(order), per_round), start=1):
        chosen = order[first : first + per_round]
        for client in chosen:
            values = store.values(int(client), start)
            values["control"] += 1.0  # a fit: one more round trained
            store.put(int(client), version, values)
        store.commit(chosen.tolist(), version)
        store.saved()  # a checkpoint every round: superseded files go
    seconds = time.perf_counter() - started
    checked = [int(k) for k in np.random.default_rng(0).choice(clients, size=min(clients, 20), replace=False)]
    assert all(bool((store.get(k)["control"] == passes).all()) for k in checked), "a state read back is wrong"
    peak = _status_kb("VmHWM") * 1024
    disk = sum(path.stat().st_size for path in store.directory.iterdir())
    return {
        "numel": numel,
        "clients": clients,
        "fits": len(order),
        "budget_mb": budget_mb,
        "state_mb": 4 * numel / 2**20,
        "all_states_mb": clients * 4 * numel / 2**20,
        "peak_cache_mb": store.peak_cache_nbytes / 2**20,
        "rss_before_mb": before / 2**20,
        "peak_rss_mb": peak / 2**20,
        "disk_mb": disk / 2**20,
        "ms_per_fit": 1000 * seconds / len(order),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--per-round", type=int, default=10)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--scale", type=int, default=1, help="divide the ResNet-18 state's size by this")
    parser.add_argument("--budgets", type=float, nargs="+", default=[256.0, 1024.0], help="MiB")
    parser.add_argument("--root", default=None, help="where the states are written (a temporary folder)")
    parser.add_argument("--reduced", action="store_true", help="100 clients at 1/64 of the size")
    parser.add_argument("--one", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        numel, clients, per_round, passes = (int(v) for v in args.one[:4])
        print(json.dumps(one(numel, clients, per_round, passes, float(args.one[4]), args.one[5])))
        return
    if args.reduced:
        args.clients, args.scale, args.budgets = 100, 64, [8.0, 64.0]
    numel = resnet18_numel() // args.scale
    print(f"{args.clients} clients, a state of {numel:,} fp32 values ({4 * numel / 2**20:.1f} MiB) each")
    print("| budget (MiB) | all states (MiB) | fits | peak cache (MiB) | RSS before (MiB) | peak RSS (MiB) | "
          "peak − before (MiB) | on disk (MiB) | ms per fit |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for budget in args.budgets:
        root = tempfile.mkdtemp(dir=args.root)
        try:
            command = [sys.executable, __file__, "--one", str(numel), str(args.clients), str(args.per_round)]
            command += [str(args.passes), str(budget), root]
            done = subprocess.run(command, check=True, capture_output=True, text=True)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        r = json.loads(done.stdout.strip().splitlines()[-1])
        growth = r["peak_rss_mb"] - r["rss_before_mb"]
        cells = [f"{budget:g}", f"{r['all_states_mb']:.0f}", str(r["fits"]), f"{r['peak_cache_mb']:.0f}"]
        cells += [f"{r['rss_before_mb']:.0f}", f"{r['peak_rss_mb']:.0f}", f"{growth:.0f}", f"{r['disk_mb']:.0f}"]
        cells += [f"{r['ms_per_fit']:.1f}"]
        print("| " + " | ".join(cells) + " |", flush=True)
        assert r["peak_cache_mb"] <= budget, f"the cache exceeded its budget: {r}"


if __name__ == "__main__":
    main()
