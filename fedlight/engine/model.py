"""The resident client module and the global model it is loaded with.

One module per process serves every client it trains and every evaluation: a local fit loads the client's
starting state into it, an evaluation loads W^t. :class:`GlobalModel` keeps the two together with what
describes them: the federated layout, the model bank (W^t and any cluster members), the integer buffers
(BatchNorm's step counters), the frozen parts, which are loaded once and never change, and the clients' own
state for rules that keep one (:mod:`fedlight.client_state`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fedlight import checkpoint as ckpt_io
from fedlight.bank import ModelBank, cluster_entry_names
from fedlight.client_state import ClientStateStore
from fedlight.errors import ConfigError
from fedlight.state import FlatState, freeze_modes, freeze_parameters

if TYPE_CHECKING:
    from fedlight.clients.base import FederatedClient
    from fedlight.context import RunContext
    from fedlight.data.datamodule import FederatedDataModule
    from fedlight.strategies.base import Strategy

log = logging.getLogger(__name__)


class GlobalModel:
    """The resident ``module``, its federated ``layout`` and the ``bank`` whose global member is W^t.

    Args:
        module: the client module every local fit and evaluation of this process runs on.
        layout: what of it is federated.
        device: where W^t lives (the training device).
    """

    def __init__(self, module: FederatedClient, layout: FlatState, device: torch.device) -> None:
        self.module = module
        self.layout = layout
        # W^t: fp32 whatever the compute precision, on the training device.
        self.bank = ModelBank(layout.flatten(module).to(device))
        self.integers = layout.integers(module)
        self.frozen_state = layout.frozen_state(module)
        self.pending_bank: dict[str, torch.Tensor] | None = None  # a checkpoint's clusters, until the bank has them
        #: every trained client's own state, for rules that declare one
        self.client_states: ClientStateStore | None = None
        self.pending_client_states: dict[str, Any] | None = None  # a checkpoint's, until the store exists

    @property
    def global_state(self) -> torch.Tensor:
        """W^t, the ``[P]`` fp32 federated state of the global model (the bank's global member)."""
        return self.bank.global_state

    @global_state.setter
    def global_state(self, value: torch.Tensor) -> None:
        self.bank.global_state = value

    def load(self, state: torch.Tensor | None = None) -> FederatedClient:
        """The module with ``state`` (W^t by default) and the global integer buffers loaded."""
        self.layout.load(self.module, self.global_state if state is None else state, self.integers)
        return self.module

    def evaluation_module(self) -> FederatedClient:
        """The module with W^t loaded, in eval mode (for evaluation and analyses); the next local fit loads its own
        state into the same module."""
        return self.load().eval()

    def train_mode(self, module: FederatedClient | None = None) -> None:
        """Training mode, but for the frozen parts, which keep their loaded buffers."""
        module = self.module if module is None else module
        module.train()
        freeze_modes(module, self.layout.frozen_modules)

    def member(self, cluster: int | None) -> torch.Tensor:
        """The bank member a client of ``cluster`` starts from (W^t for ``None``)."""
        return self.bank.member(cluster)

    def setup_clusters(self, strategy: Strategy) -> None:
        """Gives the bank the strategy's clusters once it knows them (after its ``on_fit_start``)."""
        num_clusters = strategy.num_clusters()
        if num_clusters == 0 or self.bank.num_clusters == num_clusters:
            return  # no clusters, or restored from the checkpoint
        problems = []
        if strategy.weight_channels != 1 or strategy.gather_states:
            problems.append(
                f"{type(strategy).__name__} keeps cluster-specific layers, which the engine aggregates for rules "
                "with one weight per client and no gathered states."
            )
        if strategy.cluster_layers is None:
            problems.append(f"{type(strategy).__name__} has {num_clusters} clusters but names no cluster_layers.")
        if problems:
            raise ConfigError(*problems)
        names = cluster_entry_names(self.module, self.layout, strategy.cluster_layers)
        self.bank = ModelBank(self.global_state, self.layout.mask(names), num_clusters)
        if self.pending_bank is not None:
            self.bank.load_state_dict(self.pending_bank)
        log.info("%d clusters keep their own %d of %d entries", num_clusters, len(names), len(self.layout.entries))

    def setup_client_states(
        self, strategy: Strategy, context: RunContext, directory: Path, budget_bytes: int, keep_all: bool = False
    ) -> None:
        """Gives the run a store of the clients' own state when the strategy declares one (after its
        ``on_fit_start``), with the index of a checkpoint being resumed."""
        slots = strategy.client_state_slots(context)
        if not slots or self.client_states is not None:
            return
        num_clients = context.datamodule.num_clients
        self.client_states = ClientStateStore(slots, directory, budget_bytes, num_clients, keep_all)
        if self.pending_client_states is not None:
            self.client_states.load_state_dict(self.pending_client_states)
        store = self.client_states
        log.info("clients keep %s of their own (%d bytes each)", sorted(slots), store.client_nbytes)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the model: W^t with its integer buffers, the frozen parts, the clusters and
        the index of the clients' own states."""
        store = self.client_states
        return {
            "global_state": self.layout.to_state_dict(self.global_state, self.integers),
            "frozen_state": self.frozen_state,  # once: the same in every round
            "bank": self.bank.state_dict() if self.bank.num_clusters else None,
            "client_states": store.state_dict() if store is not None else self.pending_client_states,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Loads a checkpoint's model; its clusters wait in ``pending_bank`` until the bank has them."""
        global_state, self.integers = self.layout.from_state_dict(state["global_state"])
        self.global_state = global_state.to(self.global_state.device)
        frozen = state.get("frozen_state") or {}
        if frozen:
            self.module.load_state_dict(frozen, strict=False)
        self.frozen_state = frozen
        self.pending_bank = state.get("bank")
        self.pending_client_states = state.get("client_states")
        if self.client_states is not None and self.pending_client_states is not None:
            self.client_states.load_state_dict(self.pending_client_states)

    def checkpoint_problems(self, state: dict[str, Any]) -> list[str]:
        """Why a checkpoint's model cannot be loaded into this one (other parameters or frozen parts)."""
        saved_layout = [(name, tuple(t.shape)) for name, t in state["global_state"].items() if t.is_floating_point()]
        saved_frozen = sorted(state.get("frozen_state") or {})
        if saved_layout != self.layout.signature() or saved_frozen != sorted(self.layout.frozen_names):
            return ["its model has different parameters (names, shapes or frozen parts) than --model"]
        return []


def trains_batchnorm(module: torch.nn.Module) -> bool:
    """Whether a local fit trains a BatchNorm layer (one not frozen), which cannot normalise a batch of one sample."""
    return any(
        isinstance(layer, torch.nn.modules.batchnorm._BatchNorm) and any(p.requires_grad for p in layer.parameters())
        for layer in module.modules()
    )


def load_outside_weights(model: FederatedClient, init_from: Path | None) -> None:
    """Loads the weights a run starts from that come from outside it: the network's pretrained ones
    (``configure_model``, e.g. an ImageNet encoder), then ``init_from`` (an earlier stage's checkpoint)."""
    model.configure_model()
    if init_from is not None:
        ckpt_io.load_weights(model, init_from)


def prepare_module(
    model: FederatedClient,
    datamodule: FederatedDataModule,
    users: Sequence[Any],
    fabric: Any,
    channels_last: bool,
) -> GlobalModel:
    """The resident module of a run and W^0 (or the model a checkpoint will replace), on the training device.

    Weights from outside the run are already in ``model`` (:func:`load_outside_weights`); what the rule and the
    callbacks (``users``) need is checked, the frozen parts are frozen and the module is converted to the
    trainer's precision and memory layout.
    """
    model.class_names = datamodule.class_names  # per-class scores are named after the data's classes
    check_model(model, datamodule, users)
    freeze_parameters(model, model.frozen_modules)
    module = fabric.strategy.precision.convert_module(model).to(fabric.device)
    if channels_last:  # the flat state reads and writes parameters in logical order, whatever their layout
        module.to(memory_format=torch.channels_last)
    return GlobalModel(module, FlatState(module, model.frozen_modules), fabric.device)


def check_model(model: FederatedClient, datamodule: FederatedDataModule, users: Sequence[Any] = ()) -> None:
    """Problems with ``--model`` that would otherwise surface only in the first local fit, after the run folder
    was created: frozen parts that do not exist, optimizer settings the optimizer refuses (a negative lr); and
    what the strategy and the round callbacks (``users``) need of the model and data, their ``check``, which
    would otherwise surface after training, in the round or at the end of the run that first uses it."""
    problems = []
    submodules = dict(model.named_modules())
    unknown = [name for name in model.frozen_modules if name not in submodules]
    if unknown:
        problems.append(
            f"frozen_modules names {unknown}, which are not submodules of {type(model).__name__}; "
            f"its top-level submodules are {[n for n in submodules if n and '.' not in n]}."
        )
    optimizer = getattr(model, "optimizer", None)
    if callable(optimizer) and not isinstance(optimizer, torch.nn.Module):
        try:  # on a stand-in parameter: the model's own are not touched
            stand_in = optimizer([torch.nn.Parameter(torch.zeros(1))])
        except ValueError as err:  # torch.optim's checks of lr, momentum, betas, weight_decay…
            problems.append(f"--model.init_args.optimizer refuses its settings: {err}. Fix them in the config.")
        except Exception:  # not a params → optimizer callable after all; configure_optimizers decides
            pass
        else:
            if isinstance(stand_in, torch.optim.Optimizer) and stand_in.param_groups[0].get("lr") == 0:
                problems.append(
                    f"--model.init_args.optimizer has lr=0 ({type(stand_in).__name__}): no local step would change "
                    "the model, and the run would report an untrained one. Give it a learning rate > 0."
                )
    problems += _input_dtype_problems(model, datamodule)
    for user in users:
        problems += user.check(model, datamodule)
    if problems:
        raise ConfigError(*problems)


def _input_dtype_problems(model: FederatedClient, datamodule: FederatedDataModule) -> list[str]:
    """uint8 images (how the CIFAR-style readers keep them) reach a network that cannot take them: found in the
    first client's first step otherwise, after the run folder exists. A network that scales and standardises
    uint8 inputs itself says so with ``accepts_uint8 = True`` (fedlight's ResNets)."""
    inputs = getattr(datamodule.pool, "inputs", None)
    net = getattr(model, "net", None)
    if not isinstance(inputs, torch.Tensor) or inputs.dtype != torch.uint8 or net is None:
        return []
    if getattr(net, "accepts_uint8", False):
        return []
    return [
        f"--data gives uint8 images ({type(datamodule.dataset).__name__}), which the {type(net).__name__} network "
        "of --model cannot take: it expects floating-point inputs. Choose a network that standardises uint8 "
        "images itself (resnet18, resnet50), or a dataset that gives floats."
    ]


def probe_forward(model: FederatedClient, datamodule: FederatedDataModule, fabric: Any) -> None:
    """Evaluates the module on two training inputs of the first client that has a training batch, at set-up.

    A network that does not fit the data (an ImageNet ResNet on 1×8×8 digits, three input channels for grey
    images) would otherwise fail in every client of round 1, after the run folder exists. The pass runs in eval
    mode without gradients, on the run's device and precision, through ``validation_step``; it draws no random
    number of the run's and leaves the weights and normalisation statistics as they were.
    """
    client = next((k for k in range(datamodule.num_clients) if datamodule.num_batches(k)), None)
    if client is None:  # no client has a whole batch (drop_last): nothing trains, nothing to probe
        return
    x, y = next(datamodule.train_batches(client, torch.Generator().manual_seed(0)))[:2]
    batch = (x[:2], y[:2], torch.zeros(len(x[:2]), dtype=torch.int64, device=x.device))
    precision, training = fabric.strategy.precision, model.training
    model.eval()
    try:
        with torch.no_grad(), precision.forward_context():
            model.validation_step(precision.convert_input(batch), 0)
    except (RuntimeError, ValueError, IndexError) as err:
        net = getattr(model, "net", model)
        detail = " ".join(str(err).split())[:300]
        raise ConfigError(
            f"--model's network ({type(net).__name__}) cannot take --data's training inputs: one forward pass of "
            f"two of client {client}'s inputs, shape {tuple(x.shape[1:])} ({x.dtype}), failed at set-up with "
            f"{type(err).__name__}: {detail}. Choose a network for inputs of that shape (fedlight's registered "
            "networks adapt to --data's input_shape), or change the data's image size."
        ) from err
    finally:
        model.train(training)
