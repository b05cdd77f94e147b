"""The server callback layer: a :class:`Strategy` is the aggregation rule of a federated run.

The trainer's round loop fires the hooks below by name, in this order; ``ctx`` is the run's
:class:`~fedlight.context.RunContext`::

    on_fit_start(ctx)                                once, before the first round (also after a resume)
    client_state_slots(ctx)                          once: the per-client state the rule keeps, if any
    sample_clients                                   server, start of round t
    on_round_start(ctx, t, plans)                    server
    for each client k that trains:                   on the rank that hosts k
        initial_state(ctx, plan, W)                  server → client: the state k starts from (W is W^t,
                                                     or its cluster's member of the bank), then k's local
                                                     slots written over it
        client_teachers(ctx, plan)                   frozen models handed to the client's loss
        on_client_fit_start(ctx, module, plan)       client, after the state is loaded
        transform_batch(ctx, client, batch)          client, every local batch as it is drawn
        training_loss(module, batch, outputs)        client, every local step
        on_client_fit_end(ctx, module, update)       client, fills update.payload
        client_weights(update)                       unnormalised weights of k's state
    aggregate_chunks(W^t, states, updates)           server, rules with gather_states (instead of the sum)
    server_update(W^t, aggregate, updates)           server, after the weighted sum
    on_round_end(ctx, t, updates) -> metrics         server, every update's payload in hand
    route(ctx, batch, split)                         evaluation, for clustered rules that route samples

Most rules are "weights from payloads, then one weighted sum". The trainer does the sum in fp64, in
one flat buffer and one all-reduce across ranks, while clients finish, so no client state is held
past its own local fit. A rule with ``weight_channels = m > 1`` gives each client ``m`` weights and
gets back ``Σ_j c_j · (Σ_k w_kj θ_k) / (Σ_k w_kj)`` with the coefficients ``c`` of
:meth:`channel_coefficients`; that expresses normalised mixtures such as FedProto's
``(a_agg + a_loc)/2``. Rules that need every client's state at once (median, Krum, FedAtt) set
``gather_states = True`` and implement :meth:`aggregate_states` on the ``[K, P]`` states.

**Gathered states in chunks.** The engine hands a gathering rule the round's states as :class:`StateChunks`:
the ``[K, P]`` matrix read a block of columns ``[K, c]`` at a time, each block gathered from the processes that
hold its rows, with ``c`` chosen so that one block fits ``--trainer.gather_budget_mb`` (all P columns, one block,
when the whole matrix does). A rule that can work block by block implements :meth:`aggregate_chunks`:
coordinate-wise rules (median, trimmed mean) apply themselves to every block (:meth:`StateChunks.apply`), rules
that compare whole states sum a per-block quantity over one pass (Krum's ``[K, K]`` squared distances) and
combine the rows they select in a second pass (:meth:`StateChunks.rows`), and a wrapper that rewrites rows
(ALIE's attackers) does so in every block as it is read (:meth:`StateChunks.map`). The default
:meth:`aggregate_chunks` reads everything at once (:meth:`StateChunks.full`) and calls :meth:`aggregate_states`.

**Clusters.** A rule with cluster-specific layers (LADD) returns its number of clusters from
:meth:`num_clusters`, names the entries kept per cluster in ``cluster_layers`` (see
:func:`fedlight.bank.cluster_entry_names`) and maps clients to clusters with :meth:`client_cluster`. The
engine then keeps a :class:`~fedlight.bank.ModelBank`: each client starts from its cluster's model, shared
entries average over all of the round's clients and cluster entries within each cluster. Rules that
name splits in ``routed_splits`` also get the metrics of every evaluation sample scored by the member
:meth:`route` picks (``…/routed/<metric>`` beside the global model's ``…/<metric>``).

**Per-client state.** A rule that keeps something of every client across rounds (a control variate, local
BatchNorm or head entries, a personal model) returns named :class:`~fedlight.client_state.Slot` s from
:meth:`client_state_slots`. Local slots are written into the state the client starts from and taken back
from its trained state; the rule reads and replaces vector slots in ``context.client_state`` during the
client's fit. The engine keeps them for every client that trained, bounded in memory and on disk in the run
folder, in the checkpoint and across processes (see :mod:`fedlight.client_state`). A ``personalised`` rule's
clients are also evaluated with their own model (:meth:`personal_state`) on their own held-out split.

**Teachers.** :meth:`client_teachers` hands frozen auxiliary models (a fixed distillation teacher, a
cluster's running-average teacher, MOON's encoders) to the client module as ``module.teachers`` for the
length of its local fit, so the client's own ``training_step`` uses them in its loss. The strategy owns
them (one frozen copy per role and process, states loaded by copy, see :class:`fedlight.teachers.Teachers`)
and checkpoints them in its :meth:`state_dict`.

Every hook has a no-op default, so a rule overrides only what it changes. Stateful rules implement
:meth:`state_dict` / :meth:`load_state_dict`; what they return must be tensors, numbers, strings and
containers of them, so checkpoints load with ``weights_only=True``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from fedlight.gather import StateChunks
from fedlight.plans import ClientPlan, ClientUpdate
from fedlight.strategies.functional import sample_clients

if TYPE_CHECKING:
    from lightning import LightningModule
    from torch import nn

    from fedlight.client_state import Slot
    from fedlight.context import RunContext


def traceable_loss(loss: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Marks a rule's ``training_loss`` as one a compiled whole step differentiates correctly: it reads the
    parameters through ``module`` at the call and keeps no tensors from it (:meth:`Strategy.loss_is_traceable`)."""
    loss.traceable = True  # type: ignore[attr-defined]
    return loss


