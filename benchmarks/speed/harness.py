"""One federated workload, three engines: fedlight, a plain PyTorch loop (the floor) and Flower.

Every workload script (``synthetic_mlp.py``, ``digits_cnn.py``, ``scenes_deeplab.py``) describes its
workload with a :class:`Workload` and calls :func:`main`. The parent process then builds the data once
through fedlight, exports it, and starts one child process per run, alternating engines:

- ``floor``: FedAvg written directly in PyTorch: tensors sliced into batches, one model, SGD, a
  weighted sum, the same evaluation. What the hardware does with no framework.
- ``fedlight``: ``FederatedTrainer.fit`` as a user runs it (CSV log every round, a checkpoint every
  10 rounds), with 1 or 2 processes (``devices``).
- ``batched``: the same ``fit`` with the round's clients trained as one vectorised model
  (``client_batching=1024``, ``compile_batched=True``), 1 process. Its clients run no timing hooks (a
  hook on the client's module would stop the vectorisation), so its time outside local training is not
  split out.
- ``compiled``: the same ``fit`` as ``fedlight``, one process, with ``compile_steps=True``: each client's
  whole step (forward, loss, backward, SGD update) one compiled graph.
- ``flower``: Flower's simulation engine (``flwr.simulation.run_simulation``, Ray backend) with 1 or 2
  actors, written as a careful Flower user would (one resident model and the data cached per actor,
  server-side evaluation of the same held-out data). It runs under the Python interpreter given by
  ``--flower-python``, so Flower's pinned dependencies live in their own environment.

All three draw the same clients, the same batch orders and the same initial weights, so the floor
and fedlight end with the same global model; the parent checks that. Each child reports its loop
time, per-round times, the local training time on the critical path and the evaluation time; the
parent measures the whole process (interpreter start to exit, Ray included) and the peak resident
memory of the child's whole process tree.

The time outside local training of a round is its wall time minus the largest per-worker sum of
local training (the inner epochs × batches loop) in that round: sampling, broadcast, model loading,
optimizer creation, messaging, aggregation, evaluation, logging and checkpointing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
SEED = 0
CHECKPOINT_EVERY = 10
# Stream tags of fedlight's seed sequences (fedlight/engine/trainer.py), so every engine draws the same numbers.
_ROUND_STREAM, _CLIENT_STREAM = 0, 1

PFL_INSTALL = (
    "pip install --target .venv-pfl/site --no-deps pfl==0.6.0 'multiprocess>=0.70.15,<0.71' "
    "'prv-accountant>=0.2,<0.3' 'dp-accounting>=0.4,<0.6'"
)
FLOWER_INSTALL = (
    "python -m venv .venv-flower && .venv-flower/bin/pip install torch==2.14.1 torchvision==0.29.1 "
    '"flwr[simulation]==1.41.*" -e .'
)

ENGINES = ("floor", "fedlight", "batched", "compiled", "flower", "pfl")
Engine = Literal["floor", "fedlight", "batched", "compiled", "flower", "pfl"]


@dataclass(frozen=True)
class Workload:
    """A federated workload, identical for every engine.

    Attributes:
        name: file stem of the results (``out/<name>.json``).
        title: one line describing it in the report.
        task: ``classification`` (cross-entropy, accuracy per client) or ``segmentation``
            (pixel cross-entropy ignoring label 255, confusion matrix).
        make_datamodule: builds fedlight's ``FederatedDataModule`` (not yet set up).
        make_client: builds fedlight's client module with the initial weights W^0 (seeded inside).
        clients_per_round: K' clients per round, sampled ∝ n_k.
        local_epochs: F.
        lr: learning rate of every client's optimizer, re-created every round.
        rounds: rounds of the full-size run.
        reduced_rounds: rounds of the reduced run (``--reduced``, what CI does).
        num_classes: classes of the segmentation confusion matrix (unused for classification).
        optimizer: ``sgd`` or ``adam``; ``make_client`` must configure the same.
        weight_decay: the optimizer's weight decay.
        poly_power: polynomial learning-rate decay over the run, per step, as the segmentation client's
            (0: constant rate).
    """

    name: str
    title: str
    task: Literal["classification", "segmentation"]
    make_datamodule: Callable[[], Any]
    make_client: Callable[[], Any]
    clients_per_round: int
    local_epochs: int
    lr: float
    rounds: int
    reduced_rounds: int
    num_classes: int = 0
    optimizer: Literal["sgd", "adam"] = "sgd"
    weight_decay: float = 0.0
    poly_power: float = 0.0


# -- data shared by the floor and Flower --------------------------------------------------------------
@dataclass
class Exported:
    """The workload as plain tensors: what the floor and the Flower clients read (no fedlight import)."""

    inputs: torch.Tensor  # [N, ...] the pool
    targets: torch.Tensor  # [N] or [N, H, W]
    client_train: list[torch.Tensor]  # index vectors into the pool, one per client
    num_samples: np.ndarray  # [clients] n_k
    held_out_index: torch.Tensor  # [M] every client's held-out samples, client by client
    held_out_group: torch.Tensor  # [M] the client each held-out sample belongs to
    num_groups: int
    eval_batch_size: int
    batch_size: int
    net: torch.nn.Module  # the initial model W^0
    task: str
    num_classes: int

    def to(self, device: torch.device, channels_last: bool = False) -> Exported:
        self.inputs, self.targets = self.inputs.to(device), self.targets.to(device)
        self.client_train = [ix.to(device) for ix in self.client_train]
        self.held_out_index, self.held_out_group = self.held_out_index.to(device), self.held_out_group.to(device)
        self.net = self.net.to(device)
        if channels_last:  # what FederatedTrainer(channels_last=True) does to the resident model
            self.net = self.net.to(memory_format=torch.channels_last)
        return self


def export(work: Workload, path: Path) -> None:
    """Builds the workload through fedlight and writes it as plain tensors for the other engines."""
    data = work.make_datamodule()
    data.setup()
    client = work.make_client()
    exported = Exported(
        inputs=data.pool.inputs,
        targets=data.pool.targets,
        client_train=data.client_train,
        num_samples=data.num_samples,
        held_out_index=data.held_out_index,
        held_out_group=data.held_out_group,
        num_groups=data.num_eval_groups,
        eval_batch_size=data.eval_batch_size,
        batch_size=data.batch_size,
        net=client.net,
        task=work.task,
        num_classes=work.num_classes,
    )
    torch.save(exported.__dict__, path)


def load_exported(path: str | Path, device: torch.device, channels_last: bool = False) -> Exported:
    return Exported(**torch.load(path, weights_only=False)).to(device, channels_last)


# -- randomness, as fedlight derives it ------------------------------------------------------------
def round_clients(num_samples: np.ndarray, k: int, round_idx: int) -> list[int]:
    """The round's clients: k draws ∝ n_k without replacement from the round's generator, sorted."""
    rng = np.random.default_rng(np.random.SeedSequence(SEED, spawn_key=(_ROUND_STREAM, round_idx)))
    p = num_samples / num_samples.sum()
    return np.sort(rng.choice(len(num_samples), size=k, replace=False, p=p)).tolist()


def client_seed(round_idx: int, client: int) -> int:
    sequence = np.random.SeedSequence(SEED, spawn_key=(_CLIENT_STREAM, round_idx, client))
    return int(sequence.generate_state(1, dtype=np.uint64)[0] >> 1)


# -- the floor's pieces, also used inside Flower's clients ----------------------------------------------
def synchronize(device: torch.device) -> None:
    """Waits for queued GPU work, so that a clock read after it is honest."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def autocast(device: torch.device, precision: str):
    """The floor's equivalent of Fabric's precision plugin: autocast for ``*-mixed``, nothing for ``32-true``."""
    if precision == "32-true":
        return contextlib.nullcontext()
    dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}[precision]
    return torch.autocast(device.type, dtype=dtype)


