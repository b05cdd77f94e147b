"""A harness workload on pfl-research's simulation (``pfl[pytorch]`` 0.6), in the harness's semantics.

Written as a pfl user would, with pfl's own pieces: ``FederatedAveraging`` (the model difference of every client,
averaged and applied by a central SGD of rate 1), ``PyTorchModel`` holding one resident model, ``SimulatedBackend``
with ``WeightByDatapoints`` (each difference weighted by the client's n_k), ``NNTrainHyperParams`` for the local
epochs, batch and rate, and ``amp_dtype`` for ``bf16-mixed``. Three things differ from pfl's defaults and are set
here so that every engine runs the same experiment:

- **which clients**: pfl samples each cohort member uniformly with replacement (``get_user_sampler('random')``);
  ``RoundCohorts`` hands pfl, round by round, the clients the floor and fedlight draw (k ∝ n_k without replacement);
- **batch order**: pfl's ``Dataset.iter`` walks a client's data in stored order every epoch; ``ShuffledUser`` draws a
  new permutation each epoch from the client's seeded generator, as the floor does;
- **evaluation**: pfl evaluates every training client before and after its local training whenever
  ``central_iteration % evaluation_frequency == 0``, which includes the first round whatever the frequency; here
  those evaluations are off and the global model is scored after each round by the harness's batched pass over
  every client's held-out split (``RoundClock``), as the other engines do.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import harness
import torch
from pfl.aggregate.simulate import SimulatedBackend
from pfl.aggregate.weighting import WeightByDatapoints
from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
from pfl.callback.base import TrainingProcessCallback
from pfl.data.dataset import Dataset
from pfl.data.federated_dataset import FederatedDatasetBase
from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
from pfl.metrics import Metrics
from pfl.model.pytorch import PyTorchModel


class ShuffledUser(Dataset):
    """One client's training data, reshuffled every epoch from the client's seeded generator (as the floor)."""

    def __init__(self, data: harness.Exported, client: int, round_idx: int) -> None:
        self.indices = data.client_train[client]
        super().__init__(raw_data=[data.inputs, data.targets], user_id=client)
        self.data = data
        seed = harness.client_seed(round_idx, client)
        torch.default_generator.manual_seed(seed)  # any draw inside the step, as the floor seeds it
        if data.inputs.is_cuda:
            torch.cuda.manual_seed(seed)
        self.generator = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return len(self.indices)

    def iter(self, batch_size: int | None) -> Iterator[list[torch.Tensor]]:
        order = self.indices[torch.randperm(len(self.indices), generator=self.generator).to(self.indices.device)]
        size = batch_size or len(order)
        for start in range(0, len(order), size):
            batch = order[start : start + size]
            yield [self.data.inputs[batch], self.data.targets[batch]]


class RoundCohorts(FederatedDatasetBase):
    """The training population: each call of ``get_cohort`` is the next round's clients, as the harness draws them."""

    def __init__(self, data: harness.Exported, clients_per_round: int) -> None:
        super().__init__()
        self.data, self.clients_per_round, self.round = data, clients_per_round, 0

    def __next__(self):
        raise NotImplementedError("RoundCohorts hands out whole cohorts only (get_cohort)")

    def get_cohort(self, cohort_size: int) -> Iterator[tuple[Dataset, int]]:
        assert cohort_size == self.clients_per_round, (cohort_size, self.clients_per_round)
        round_idx, self.round = self.round, self.round + 1
        for client in harness.round_clients(self.data.num_samples, self.clients_per_round, round_idx):
            yield ShuffledUser(self.data, client, round_idx), harness.client_seed(round_idx, client)


class Trainable(torch.nn.Module):
    """The workload's network with the two methods ``PyTorchModel`` calls: ``loss`` and ``metrics``."""

    def __init__(self, net: torch.nn.Module, task: str) -> None:
        super().__init__()
        self.net, self.task = net, task

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def loss(self, x: torch.Tensor, y: torch.Tensor, eval: bool = False) -> torch.Tensor:
        self.train(not eval)
        return harness.task_loss(self.task, self(x), y)

    @torch.no_grad()
    def metrics(self, x: torch.Tensor, y: torch.Tensor, eval: bool = True) -> dict[str, Any]:
        raise NotImplementedError("the harness evaluates the global model itself (RoundClock)")