class Strategy:
    """FedAvg-shaped defaults for every hook; subclasses override the ones their rule changes.

    Args:
        tolerate_stragglers: aggregate stragglers' partial work (F' < F epochs) instead of dropping
            them. ``null`` (the default) means the rule's own paper setting: FedAvg, FedAtt and
            Fairness drop them, FedProx and FedProto keep them.
        sampling: how the round's clients are drawn: ``proportional`` to n_k without replacement
            (the prototype-margin paper) or ``uniform`` (FedProx's code, FedSLS). ``null`` means the
            rule's own setting.

    The ``null`` defaults matter for configs: when a file switches ``class_path`` (FedAvg in a base
    file, FedProx in a row file), jsonargparse keeps the ``init_args`` the new class also accepts, so a
    concrete default of the old class would silently replace the new class's.
    """

    weight_channels: int = 1
    gather_states: bool = False
    #: Entries kept per cluster (``bn``, ``backbone``, ``classifier``, ``all`` or glob patterns); ``None``: none.
    cluster_layers: str | Sequence[str] | None = None
    #: A cluster with no aggregated client restarts from the global model instead of keeping its values.
    reset_unsampled_clusters: bool = False
    #: Evaluation splits (``clients``, ``test``) whose samples are also scored by their routed bank member.
    routed_splits: tuple[str, ...] = ()
    #: Each client has a model of its own (:meth:`personal_state`), scored on its held-out split (``clients/personal``).
    personalised: bool = False
    #: Each client's own model is also scored alone on the global test set, and ``test/personal`` is the mean of
    #: the clients' scores (a Local-only row's number).
    personal_test: bool = False
    #: The rule's paper settings, used where the constructor gets ``None``.
    default_tolerate_stragglers: bool = False
    default_sampling: Literal["proportional", "uniform"] = "proportional"

    def __init__(
        self,
        tolerate_stragglers: bool | None = None,
        sampling: Literal["proportional", "uniform"] | None = None,
    ) -> None:
        self.tolerate_stragglers = (
            self.default_tolerate_stragglers if tolerate_stragglers is None else tolerate_stragglers
        )
        self.sampling = self.default_sampling if sampling is None else sampling

    # -- plan ---------------------------------------------------------------------------------------
    def sample_clients(self, num_samples: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
        """Returns the sorted indices of the round's ``k`` clients."""
        return sample_clients(num_samples, k, rng, proportional=self.sampling == "proportional")

    # -- hooks ---------------------------------------------------------------------------------------
    def check(self, module: LightningModule, datamodule: Any) -> list[str]:
        """Why this rule cannot train ``module`` on ``datamodule`` (set up), one sentence per problem naming the rule
        and the fix; empty when it can. Called at set-up, before the run folder is created or a client trains."""
        return []

    def check_round_size(self, sampled: int, trained: int) -> list[str]:
        """Why this rule cannot run rounds of ``sampled`` clients (``--trainer.clients_per_round``) of which
        ``trained`` train (less the stragglers the rule drops), one sentence per problem naming the flag; empty when
        it can. Called at set-up, with :meth:`check`, before the run folder is created."""
        return []

    def on_fit_start(self, context: RunContext) -> None:
        """Called once before the first round (also after a resume)."""

    def client_state_slots(self, context: RunContext) -> Mapping[str, Slot]:
        """The per-client state the rule keeps for every client that trains, by name (none by default).

        Read once, after :meth:`on_fit_start`. See :mod:`fedlight.client_state` for the two kinds of slot.
        """
        return {}

    def personal_state(
        self, context: RunContext, client: int, values: Mapping[str, torch.Tensor], start: torch.Tensor
    ) -> torch.Tensor:
        """For ``personalised`` rules: the ``[P]`` state of client ``client``'s own model, from its slots ``values``
        (their ``init`` for a client that has not trained yet); ``start`` is W^t with the client's local slots,
        which is the default."""
        return start

    def on_round_start(self, context: RunContext, round_idx: int, plans: list[ClientPlan]) -> None:
        """Called on every rank before any client of the round trains."""

    def initial_state(self, context: RunContext, plan: ClientPlan, global_state: torch.Tensor) -> torch.Tensor:
        """Returns the flat state client ``plan.client`` starts from: ``global_state`` by default, which is W^t, or
        for rules with clusters, W^t with the client's cluster values (its member of the bank)."""
        return global_state

    def client_teachers(self, context: RunContext, plan: ClientPlan) -> Mapping[str, nn.Module]:
        """Frozen models the client's loss may use, by role; set as ``module.teachers`` during its local fit."""
        return {}

    def on_client_fit_start(self, context: RunContext, module: LightningModule, plan: ClientPlan) -> None:
        """Called with the received state loaded and the module in train mode, before the first step."""

    def transform_batch(self, context: RunContext, client: int, batch: Any) -> Any:
        """Returns the local training batch client ``client`` trains on, from the one its data gave (default: as is).

        Called on every batch of a round's local fit, as it is drawn, before ``training_step`` (in the sequential
        and the vectorised loop alike); e.g. an attacker's flipped labels. It must not change the batch's size.
        """
        return batch

    @traceable_loss
    def training_loss(self, module: LightningModule, batch: Any, outputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Returns the loss to minimise; ``outputs`` is what ``module.training_step`` returned."""
        return outputs["loss"]

    def loss_is_traceable(self) -> bool:
        """Whether ``training_loss`` can run inside a compiled whole step (``--trainer.compile_steps``).

        The whole step differentiates the loss with ``torch.func``, over copies of the parameters that it swaps
        into ``module`` for the call: a loss that reads the parameters through ``module`` at the call (its
        forward pass, ``module.parameters()``) is differentiated as in the eager step, but one that uses
        parameter objects it kept from ``on_client_fit_start`` would see constants, and its term would add
        nothing to the gradient. So the answer is the loss's own: the class whose ``training_loss`` is in use
        marks it with :func:`traceable_loss` once it reads the parameters through ``module`` and keeps no
        tensors from the call. A subclass that overrides ``training_loss`` is not traceable until its own loss
        is marked, whatever its parent's says.
        """
        return getattr(type(self).training_loss, "traceable", False)

    def on_client_fit_end(self, context: RunContext, module: LightningModule, update: ClientUpdate) -> None:
        """Called after local training, module in train mode; may fill ``update.payload``."""

    def client_weights(self, update: ClientUpdate) -> Sequence[float]:
        """Unnormalised weights of the client's state, one per channel: n_k by default (FedAvg)."""
        return (float(update.num_samples),) * self.weight_channels

    def channel_coefficients(self) -> Sequence[float]:
        """Mixing coefficients c_j of the channels' normalised averages (they should sum to 1)."""
        return (1.0 / self.weight_channels,) * self.weight_channels

    def aggregate_states(
        self, global_state: torch.Tensor, states: torch.Tensor, updates: list[ClientUpdate]
    ) -> torch.Tensor:
        """For ``gather_states`` rules: the new state from ``[K, P]`` client states."""
        raise NotImplementedError(f"{type(self).__name__} sets gather_states but does not aggregate them")

    def aggregate_chunks(
        self, global_state: torch.Tensor, states: StateChunks, updates: list[ClientUpdate]
    ) -> torch.Tensor:
        """For ``gather_states`` rules: the new state from the client states read in blocks of columns.

        The engine calls this one. By default all states are read at once and handed to :meth:`aggregate_states`;
        a rule that works block by block overrides it and stays within ``--trainer.gather_budget_mb``.
        """
        return self.aggregate_states(global_state, states.full(), updates)

    def server_update(
        self, global_state: torch.Tensor, aggregate: torch.Tensor, updates: list[ClientUpdate]
    ) -> torch.Tensor:
        """Returns W^{t+1} from W^t and the aggregate; FedAvg takes the aggregate as it is."""
        return aggregate

    def on_round_end(self, context: RunContext, round_idx: int, updates: list[ClientUpdate]) -> dict[str, Any]:
        """Called on every rank with all aggregated updates; returns metrics to log for the round."""
        return {}

    # -- clusters -------------------------------------------------------------------------------------
    def num_clusters(self) -> int:
        """C, the number of clusters with their own cluster entries (0: one global model). Read after
        :meth:`on_fit_start`, so a rule may find its clusters there (e.g. from the clients' styles)."""
        return 0

    def client_cluster(self, client: int) -> int:
        """The cluster of client ``client`` (for rules with clusters)."""
        raise NotImplementedError(f"{type(self).__name__} has clusters but does not map clients to them")

    def route(self, context: RunContext, batch: Any, split: str) -> torch.Tensor:
        """``[B]`` the bank member that scores each sample of an evaluation batch of ``split``."""
        raise NotImplementedError(f"{type(self).__name__} routes {split} samples but does not implement route")

    # -- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Returns the strategy's state between rounds (nothing for stateless rules)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict`."""