def task_loss(task: str, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if task == "segmentation":  # mean over the pixels that are not void (255)
        return F.cross_entropy(logits, target, ignore_index=255, reduction="sum") / (target != 255).sum().clamp(min=1)
    return F.cross_entropy(logits, target)


@dataclass(frozen=True)
class Optimization:
    """What a client's optimizer needs, as plain values that travel in Flower's messages."""

    epochs: int
    lr: float
    optimizer: str = "sgd"
    weight_decay: float = 0.0
    poly_power: float = 0.0
    rounds: int = 1

    @classmethod
    def of(cls, work: Workload, rounds: int) -> Optimization:
        return cls(work.local_epochs, work.lr, work.optimizer, work.weight_decay, work.poly_power, rounds)


def local_fit(
    data: Exported, client: int, round_idx: int, opt: Optimization, device: torch.device, precision: str
) -> float:
    """Trains ``data.net`` (already holding the received state) on one client; returns the loop's seconds."""
    net = data.net
    seed = client_seed(round_idx, client)
    torch.default_generator.manual_seed(seed)  # dropout and any other draw inside the step, as fedlight seeds
    if device.type != "cpu":
        getattr(torch, device.type).manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)  # batch order, drawn on the CPU as fedlight does
    net.train()
    indices = data.client_train[client]
    if opt.optimizer == "adam":
        optimizer = torch.optim.Adam(net.parameters(), lr=opt.lr, weight_decay=opt.weight_decay)
    else:
        optimizer = torch.optim.SGD(net.parameters(), lr=opt.lr, weight_decay=opt.weight_decay)
    scheduler = None
    if opt.poly_power > 0:  # lr_0 · (1 − (t + s/S)/T)^p at step s of S in round t of T
        num_steps = opt.epochs * math.ceil(len(indices) / data.batch_size)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda step: max(0.0, 1.0 - (round_idx + step / num_steps) / opt.rounds) ** opt.poly_power,
        )
    synchronize(device)
    started = time.perf_counter()
    for _ in range(opt.epochs):
        order = indices[torch.randperm(len(indices), generator=generator).to(indices.device)]
        for start in range(0, len(order), data.batch_size):
            batch = order[start : start + data.batch_size]
            with autocast(device, precision):
                loss = task_loss(data.task, net(data.inputs[batch]), data.targets[batch])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
    synchronize(device)
    return time.perf_counter() - started