class QuietFedAvg(FederatedAveraging):
    """pfl's FederatedAveraging without its evaluation of the training clients before and after local training."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device, self.train_s = device, [0.0]

    def get_next_central_contexts(self, *args: Any, **kwargs: Any):
        contexts, model, metrics = super().get_next_central_contexts(*args, **kwargs)
        if contexts is not None:
            contexts = tuple(dataclasses.replace(c, do_evaluation=False) for c in contexts)
        return contexts, model, metrics

    def train_one_user(self, initial_model_state, model, user_dataset, central_context):
        harness.synchronize(self.device)
        started = time.perf_counter()
        result = super().train_one_user(initial_model_state, model, user_dataset, central_context)
        harness.synchronize(self.device)
        self.train_s[-1] += time.perf_counter() - started
        return result


class RoundClock(TrainingProcessCallback):
    """Times each round and scores the global model with the harness's evaluation after it."""

    def __init__(self, data: harness.Exported, args: argparse.Namespace, algorithm: QuietFedAvg) -> None:
        self.data, self.args, self.algorithm = data, args, algorithm
        self.rounds: list[dict[str, float]] = []
        self.started = 0.0

    def on_train_begin(self, *, model: PyTorchModel) -> Metrics:
        self.started = time.perf_counter()
        return Metrics()

    def after_central_iteration(self, aggregate_metrics: Metrics, model: PyTorchModel, *, central_iteration: int):
        device = torch.device(self.args.accelerator)
        eval_started = time.perf_counter()
        metrics = harness.evaluate(self.data, device, self.args.precision)  # data.net is the model pfl trains
        harness.synchronize(device)
        now = time.perf_counter()
        self.rounds.append(
            {
                "round_s": now - self.started,
                "train_s": self.algorithm.train_s[-1],
                "eval_s": now - eval_started,
                **metrics,
            }
        )
        self.algorithm.train_s.append(0.0)
        self.started = time.perf_counter()
        return False, Metrics()


def run(args: argparse.Namespace, work: harness.Workload) -> dict[str, Any]:
    if work.optimizer != "sgd" or work.weight_decay or work.poly_power:
        raise SystemExit(f"the pfl engine runs plain SGD workloads; {work.name} uses {work.optimizer}")
    device = torch.device(args.accelerator)
    data = harness.load_exported(args.exported, device, args.channels_last)
    model = PyTorchModel(
        model=Trainable(data.net, work.task),
        local_optimizer_create=torch.optim.SGD,
        central_optimizer=torch.optim.SGD(data.net.parameters(), lr=1.0),
        amp_dtype={"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(args.precision),
    )
    algorithm = QuietFedAvg(device)
    algorithm_params = NNAlgorithmParams(
        central_num_iterations=args.rounds,
        evaluation_frequency=args.rounds + 1,
        train_cohort_size=work.clients_per_round,
        val_cohort_size=0,
    )
    train_params = NNTrainHyperParams(
        local_num_epochs=work.local_epochs, local_learning_rate=work.lr, local_batch_size=data.batch_size
    )
    backend = SimulatedBackend(
        training_data=RoundCohorts(data, work.clients_per_round), val_data=None, postprocessors=[WeightByDatapoints()]
    )
    clock = RoundClock(data, args, algorithm)
    started = time.perf_counter()
    algorithm.run(
        algorithm_params=algorithm_params,
        backend=backend,
        model=model,
        model_train_params=train_params,
        model_eval_params=NNEvalHyperParams(local_batch_size=data.eval_batch_size),
        callbacks=[clock],
    )
    loop_s = time.perf_counter() - started
    assert len(clock.rounds) == args.rounds, f"pfl ran {len(clock.rounds)} of {args.rounds} rounds"
    return {"loop_s": loop_s, "rounds": clock.rounds, "final_state": harness.flat_state(data.net)}
