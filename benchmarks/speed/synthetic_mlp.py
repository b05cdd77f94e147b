"""FedAvg on Synthetic(1,1): fedlight against a plain PyTorch loop, same workload, one process.

The workload is the prototype-margin paper's Synthetic setting: 30 clients, MLP 60→128→256→10, SGD
lr 0.01, 10 clients per round sampled ∝ n_k, F = 20 local epochs, batch 10, evaluation of the global
model on the clients' held-out splits every round. Tiny steps make it overhead-bound: the hardest case
for a framework.

The plain loop is what the hardware does with no framework: tensors sliced into batches, a model, SGD,
a weighted sum. It draws the same clients, batch orders and initial weights as fedlight, so both end
with the same global model; the script checks that, then prints the time ratio (target ≤ 1.10).

    python benchmarks/speed/synthetic_mlp.py              # 20 rounds, 2 repeats (the README's numbers)
    python benchmarks/speed/synthetic_mlp.py --rounds 3   # the reduced run CI does
"""

from __future__ import annotations

import argparse
import copy
import platform
import tempfile
import time

import lightning
import numpy as np
import torch
import torch.nn.functional as F

from fedlight.clients import ClassificationClient
from fedlight.data import FederatedDataModule, Synthetic
from fedlight.strategies import FedAvg
from fedlight.trainer import FederatedTrainer

CLIENTS_PER_ROUND, LOCAL_EPOCHS, BATCH, LR, SEED = 10, 20, 10, 0.01, 0


def make_data() -> FederatedDataModule:
    data = FederatedDataModule(Synthetic(alpha=1.0, beta=1.0), batch_size=BATCH)
    data.setup()
    return data


def make_model() -> ClassificationClient:
    lightning.seed_everything(SEED, verbose=False)
    return ClassificationClient(num_classes=10, input_shape=(60,), model="mlp")


def run_fedlight(rounds: int) -> torch.Tensor:
    with tempfile.TemporaryDirectory() as root:
        trainer = FederatedTrainer(
            rounds=rounds,
            clients_per_round=CLIENTS_PER_ROUND,
            local_epochs=LOCAL_EPOCHS,
            checkpoint_every=rounds,
            default_root_dir=root,
            logger=None,
            enable_progress_bar=False,
        )
        trainer.fit(make_model(), make_data(), FedAvg())
    return trainer.global_state


def run_plain(rounds: int) -> torch.Tensor:
    """FedAvg written directly in PyTorch, drawing the same random numbers as fedlight."""
    data = make_data()
    x, y = data.pool.inputs, data.pool.targets
    train = data.client_train
    sizes = data.num_samples.astype(np.float64)
    eval_x, eval_y = x[data.held_out_index], y[data.held_out_index]
    net = make_model().net
    global_state = copy.deepcopy(net.state_dict())
    for round_idx in range(rounds):
        rng = np.random.default_rng(np.random.SeedSequence(SEED, spawn_key=(0, round_idx)))
        clients = np.sort(rng.choice(len(sizes), CLIENTS_PER_ROUND, replace=False, p=sizes / sizes.sum()))
        total = {name: torch.zeros_like(value) for name, value in global_state.items()}
        for client in clients:
            seed = np.random.SeedSequence(SEED, spawn_key=(1, round_idx, int(client))).generate_state(1, np.uint64)
            seed = int(seed[0] >> 1)
            torch.manual_seed(seed)
            generator = torch.Generator().manual_seed(seed)
            net.load_state_dict(global_state)
            optimizer = torch.optim.SGD(net.parameters(), lr=LR)
            for _ in range(LOCAL_EPOCHS):
                order = train[client][torch.randperm(len(train[client]), generator=generator)]
                for start in range(0, len(order), BATCH):
                    batch = order[start : start + BATCH]
                    loss = F.cross_entropy(net(x[batch]), y[batch])
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()
            with torch.no_grad():
                for name, value in net.state_dict().items():
                    total[name] += sizes[client] * value
        global_state = {name: value / sizes[clients].sum() for name, value in total.items()}
        net.load_state_dict(global_state)
        with torch.no_grad():  # the same per-round evaluation fedlight does
            for start in range(0, len(eval_y), 1024):
                logits = net(eval_x[start : start + 1024])
                F.cross_entropy(logits, eval_y[start : start + 1024], reduction="none")
                (logits.argmax(1) == eval_y[start : start + 1024]).sum()
    return torch.cat([value.reshape(-1) for value in global_state.values()])


def timed(fn, rounds: int) -> tuple[float, torch.Tensor]:
    started = time.perf_counter()
    result = fn(rounds)
    return time.perf_counter() - started, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2, help="alternating runs of each; the fastest counts")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads for both")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    times = {"fedlight": [], "plain": []}
    for _ in range(args.repeats):
        for name, fn in [("plain", run_plain), ("fedlight", run_fedlight)]:
            seconds, state = timed(fn, args.rounds)
            times[name].append(seconds)
            if name == "plain":
                plain_state = state
            else:
                fedlight_state = state
    difference = (plain_state - fedlight_state).abs().max().item()
    best = {name: min(values) for name, values in times.items()}
    ratio = best["fedlight"] / best["plain"]
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} thread(s)")
    print(f"workload: Synthetic(1,1), {args.rounds} rounds, {CLIENTS_PER_ROUND} clients/round, F={LOCAL_EPOCHS}")
    for name in ("plain", "fedlight"):
        per_round = 1e3 * best[name] / args.rounds
        runs = ", ".join(f"{t:.2f}" for t in times[name])
        print(f"{name:>9}: {best[name]:7.2f} s  ({per_round:6.1f} ms/round; runs: {runs})")
    print(f"fedlight / plain = {ratio:.3f}  (target ≤ 1.10)")
    print(f"max |Δ| between the two final global models = {difference:.2e}")
    assert difference < 1e-5, "the two loops did not run the same workload"


if __name__ == "__main__":
    main()