@torch.no_grad()
def evaluate(data: Exported, device: torch.device, precision: str) -> dict[str, float]:
    """The global model on every client's held-out split in one batched pass: per-client sums, pooled.

    The same statistics as fedlight's metrics: per client, correct/count/loss sums (classification) or a
    confusion matrix and the loss summed over valid pixels (segmentation).
    """
    net = data.net.eval()
    groups, classes = data.num_groups, data.num_classes
    loss_sum = torch.zeros(groups, dtype=torch.float64, device=device)
    if data.task == "segmentation":
        confusion = torch.zeros(groups * classes * classes, dtype=torch.float64, device=device)  # [G·C·C]
    else:
        correct = torch.zeros(groups, dtype=torch.float64, device=device)
        count = torch.zeros(groups, dtype=torch.float64, device=device)
    for start in range(0, len(data.held_out_index), data.eval_batch_size):
        batch = data.held_out_index[start : start + data.eval_batch_size]
        group = data.held_out_group[start : start + data.eval_batch_size]
        x, y = data.inputs[batch], data.targets[batch]
        with autocast(device, precision):
            logits = net(x)
        logits = logits.float()
        if data.task == "segmentation":  # logits [B, C, H, W], y [B, H, W]
            loss = F.cross_entropy(logits, y, ignore_index=255, reduction="none").sum(dim=(1, 2))
            keep = y != 255
            cell = (group[:, None, None] * classes + y) * classes + logits.argmax(1)  # [B, H, W]
            confusion += torch.bincount(cell[keep], minlength=confusion.numel()).double()
        else:
            loss = F.cross_entropy(logits, y, reduction="none")
            correct += torch.bincount(group, weights=(logits.argmax(1) == y).double(), minlength=groups)
            count += torch.bincount(group, minlength=groups).double()
        loss_sum += torch.bincount(group, weights=loss.double(), minlength=groups)
    if data.task == "segmentation":
        pooled = confusion.view(groups, classes, classes).sum(0)  # [C, C], rows: labels
        union = pooled.sum(0) + pooled.sum(1) - pooled.diag()
        miou = (pooled.diag()[union > 0] / union[union > 0]).mean()
        return {"miou": float(miou), "loss": float(loss_sum.sum() / pooled.sum())}
    return {"acc": float(correct.sum() / count.sum()), "loss": float(loss_sum.sum() / count.sum())}


def flat_state(net: torch.nn.Module) -> torch.Tensor:
    """The floating-point state as one fp32 CPU vector, in ``state_dict`` order (fedlight's layout)."""
    return torch.cat([v.detach().reshape(-1).float().cpu() for v in net.state_dict().values() if v.is_floating_point()])


# -- the floor -------------------------------------------------------------------------------------------
def run_floor(args: argparse.Namespace, work: Workload) -> dict[str, Any]:
    device = torch.device(args.accelerator)
    data = load_exported(args.exported, device, args.channels_last)
    net = data.net
    sizes = data.num_samples.astype(np.float64)
    global_state = {k: v.clone() for k, v in net.state_dict().items()}
    rounds: list[dict[str, float]] = []
    loop_started = time.perf_counter()
    for round_idx in range(args.rounds):
        started = time.perf_counter()
        clients = round_clients(data.num_samples, work.clients_per_round, round_idx)
        # fp64 running sum, as fedlight's: n_k · θ_k is exact, so the sum does not depend on the order
        total = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in global_state.items() if v.is_floating_point()}
        largest = {k: v.clone() for k, v in global_state.items() if not v.is_floating_point()}
        train_s = 0.0
        for client in clients:
            net.load_state_dict(global_state)
            train_s += local_fit(data, client, round_idx, Optimization.of(work, args.rounds), device, args.precision)
            with torch.no_grad():  # the running weighted sum: no client state is kept
                for name, value in net.state_dict().items():
                    if name in total:
                        total[name] += sizes[client] * value.double()
                    else:
                        largest[name] = torch.maximum(largest[name], value)
        scale = 1.0 / sizes[clients].sum()
        global_state = {name: (scale * value).float() for name, value in total.items()} | largest
        net.load_state_dict(global_state)
        eval_started = time.perf_counter()
        metrics = evaluate(data, device, args.precision)
        synchronize(device)
        now = time.perf_counter()
        rounds.append({"round_s": now - started, "train_s": train_s, "eval_s": now - eval_started, **metrics})
    loop_s = time.perf_counter() - loop_started
    return {"loop_s": loop_s, "rounds": rounds, "final_state": flat_state(net)}


