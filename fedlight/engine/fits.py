"""The local fits of a round: this process's share of the clients, one after another or vectorised, streamed into
the round's sums as they finish.

Clients are assigned to processes greedily by size; each process trains its share on its resident module
(:mod:`fedlight.engine.local_fit`) or, with ``--trainer.client_batching``, as stacked models
(:mod:`fedlight.engine.batched`), adds every kept state into the fp64 sums (or keeps it for a rule that gathers
states) and finally all-reduces the sums once, so that the result does not depend on how clients are spread.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fedlight.bank import RoundSums
from fedlight.context import all_gather_objects
from fedlight.engine.batched import BatchedLocalFit, batching_blocker, vectorising_pays
from fedlight.engine.guards import FailureGuards
from fedlight.engine.launch import assign_clients
from fedlight.engine.local_fit import LocalTraining, all_finite
from fedlight.engine.stacked import optimizer_factory
from fedlight.engine.whole_step import update_blocker
from fedlight.errors import ConfigError, error_line
from fedlight.gather import ClientStates
from fedlight.plans import ClientPlan, ClientUpdate
from fedlight.strategies.functional import straggler_plan

if TYPE_CHECKING:
    from lightning.fabric import Fabric

    from fedlight.engine.config import BatchingSettings, RoundSettings
    from fedlight.engine.console import RunConsole
    from fedlight.engine.stopping import StopRequest
    from fedlight.strategies.base import Strategy

Fit = tuple[ClientUpdate, torch.Tensor | None]


class RoundFits:
    """Runs the local fits of a round on this process and collects what aggregation needs.

    Args:
        training: the local fit of one client.
        guards: what happens to clients that fail or diverge.
        batching: the vectorised-clients settings.
        fabric: the processes (rank, world size, all-reduce).
        console: the clients' progress bar and the run's one-line notes.
    """

    def __init__(
        self,
        training: LocalTraining,
        guards: FailureGuards,
        batching: BatchingSettings,
        fabric: Fabric,
        console: RunConsole,
        fail_fast: bool,
    ) -> None:
        self.training, self.guards, self.batching, self.fabric = training, guards, batching, fabric
        self.console, self.fail_fast = console, fail_fast
        self.model, self.strategy = training.model, training.strategy
        self.vectorised: BatchedLocalFit | str | None = None  # the vectorised fit, or why it cannot run
        #: bytes of the last round's aggregation buffers: W^t (fp32) and the streamed sums (fp64)
        self.aggregation_nbytes = 0

    def run(self, round_idx: int, plans: list[ClientPlan], stop: StopRequest | None):
        """Trains this process's share of the round's clients and streams their states into the sums.

        Returns every process's updates (sorted by client), the all-reduced sums, for rules that gather states this
        process's clients' states (and which process holds which), and the largest value of each integer buffer
        among the clients.
        """
        fabric, strategy, model = self.fabric, self.strategy, self.model
        data = self.training.datamodule
        training = [p for p in plans if not p.dropped]
        costs = [float(data.num_samples[p.client] * p.epochs) for p in training]
        mine = [training[i] for i in assign_clients(costs, fabric.world_size)[fabric.global_rank]]
        bank = model.bank
        sums = RoundSums(model.layout.numel, strategy.weight_channels, fabric.device, bank.index, bank.num_clusters)
        self.aggregation_nbytes = model.global_state.nbytes + sums.nbytes
        integers: dict[str, torch.Tensor] = {}  # the largest value of each integer buffer among clients
        states = ClientStates()  # this process's clients' states, only for rules that gather them
        updates = []
        for update, state in self._fits(round_idx, mine, stop):
            updates.append(update)
            if "error" in update.payload:  # its local fit raised: nothing to aggregate
                continue
            if self.guards.excluded(round_idx, update, state, model.member(self.cluster_of(update.client))):
                continue
            _merge_max(integers, model.layout.integers(model.module))
            update.weights = tuple(float(w) for w in strategy.client_weights(update))
            if strategy.gather_states:
                states.own[update.client] = state.cpu()
                continue
            sums.add(state, update.weights, self.cluster_of(update.client))

        if fabric.world_size > 1:
            sums.all_reduce(lambda packed: fabric.all_reduce(packed, reduce_op="sum"))
            updates = [u for rank_updates in all_gather_objects(updates, fabric.world_size) for u in rank_updates]
            for rank_integers in all_gather_objects(integers, fabric.world_size):
                _merge_max(integers, rank_integers)
            if strategy.gather_states:  # who holds which state; the states stay where they are
                states.owners = all_gather_objects(sorted(states.own), fabric.world_size)
        updates.sort(key=lambda u: u.client)
        if model.client_states is not None:  # every process learns which clients' new states count
            model.client_states.commit([u.client for u in updates if u.finite], round_idx + 1)
        return updates, sums, states, integers

    def cluster_of(self, client: int) -> int | None:
        return self.strategy.client_cluster(client) if self.model.bank.num_clusters else None

    def _fits(self, round_idx: int, plans: list[ClientPlan], stop: StopRequest | None) -> Iterator[Fit]:
        """Each of ``plans``' update and final state: one client after another, or vectorised in chunks.

        A client whose fit raises yields a failed update and no state (see ``fail_fast``). After a stop request
        no further client starts, and the round is abandoned on every rank.
        """
        chunk = self._chunk(plans)
        if chunk is None:
            groups: Iterator[list[ClientPlan]] = ([plan] for plan in self.console.clients(plans, round_idx))
        else:
            groups = (plans[start : start + chunk] for start in range(0, len(plans), chunk))
        skipped, failed = False, 0
        for group in groups:
            if stop is not None and stop.requested is not None:
                skipped = True  # the clients from this one on would be thrown away with the round
                break
            if chunk is None or isinstance(self.vectorised, str):  # the sequential loop, or switched to it
                fits = [self._fit_alone(round_idx, plan) for plan in group]
            else:
                fits = self._fit_group(round_idx, group)
            failed += sum("error" in update.payload for update, _ in fits)
            yield from fits
        # one all-reduce of four numbers: any rank's stop (by its signal), and the round's failures
        signals = stop.flags() if skipped and stop is not None else (0.0, 0.0)
        counts = torch.tensor([*signals, float(failed), float(len(plans))], device=self.fabric.device)
        if self.fabric.world_size > 1:
            counts = self.fabric.all_reduce(counts, reduce_op="sum")
        sigint, sigterm, failed_total, total = counts.tolist()
        any_skipped = stop.adopt(sigint, sigterm) if stop is not None else False  # a signal another rank received
        self.guards.check_round(round_idx, any_skipped, int(failed_total), int(total))

    def _fit_alone(self, round_idx: int, plan: ClientPlan) -> Fit:
        """One client's local fit on the resident module; a fit that raises gives a failed update (see
        ``fail_fast``)."""
        try:
            return self.training.fit(round_idx, plan, self.model.member(self.cluster_of(plan.client)))
        except ConfigError:
            raise
        except Exception as err:
            if self.fail_fast:
                raise
            num_samples = int(self.training.datamodule.num_samples[plan.client])
            return self.guards.failed_fit(round_idx, plan, num_samples, err), None

    def _fit_group(self, round_idx: int, plans: list[ClientPlan]) -> list[Fit]:
        """``plans`` vectorised; if that raises, each client alone, so that only a faulty client is left out.

        A vectorised fit fails together for one client's bad batch; retrained one by one, the others are kept.
        When the network itself cannot be vectorised (``torch.func.vmap`` refuses its data-dependent control
        flow), or every client trains alone where the group failed, the run goes on with the sequential loop,
        said once on the console.
        """
        try:
            return list(self._fit_vectorised(round_idx, plans))
        except ConfigError:
            raise
        except Exception as err:
            fits = [self._fit_alone(round_idx, plan) for plan in plans]
            if _vmap_refused(err) or all("error" not in update.payload for update, _ in fits):
                reason = error_line(err)
                self.vectorised = f"vectorising the network failed in round {round_idx + 1} ({reason})"
                self.console.print(
                    f"fedlight: --trainer.client_batching: clients train one after another from now on, because "
                    f"{self.vectorised}."
                )
            return fits

    def _chunk(self, plans: list[ClientPlan]) -> int | None:
        """How many clients to vectorise at once, or ``None`` for the sequential loop."""
        setting = self.batching.client_batching
        if setting is None or not plans:
            return None
        if self.vectorised is None:  # decided once per run, on the first round's module and optimizer
            model = self.model
            model.train_mode()
            configured = model.module.configure_optimizers()
            blocker = batching_blocker(model.module, model.layout, self.strategy, configured)
            compiled = self.batching.compile_batched
            if blocker is None and setting == "auto":
                pays, reason = vectorising_pays(model.module, self.fabric.device, compiled, self._bound(plans))
                blocker = None if pays else reason
                if pays:
                    self.console.print(f"fedlight: --trainer.client_batching=auto: clients train vectorised: {reason}.")
            if blocker is None:
                precision = self.training.precision
                in_graph = compiled and update_blocker(configured, precision) is None
                if compiled:
                    line = _update_line(configured, precision, self.batching.steps_per_call)
                    self.console.print(f"fedlight: --trainer.compile_batched: {line}.")
                steps_per_call = self.batching.steps_per_call
                self.vectorised = BatchedLocalFit(
                    model.module, model.layout, precision, compiled, in_graph, steps_per_call
                )
            else:
                self.vectorised = blocker
                self.console.print(
                    f"fedlight: --trainer.client_batching: clients train one after another, because {blocker}."
                )
        if isinstance(self.vectorised, str):
            return None
        if setting == "auto":  # parameters, gradients and up to two optimizer states, fp32
            return max(1, min(len(plans), 2**30 // (16 * max(self.model.layout.numel, 1))))
        return setting

    def _bound(self, plans: list[ClientPlan]) -> float:
        """Σ steps / max steps over ``plans``: the most a lockstep stack of them can gain."""
        local_steps, data = self.training.settings.local_steps, self.training.datamodule
        steps = [local_steps or plan.epochs * data.num_batches(plan.client) for plan in plans]
        return sum(steps) / max(max(steps), 1)

    def _fit_vectorised(self, round_idx: int, plans: list[ClientPlan]) -> Iterator[Fit]:
        """The local fits of ``plans`` as one vectorised model; each client draws the batches it would alone."""
        training, model = self.training, self.model
        module, store = model.module, model.client_states
        starts, batches, owns = [], [], []
        for plan in plans:
            seed = training.streams.client_seed(round_idx, plan.client)
            generator = torch.Generator().manual_seed(seed)  # batch order
            start = self.strategy.initial_state(training.context, plan, model.member(self.cluster_of(plan.client)))
            if store is not None:  # local slots only: a rule with vector slots has client hooks, never vectorised
                owns.append(store.values(plan.client, start))
                start = store.load_into(owns[-1], start)
            starts.append(start)
            batches.append(list(training.batches(plan, generator)))
        model.train_mode()
        num_steps = max(len(b) for b in batches)
        module.local_fit = training.local_fit(round_idx, num_steps)
        make_optimizer = optimizer_factory(module.configure_optimizers())
        results = self.vectorised.run(starts, batches, make_optimizer)
        for i, (plan, (loss_sum, steps, state)) in enumerate(zip(plans, results, strict=True)):
            update = training.update(plan, loss_sum, steps)
            update.finite = math.isfinite(update.train_loss) and all_finite(state)
            if store is not None:
                store.take_back(owns[i], state)
                store.put(plan.client, round_idx + 1, owns[i])
            yield update, state


def _vmap_refused(err: BaseException) -> bool:
    """Whether ``err`` is ``torch.func.vmap`` refusing the network (data-dependent control flow, ``.item()``…),
    which no client's data causes. Its messages start with ``vmap:``."""
    return any(str(e).lstrip().startswith("vmap") for e in (err, err.__cause__, err.__context__) if e is not None)


