"""A harness workload on Flower's simulation engine (``flwr`` ≥ 1.20 Message API, Ray backend).

Written as a careful Flower user would, so that what is measured is the engine, not a naive client:

- every actor process loads the exported workload and builds the model once and keeps both
  (``_resident``); a message only loads the received weights into the resident model;
- the strategy is Flower's own ``FedAvg`` (its weighted average of the replies); only
  ``configure_train`` is replaced, to send each round to the same clients as fedlight and the floor
  (k draws ∝ n_k from the round's seeded generator). The client index travels in the message's
  config, each to its own node;
- evaluation is Flower's server-side ``evaluate_fn`` over every client's held-out split, the same
  batched pass as the floor; federated evaluation (a message round trip per client) is off.

One actor per CPU core given (``--workers``), one core per client (``client_resources``).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import harness
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from flwr.simulation import run_simulation

_resident: dict[str, harness.Exported] = {}


def _workload(config: ConfigRecord) -> harness.Exported:
    """The exported workload, loaded once per actor process."""
    path = str(config["exported"])
    if path not in _resident:
        torch.set_num_threads(int(config["threads"]))
        device = torch.device(str(config["accelerator"]))
        _resident[path] = harness.load_exported(path, device, bool(config["channels-last"]))
    return _resident[path]


client_app = ClientApp()


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    config = msg.content["config"]
    data = _workload(config)
    device = torch.device(str(config["accelerator"]))
    data.net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    client = int(config["client"])
    optimization = harness.Optimization(
        epochs=int(config["epochs"]),
        lr=float(config["lr"]),
        optimizer=str(config["optimizer"]),
        weight_decay=float(config["weight-decay"]),
        poly_power=float(config["poly-power"]),
        rounds=int(config["rounds"]),
    )
    train_s = harness.local_fit(
        data, client, int(config["server-round"]) - 1, optimization, device, str(config["precision"])
    )
    metrics = MetricRecord({"num-examples": int(data.num_samples[client]), "train-s": train_s, "pid": os.getpid()})
    content = RecordDict({"arrays": ArrayRecord(data.net.state_dict()), "metrics": metrics})
    return Message(content=content, reply_to=msg)


class SameClientsFedAvg(FedAvg):
    """Flower's FedAvg, sending each round to the clients fedlight and the floor draw, and clocking rounds."""

    def __init__(self, work: harness.Workload, data: harness.Exported, base_config: dict[str, Any]) -> None:
        super().__init__(fraction_evaluate=0.0)
        self.work, self.data, self.base_config = work, data, base_config
        self.round_starts: list[float] = []
        self.train_s: list[float] = []

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid):
        self.round_starts.append(time.perf_counter())
        clients = harness.round_clients(self.data.num_samples, self.work.clients_per_round, server_round - 1)
        # one node per client; as Flower's own sampling does, wait until they have all registered
        while len(nodes := sorted(grid.get_node_ids())) < len(self.data.num_samples):
            time.sleep(0.1)
        return [
            Message(
                content=RecordDict(
                    {
                        "arrays": arrays,
                        "config": ConfigRecord({**self.base_config, "server-round": server_round, "client": client}),
                    }
                ),
                dst_node_id=nodes[client],
                message_type=MessageType.TRAIN,
            )
            for client in clients
        ]

    def aggregate_train(self, server_round: int, replies):
        replies = list(replies)
        per_actor: dict[int, float] = {}
        for reply in replies:
            if not reply.has_error():
                metrics = reply.content["metrics"]
                per_actor[int(metrics["pid"])] = per_actor.get(int(metrics["pid"]), 0.0) + float(metrics["train-s"])
        self.train_s.append(max(per_actor.values(), default=0.0))
        return super().aggregate_train(server_round, replies)


def run(args: argparse.Namespace, work: harness.Workload) -> dict[str, Any]:
    device = torch.device(args.accelerator)
    data = harness.load_exported(args.exported, device, args.channels_last)  # the server's copy, for evaluation
    base_config = {
        "exported": str(args.exported),
        "threads": args.threads,
        "accelerator": args.accelerator,
        "precision": args.precision,
        "channels-last": args.channels_last,
        "epochs": work.local_epochs,
        "lr": work.lr,
        "optimizer": work.optimizer,
        "weight-decay": work.weight_decay,
        "poly-power": work.poly_power,
        "rounds": args.rounds,
    }
    strategy = SameClientsFedAvg(work, data, base_config)
    evaluations: list[dict[str, float]] = []
    outcome: dict[str, Any] = {}

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        if server_round == 0:  # fedlight and the floor do not evaluate W^0 either
            return None
        data.net.load_state_dict(arrays.to_torch_state_dict())
        started = time.perf_counter()
        metrics = harness.evaluate(data, device, args.precision)
        harness.synchronize(device)
        ended = time.perf_counter()
        evaluations.append({"eval_s": ended - started, "end": ended, **metrics})
        return MetricRecord(metrics)

    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        started = time.perf_counter()
        result = strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord(data.net.state_dict()),
            num_rounds=args.rounds,
            evaluate_fn=evaluate_fn,
        )
        outcome["loop_s"] = time.perf_counter() - started
        outcome["final"] = result.arrays.to_torch_state_dict()

    gpus = 1.0 if args.accelerator == "cuda" else 0.0
    run_simulation(
        server_app=server_app,
        client_app=client_app,
        num_supernodes=len(data.num_samples),
        backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": gpus / args.workers},
            "init_args": {"num_cpus": args.workers, "num_gpus": gpus},
        },
    )
    assert "final" in outcome, "Flower's ServerApp did not finish; see the log above"
    ends = [*strategy.round_starts[1:], evaluations[-1]["end"]]
    rounds = [
        {
            "round_s": end - start,
            "train_s": strategy.train_s[i],
            "eval_s": evaluations[i]["eval_s"],
            **{k: v for k, v in evaluations[i].items() if k not in ("eval_s", "end")},
        }
        for i, (start, end) in enumerate(zip(strategy.round_starts, ends, strict=True))
    ]
    data.net.load_state_dict(outcome["final"])
    return {"loop_s": outcome["loop_s"], "rounds": rounds, "final_state": harness.flat_state(data.net)}