# -- fedlight ----------------------------------------------------------------------------------------------
def run_fedlight(
    args: argparse.Namespace, work: Workload, batched: bool = False, compile_steps: bool = False
) -> dict[str, Any] | None:
    from fedlight.callbacks.base import RoundCallback
    from fedlight.engine.evaluation import Evaluator
    from fedlight.engine.local_fit import LocalTraining
    from fedlight.engine.trainer import FederatedTrainer
    from fedlight.strategies import FedAvg

    device = torch.device(args.accelerator)

    class TimedFedAvg(FedAvg):
        """FedAvg that clocks each client's inner loop and hands the time over with the client's update."""

        def on_client_fit_start(self, context, module, plan) -> None:
            synchronize(device)
            self._started = time.perf_counter()

        def training_loss(self, module, batch, outputs):
            probe.step_dtype = str(outputs["logits"].dtype)  # what precision the client step really ran in
            return outputs["loss"]

        def loss_is_traceable(self) -> bool:
            return True  # it reads the parameters through the module only (the compiled engine's whole step)

        def on_client_fit_end(self, context, module, update) -> None:
            synchronize(device)
            update.payload["train_s"] = time.perf_counter() - self._started
            update.payload["rank"] = context.rank

        def on_round_end(self, context, round_idx, updates) -> dict[str, float]:
            per_rank: dict[int, float] = {}
            for update in updates:
                per_rank[update.payload["rank"]] = per_rank.get(update.payload["rank"], 0.0) + update.payload["train_s"]
            probe.train_s.append(max(per_rank.values()))
            return {}

    class Probe(RoundCallback):
        """Round boundaries and the time spent in each stage of every round, on this rank."""

        def __init__(self) -> None:
            self.starts: list[float] = []
            self.train_s: list[float] = []
            self.stages: list[dict[str, float]] = []  # per round: stage → seconds
            self.step_dtype = ""
            self.fit_start = self.fit_end = 0.0

        def on_fit_start(self, context) -> None:
            self.fit_start = time.perf_counter()

        def on_round_start(self, context, round_idx) -> None:
            self.starts.append(time.perf_counter())
            self.stages.append({})

        def on_fit_end(self, context) -> None:
            self.fit_end = time.perf_counter()

        # With --start-method fork the rounds run in forked processes; rank 0's probe comes back through these.
        def state_dict(self) -> dict[str, Any]:
            return dict(self.__dict__)

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.__dict__.update(state)

        def clock(self, stage: str, fn: Callable) -> Callable:
            def timed(*a, **kw):
                synchronize(device)
                started = time.perf_counter()
                out = fn(*a, **kw)
                synchronize(device)
                current = self.stages[-1]
                current[stage] = current.get(stage, 0.0) + time.perf_counter() - started
                return out

            return timed

    probe = Probe()
    torch.manual_seed(SEED)
    trainer = FederatedTrainer(
        rounds=args.rounds,
        clients_per_round=work.clients_per_round,
        local_epochs=work.local_epochs,
        eval_every=1,
        checkpoint_every=CHECKPOINT_EVERY,
        accelerator=args.accelerator,
        devices=args.workers,
        start_method=args.start_method,
        precision=args.precision,
        channels_last=args.channels_last,
        default_root_dir=args.workdir,
        name=work.name,
        logger="csv",
        enable_progress_bar=False,
        callbacks=[probe],
        seed=SEED,
        client_batching=1024 if batched else None,  # vectorised, whatever auto's cost model would choose
        compile_batched=batched,
        compile_steps=compile_steps,
        steps_per_call=args.steps_per_call if compile_steps or batched else 1,
    )
    # Stage clocks around the engine's own steps (this child process runs one engine, so its classes are patched).
    for stage, owner, method in [
        ("client_fit", LocalTraining, "fit"),
        ("evaluation", Evaluator, "evaluate"),
        ("logging", FederatedTrainer, "_log"),
        ("checkpoint", FederatedTrainer, "save_checkpoint"),
    ]:
        setattr(owner, method, probe.clock(stage, getattr(owner, method)))
    if batched:  # no client hooks: the round's time is all there is
        probe.train_s = [math.nan] * args.rounds
    trainer.fit(work.make_client(), work.make_datamodule(), FedAvg() if batched else TimedFedAvg())
    if trainer.run.fabric.global_rank != 0:
        return None
    ends = [*probe.starts[1:], probe.fit_end]
    metric_key = "test/miou" if work.task == "segmentation" else "test/acc"
    rounds = []
    for i, (start, end) in enumerate(zip(probe.starts, ends, strict=True)):
        rounds.append(
            {
                "round_s": end - start,
                "train_s": probe.train_s[i],
                "eval_s": probe.stages[i].get("evaluation", 0.0),
                "stages": probe.stages[i],
                "metric": trainer.history[i].get(metric_key, math.nan),
            }
        )
    checkpoints = [stages["checkpoint"] for stages in probe.stages if "checkpoint" in stages]
    return {
        "loop_s": probe.fit_end - probe.fit_start,
        "rounds": rounds,
        "checkpoint_s": checkpoints,
        "step_dtype": probe.step_dtype,
        "final_state": trainer.global_state.detach().float().cpu(),
    }


# -- Flower ------------------------------------------------------------------------------------------------
def run_flower(args: argparse.Namespace, work: Workload) -> dict[str, Any]:
    import flower_engine  # this directory is on the child's PYTHONPATH; it imports flwr

    return flower_engine.run(args, work)


def run_pfl(args: argparse.Namespace, work: Workload) -> dict[str, Any]:
    import pfl_engine  # this directory and --pfl-path are on the child's PYTHONPATH; it imports pfl

    return pfl_engine.run(args, work)


# -- the child: one engine, one run ------------------------------------------------------------------------
def child(args: argparse.Namespace, work: Workload) -> None:
    torch.set_num_threads(args.threads)
    runner = {
        "floor": run_floor,
        "fedlight": run_fedlight,
        "batched": lambda a, w: run_fedlight(a, w, batched=True),
        "compiled": lambda a, w: run_fedlight(a, w, compile_steps=True),
        "flower": run_flower,
        "pfl": run_pfl,
    }[args.child]
    result = runner(args, work)
    if result is None:  # a non-zero rank of a multi-process fedlight run
        return
    import fedlight

    torch.save(result.pop("final_state"), args.result.replace(".json", ".pt"))
    result["fedlight_file"] = fedlight.__file__
    result["own_peak_rss_mb"] = _own_peak_rss_mb()
    Path(args.result).write_text(json.dumps(result))