def round_counts(plans: list[ClientPlan], updates: list[ClientUpdate], aggregated: list[ClientUpdate]) -> dict:
    """What became of the round's clients, and their sample-weighted training loss."""
    outsized = sum("update_norm" in u.payload for u in updates if not u.finite)
    failed = sum("error" in u.payload for u in updates)
    metrics = {
        "round/clients_sampled": float(len(plans)),
        "round/clients_aggregated": float(len(aggregated)),
        "round/clients_dropped": float(sum(p.dropped for p in plans)),
        "round/clients_nonfinite": float(len(updates) - len(aggregated) - outsized - failed),
        "round/clients_outsized": float(outsized),
        "round/clients_failed": float(failed),
    }
    if aggregated:
        sizes = np.array([u.num_samples for u in aggregated], dtype=np.float64)
        losses = np.array([u.train_loss for u in aggregated])
        metrics["train/loss"] = float((sizes * losses).sum() / sizes.sum())
    return metrics


def _merge_max(into: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> None:
    """Keeps, for every integer buffer, the largest value seen (``num_batches_tracked`` is copied, not averaged)."""
    for name, value in new.items():
        into[name] = torch.maximum(into[name], value) if name in into else value


def round_plans(
    strategy: Strategy, num_samples: np.ndarray, loop: RoundSettings, rng: np.random.Generator
) -> list[ClientPlan]:
    """K^t from the strategy and the δ-fraction of stragglers, all drawn from the round's generator ``rng``."""
    clients = strategy.sample_clients(num_samples, loop.clients_per_round, rng)
    stragglers, epochs = straggler_plan(len(clients), loop.straggler_fraction, loop.local_epochs, rng)
    return [
        ClientPlan(int(c), int(e), bool(s), dropped=bool(s) and not strategy.tolerate_stragglers)
        for c, e, s in zip(clients, epochs, stragglers, strict=True)
    ]


def _update_line(configured: Any, precision: Any, steps_per_call: int) -> str:
    """Which vectorised step ``compile_batched`` compiles: with the optimizer's update in the graph, or without."""
    blocker = update_blocker(configured, precision)
    if blocker is None:
        several = f", up to {steps_per_call} steps of full batches per call" if steps_per_call > 1 else ""
        return f"the vectorised step compiles forward, backward and the optimizer's update as one graph{several}"
    return f"the vectorised step compiles forward and backward; the optimizer's update stays eager, because {blocker}"