def _own_peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- the parent: runs, repeats, the report -------------------------------------------------------------------
class TreeMonitor(threading.Thread):
    """Samples a process and all its descendants (Ray's daemons and actors included) every ``interval`` s.

    Keeps the peak of their summed resident memory and each process's last-seen CPU time (user +
    system), whose sum is the tree's CPU time (less what a process spends after its last sample).
    """

    def __init__(self, pid: int, interval: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.peak_mb = 0.0
        self.cpu_ticks: dict[int, int] = {}
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.sample()
            self._stop_event.wait(self.interval)

    def sample(self) -> None:
        """Resident memory and CPU ticks of ``pid`` and its descendants, from ``/proc`` children lists."""
        total_kb, frontier, seen = 0, [self.pid], set()
        while frontier:
            pid = frontier.pop()
            if pid in seen:
                continue
            seen.add(pid)
            try:
                stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                self.cpu_ticks[pid] = int(stat[11]) + int(stat[12])  # utime + stime
                total_kb += int(stat[21]) * os.sysconf("SC_PAGE_SIZE") // 1024  # rss, in pages
                for task in Path(f"/proc/{pid}/task").iterdir():
                    frontier += [int(child) for child in (task / "children").read_text().split()]
            except (OSError, IndexError):  # the process ended while we looked
                continue
        self.peak_mb = max(self.peak_mb, total_kb / 1024)

    def stop(self) -> tuple[float, float]:
        """Stops sampling; returns the peak memory (MiB) and the CPU time (s)."""
        self._stop_event.set()
        self.join()
        return self.peak_mb, sum(self.cpu_ticks.values()) / os.sysconf("SC_CLK_TCK")


def launch(
    script: Path, args: argparse.Namespace, engine: Engine, workers: int, exported: Path, result: Path, log: Path
) -> dict[str, Any]:
    """Runs one child process; returns its report with the whole-process wall time, CPU time and memory added."""
    python = args.flower_python if engine == "flower" else sys.executable
    workdir = result.with_suffix("")
    command = [
        python,
        str(script),
        "--child",
        engine,
        "--workers",
        str(workers),
        "--rounds",
        str(args.rounds),
        "--threads",
        str(args.threads),
        "--accelerator",
        args.accelerator,
        "--precision",
        args.precision,
        *(["--channels-last"] if args.channels_last else []),
        "--steps-per-call",
        str(args.steps_per_call),
        "--start-method",
        args.start_method,
        "--exported",
        str(exported),
        "--workdir",
        str(workdir),
        "--result",
        str(result),
    ]
    # pfl pins dp-accounting below the version fedlight uses, so it lives in a folder of its own (--pfl-path) that
    # only its runs put first on their path, with fedlight's interpreter and packages behind it
    paths = [str(args.pfl_path)] if engine == "pfl" else []
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join([*paths, str(REPO), str(HERE)]),
        # pfl places its model on a GPU whenever one exists; the run's accelerator decides here, as for the others
        "PFL_PYTORCH_DEVICE": args.accelerator,
        "OMP_NUM_THREADS": str(args.threads),
        "MKL_NUM_THREADS": str(args.threads),
        "FLWR_TELEMETRY_ENABLED": "0",
        "RAY_DEDUP_LOGS": "0",
        "WANDB_MODE": "disabled",
        # Ray starts its workers at nice 15; on a shared machine that alone would slow Flower's clients
        "RAY_worker_niceness": "0",
    }
    load = os.getloadavg()[0]
    started = time.perf_counter()
    with log.open("w") as out:
        process = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True
        )
        monitor = TreeMonitor(process.pid)
        monitor.start()
        try:
            code = process.wait()
        except BaseException:  # interrupted: take the child's whole process group (Ray included) down with us
            os.killpg(process.pid, signal.SIGKILL)
            raise
        finally:
            peak, cpu_s = monitor.stop()
    process_s = time.perf_counter() - started
    if code != 0 or not result.exists():
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise RuntimeError(f"{engine} with {workers} worker(s) failed (exit code {code}); end of {log}:\n{tail}")
    report = json.loads(result.read_text())
    report.update(process_s=process_s, cpu_s=cpu_s, tree_peak_rss_mb=peak, load_before=load)
    result.write_text(json.dumps(report))
    report["final_state"] = torch.load(result.with_suffix(".pt"))
    assert Path(report["fedlight_file"]).resolve().is_relative_to(REPO), (
        f"the {engine} child imported fedlight from {report['fedlight_file']}, not from {REPO}"
    )
    return report


def flower_available(python: str) -> bool:
    if not Path(python).exists() and python != sys.executable:
        return False
    probe = subprocess.run([python, "-c", "import flwr, ray"], capture_output=True)
    return probe.returncode == 0


def pfl_available(path: Path) -> bool:
    env = os.environ | {"PYTHONPATH": str(path)}
    return (
        subprocess.run([sys.executable, "-c", "import pfl.model.pytorch"], capture_output=True, env=env).returncode == 0
    )


@dataclass
class Summary:
    """Medians over repeats of one (engine, workers) configuration."""

    label: str
    loop_s: list[float]
    process_s: list[float]
    cpu_s: list[float]  # user + system time of the whole process tree
    loads: list[float]  # 1-minute load average before each run
    round_s: float  # median per-round wall time (after the first round)
    outside_ms: float  # median per-round time outside local training (after the first round)
    eval_share: float  # median evaluation time / round time
    peak_mb: list[float]
    final_state: torch.Tensor
    metric: float
    stages: dict[str, float]
    step_dtype: str = ""

    @property
    def loop(self) -> float:
        return statistics.median(self.loop_s)

    @property
    def process(self) -> float:
        return statistics.median(self.process_s)

    @property
    def cpu(self) -> float:
        return statistics.median(self.cpu_s)


def summarise(label: str, reports: list[dict[str, Any]]) -> Summary:
    steady = [r for report in reports for r in report["rounds"][1:]] or [r for rep in reports for r in rep["rounds"]]
    stages: dict[str, float] = {}
    if "stages" in steady[0]:  # fedlight: one round split into its stages (medians; the checkpoint amortised)
        timed = ("client_fit", "evaluation", "logging", "checkpoint")
        stages["local training"] = statistics.median(r["train_s"] for r in steady)
        stages["client set-up and hand-back"] = statistics.median(
            r["stages"].get("client_fit", 0.0) - r["train_s"] for r in steady
        )
        stages["sampling and aggregation"] = statistics.median(
            r["round_s"] - sum(r["stages"].get(n, 0.0) for n in timed) for r in steady
        )
        stages["evaluation"] = statistics.median(r["stages"].get("evaluation", 0.0) for r in steady)
        stages["logging"] = statistics.median(r["stages"].get("logging", 0.0) for r in steady)
        stages["checkpoint (mean per round)"] = statistics.mean(r["stages"].get("checkpoint", 0.0) for r in steady)
        checkpoints = [s for report in reports for s in report.get("checkpoint_s", [])]
        stages["checkpoint (one write)"] = statistics.median(checkpoints) if checkpoints else 0.0
    last = reports[-1]["rounds"][-1]
    return Summary(
        label=label,
        loop_s=[r["loop_s"] for r in reports],
        process_s=[r["process_s"] for r in reports],
        cpu_s=[r["cpu_s"] for r in reports],
        loads=[r["load_before"] for r in reports],
        round_s=statistics.median(r["round_s"] for r in steady),
        outside_ms=1e3 * statistics.median(r["round_s"] - r["train_s"] for r in steady),
        eval_share=statistics.median(r["eval_s"] / r["round_s"] for r in steady),
        peak_mb=[r["tree_peak_rss_mb"] for r in reports],
        final_state=reports[-1]["final_state"],
        metric=last.get("metric", last.get("acc", last.get("miou", math.nan))),
        stages=stages,
        step_dtype=reports[-1].get("step_dtype", ""),
    )


def spread(values: list[float]) -> str:
    return f"{min(values):.2f}–{max(values):.2f}" if len(values) > 1 else "–"


def print_report(work: Workload, args: argparse.Namespace, results: dict[str, Summary]) -> dict[str, Any]:
    import lightning

    versions = f"torch {torch.__version__}, lightning {lightning.__version__}"
    if "flower1" in results or "flower2" in results:
        flwr = subprocess.run(
            [args.flower_python, "-c", "import flwr, ray; print(flwr.__version__, ray.__version__)"],
            capture_output=True,
            text=True,
        ).stdout.split()
        versions += f", flwr {flwr[0]}, ray {flwr[1]}"
    load = os.getloadavg()
    print()
    print(f"workload: {work.title}")
    print(f"          {args.rounds} rounds, {work.clients_per_round} clients/round, F = {work.local_epochs}")
    layout = ", channels-last" if args.channels_last else ""
    print(
        f"machine:  {platform.machine()}, {os.cpu_count()} CPU(s), {args.accelerator}, {args.precision}{layout}, "
        f"{versions}"
    )
    print(
        f"          {args.threads} thread(s) per worker, {args.repeats} repeat(s), load average {load[0]:.2f}, "
        f"fedlight's processes started by {args.start_method}"
    )
    print()
    header = (
        f"{'engine':<12}{'loop s':>9}{'(spread)':>15}{'process s':>11}{'(spread)':>15}{'CPU s':>9}"
        f"{'rounds/s':>10}{'outside ms':>12}{'eval %':>8}{'peak MiB':>10}"
    )
    print(header)
    print("-" * len(header))
    for s in results.values():
        print(
            f"{s.label:<12}{s.loop:9.2f}{spread(s.loop_s):>15}{s.process:11.2f}{spread(s.process_s):>15}{s.cpu:9.1f}"
            f"{1 / s.round_s:10.2f}{s.outside_ms:12.1f}{100 * s.eval_share:8.1f}{max(s.peak_mb):10.0f}"
        )
    print()
    print("rounds/s and 'outside ms' are medians over rounds after the first; 'outside ms' is a round's wall")
    print("time minus the largest per-worker local-training time in it; CPU s and peak MiB are the whole process")
    print("tree's (Ray's daemons included). Loop, process and CPU: medians over repeats, spread min–max.")
    loads = [load for s in results.values() for load in s.loads]
    print(f"1-minute load average before the runs: {min(loads):.2f}–{max(loads):.2f}")
    ratios: dict[str, float] = {}
    checks: list[tuple[str, float, str]] = []

    def ratio(name: str, a: str, b: str, attr: str, target: str) -> None:
        if a in results and b in results:
            value = getattr(results[a], attr) / getattr(results[b], attr)
            ratios[name] = value
            checks.append((name, value, target))

    ratio("fedlight/floor (loop)", "fedlight1", "floor1", "loop", work_target(work, "floor"))
    ratio("Flower/fedlight, 1 worker (loop)", "flower1", "fedlight1", "loop", "≥ 1.25")
    ratio("Flower/fedlight, 1 worker (process)", "flower1", "fedlight1", "process", "≥ 1.25")
    ratio("Flower/fedlight, 2 workers (loop)", "flower2", "fedlight2", "loop", "≥ 1.25")
    ratio("Flower/fedlight, 2 workers (process)", "flower2", "fedlight2", "process", "≥ 1.25")
    ratio("fedlight 2 proc / 1 proc (rounds/s)", "fedlight1", "fedlight2", "round_s", "≥ 1.6 on (b), 100 rounds")
    ratio("batched/fedlight sequential (rounds/s)", "fedlight1", "batched1", "round_s", "–")
    ratio("batched/floor (rounds/s)", "floor1", "batched1", "round_s", "–")
    ratio("batched/Flower, 1 worker (rounds/s)", "flower1", "batched1", "round_s", "≥ 7 on a GPU, bf16-mixed")
    ratio("fedlight/Flower, 1 worker (rounds/s)", "flower1", "fedlight1", "round_s", "–")
    ratio("pfl/floor (loop)", "pfl1", "floor1", "loop", "–")
    ratio("fedlight/pfl (loop)", "fedlight1", "pfl1", "loop", "–")
    ratio("compiled steps/pfl (rounds/s)", "pfl1", "compiled1", "round_s", "–")
    ratio("batched/pfl (rounds/s)", "pfl1", "batched1", "round_s", "≥ 3 on a GPU, bf16-mixed")
    ratio("compiled steps/floor (rounds/s)", "floor1", "compiled1", "round_s", "≥ 2.5 on (a)")
    ratio("compiled steps/fedlight sequential (rounds/s)", "fedlight1", "compiled1", "round_s", "–")
    if "fedlight1" in results and "flower1" in results:
        value = results["fedlight1"].outside_ms / results["flower1"].outside_ms
        ratios["fedlight/Flower time outside training, 1 worker"] = value
        checks.append(("fedlight/Flower time outside training, 1 worker", value, "≤ 0.10"))
    print()
    for name, value, target in checks:
        print(f"{name:<48}{value:8.3f}   (target {target})")
    if "fedlight1" in results:
        print()
        print(f"fedlight, 1 process: one round, median over rounds after the first ({args.rounds} rounds)")
        round_ms = 1e3 * results["fedlight1"].round_s
        for stage, seconds in results["fedlight1"].stages.items():
            print(f"  {stage:<32}{1e3 * seconds:9.2f} ms  {100e3 * seconds / round_ms:6.1f} %")
    for s in results.values():
        if s.step_dtype:
            print(f"{s.label}: client step logits in {s.step_dtype} under --precision {args.precision}")
    differences = {}
    print()
    pairs = [("fedlight1", "floor1"), ("fedlight2", "fedlight1"), ("batched1", "floor1"), ("compiled1", "floor1")]
    for a, b in [*pairs, ("flower1", "floor1"), ("flower2", "floor1"), ("pfl1", "floor1")]:
        if a in results and b in results:
            diff = (results[a].final_state - results[b].final_state).abs().max().item()
            differences[f"{a} vs {b}"] = diff
            print(f"max |Δ| of the final global models, {a} vs {b}: {diff:.2e}")
    for s in results.values():
        print(f"final {'mIoU' if work.task == 'segmentation' else 'accuracy'} ({s.label}): {s.metric:.4f}")
    return {
        "workload": work.title,
        "rounds": args.rounds,
        "clients_per_round": work.clients_per_round,
        "local_epochs": work.local_epochs,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU(s)",
        "accelerator": args.accelerator,
        "precision": args.precision,
        "channels_last": args.channels_last,
        "start_method": args.start_method,
        "versions": versions,
        "threads": args.threads,
        "repeats": args.repeats,
        "load_average": load,
        "results": {
            key: {
                "loop_s": s.loop_s,
                "process_s": s.process_s,
                "cpu_s": s.cpu_s,
                "load_before": s.loads,
                "rounds_per_s": 1 / s.round_s,
                "outside_ms": s.outside_ms,
                "eval_share": s.eval_share,
                "peak_mb": s.peak_mb,
                "metric": s.metric,
                "stages_s": s.stages,
            }
            for key, s in results.items()
        },
        "ratios": ratios,
        "max_abs_difference": differences,
    }


def print_limit(work: Workload, args: argparse.Namespace, results: dict[str, Summary]) -> dict[str, Any]:
    """The round's FLOPs, the machine's GFLOP/s and each engine's share of them (see ``limit.py``)."""
    import limit

    data = work.make_datamodule()
    data.setup()
    per_sample = limit.mean_flops_per_sample(work.make_client().net, data, work.task)
    flops = float(
        np.mean(
            [
                limit.round_flops(
                    data, round_clients(data.num_samples, work.clients_per_round, r), work.local_epochs, per_sample
                )
                for r in range(args.rounds)
            ]
        )
    )
    device = "cuda" if args.accelerator == "cuda" else "cpu"
    table = limit.limit_table(args.precision, os.cpu_count() or 1, device)
    dtype = "bfloat16" if args.precision.startswith("bf16") else "float32"
    print()
    print(
        f"the limit: a round's local training is {flops / 1e9:.3f} GFLOP (torch's FlopCounterMode, forward + backward)"
    )
    for setting, rates in table.items():
        print(f"  machine, {setting:<24} matmul {rates['matmul']:8.1f} GFLOP/s   3×3 conv {rates['conv']:8.1f} GFLOP/s")
    limit_key = f"{dtype}, {args.threads} thread(s)"
    shares = {}
    for key, s in results.items():
        achieved, share = limit.share_of_limit(flops, 1 / s.round_s, table[limit_key])
        shares[key] = {"gflops": achieved, "share": share}
        print(f"  {s.label:<12} {achieved:8.2f} GFLOP/s achieved, {100 * share:5.1f} % of the limit ({limit_key})")
    return {"round_gflop": flops / 1e9, "machine_gflops": table, "engines": shares}


def work_target(work: Workload, kind: str) -> str:
    return {"synthetic_mlp": "≤ 1.10", "digits_cnn": "≤ 1.03"}.get(work.name, "–")


def parse_args(work: Workload, doc: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=None, help=f"communication rounds (default {work.rounds})")
    parser.add_argument("--reduced", action="store_true", help=f"{work.reduced_rounds} rounds, 1 repeat: CI's run")
    parser.add_argument("--repeats", type=int, default=3, help="runs of every configuration, interleaved")
    parser.add_argument(
        "--engines",
        default="floor1,fedlight1,flower1,fedlight2,flower2",
        help="configurations to run: engine and worker count, comma-separated",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per worker")
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed", "16-mixed"])
    parser.add_argument(
        "--channels-last", action="store_true", help="every engine keeps the model's 4-D weights in NHWC layout"
    )
    parser.add_argument(
        "--steps-per-call",
        type=int,
        default=1,
        help="the compiled and batched engines' steps of equal-shape batches per compiled call "
        "(--trainer.steps_per_call)",
    )
    parser.add_argument(
        "--start-method",
        default="fork",
        choices=["fork", "popen"],
        help="how fedlight starts its second process (--trainer.start_method)",
    )
    parser.add_argument(
        "--flower-python",
        default=str(REPO / ".venv-flower" / "bin" / "python"),
        help=f"interpreter with flwr[simulation] installed; create it with: {FLOWER_INSTALL}",
    )
    parser.add_argument(
        "--pfl-path",
        type=Path,
        default=REPO / ".venv-pfl" / "site",
        help=f"folder holding pfl-research and its pinned dependencies; fill it with: {PFL_INSTALL}",
    )
    parser.add_argument("--out", type=Path, default=HERE / "out", help="where <workload>.json and the logs go")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="largest |Δ| allowed between equal models")
    parser.add_argument("--resume", action="store_true", help="reuse the runs already under --out with these settings")
    parser.add_argument("--stop-after", type=float, default=0, help="start no new run after this many seconds")
    # Internal: the options of one child run.
    parser.add_argument("--child", choices=ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--exported", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.reduced:
        args.rounds, args.repeats = args.rounds or work.reduced_rounds, 1
    args.rounds = args.rounds or work.rounds
    return args


def configurations(spec: str) -> Iterator[tuple[Engine, int]]:
    for item in spec.split(","):
        item = item.strip()
        engine, workers = item.rstrip("0123456789"), int(item[len(item.rstrip("0123456789")) :] or 1)
        if engine not in ENGINES:
            raise SystemExit(f"Unknown engine {engine!r} in --engines={spec}; use {', '.join(ENGINES)}.")
        if engine in ("batched", "compiled", "pfl") and workers != 1:
            raise SystemExit(f"--engines={spec}: {engine} runs in one process ({engine}1).")
        yield engine, workers


def main(work: Workload, script: str, doc: str) -> dict[str, Any] | None:
    """Entry point of a workload script: the parent orchestration, or one child run."""
    args = parse_args(work, doc)
    if args.child:
        child(args, work)
        return None
    plan = list(configurations(args.engines))
    if any(engine == "flower" for engine, _ in plan) and not flower_available(args.flower_python):
        print(
            f"Flower is not installed for {args.flower_python}: its runs are skipped. To include them, run from "
            f"the repository root:\n    {FLOWER_INSTALL}"
        )
        plan = [(engine, workers) for engine, workers in plan if engine != "flower"]
    if any(engine == "pfl" for engine, _ in plan) and not pfl_available(args.pfl_path):
        print(
            f"pfl-research is not installed in {args.pfl_path}: its runs are skipped. To include them, run from the "
            f"repository root:\n    {PFL_INSTALL}"
        )
        plan = [(engine, workers) for engine, workers in plan if engine != "pfl"]
    args.out.mkdir(parents=True, exist_ok=True)
    reports: dict[str, list[dict[str, Any]]] = {}
    # Every run's report is kept, so that --resume can spread the repeats over several sessions.
    setting = f"rounds{args.rounds}_{args.accelerator}_{args.precision}_t{args.threads}"
    setting += ("_nhwc" if args.channels_last else "") + ("_popen" if args.start_method == "popen" else "")
    setting += f"_k{args.steps_per_call}" if args.steps_per_call > 1 else ""
    runs = args.out / f"{work.name}_runs" / setting
    runs.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        exported = Path(tmp) / "workload.pt"
        export(work, exported)
        for repeat in range(args.repeats):
            for engine, workers in plan:
                key = f"{engine}{workers}"
                result = runs / f"{key}_{repeat}.json"
                if args.resume and result.exists() and result.with_suffix(".pt").exists():
                    report = json.loads(result.read_text()) | {"final_state": torch.load(result.with_suffix(".pt"))}
                    reports.setdefault(key, []).append(report)
                    continue
                if args.stop_after and time.perf_counter() - started > args.stop_after:
                    raise SystemExit(f"Stopped after {args.stop_after} s; run again with --resume to go on.")
                log = args.out / f"{work.name}_{key}_{repeat}.log"
                report = launch(Path(script), args, engine, workers, exported, result, log)
                reports.setdefault(key, []).append(report)
                print(
                    f"repeat {repeat}: {key:<10} loop {report['loop_s']:7.2f} s   process {report['process_s']:7.2f} s"
                    f"   cpu {report['cpu_s']:7.2f} s   load {report['load_before']:.2f}",
                    flush=True,
                )
    labels = {"floor1": "floor", "fedlight1": "fedlight ×1", "fedlight2": "fedlight ×2"}
    labels |= {"flower1": "Flower ×1", "flower2": "Flower ×2", "batched1": "batched ×1", "compiled1": "compiled ×1"}
    if args.steps_per_call > 1:
        labels["compiled1"] = f"compiled ×1, {args.steps_per_call} steps per call"
        labels["batched1"] = f"batched ×1, {args.steps_per_call} steps per call"
    labels |= {"pfl1": "pfl ×1"}
    results = {key: summarise(labels.get(key, key), value) for key, value in reports.items()}
    summary = print_report(work, args, results)
    summary["limit"] = print_limit(work, args, results)
    (args.out / f"{work.name}.json").write_text(json.dumps(summary, indent=2))
    # pfl sums the clients' differences in fp32 where the floor sums in fp64: equal after one round to rounding,
    # but the rounding compounds over rounds (4e-3 after 6 rounds of (a)), so pfl is held to it after one round
    checked = {"fedlight1 vs floor1", "fedlight2 vs fedlight1"} | ({"pfl1 vs floor1"} if args.rounds == 1 else set())
    problems = [
        f"{pair}: {diff:.2e}"
        for pair, diff in summary["max_abs_difference"].items()
        if pair in checked and diff > args.tolerance
    ]
    if problems:
        raise SystemExit(f"Runs that should end with the same model differ by more than {args.tolerance}: {problems}")
    return summary
