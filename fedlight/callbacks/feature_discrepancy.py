"""Feature discrepancy from a centrally trained model: MMD (Eq. 16) and FFD (Eq. 17).

Michieli & Ozay, "Prototype Guided Federated Learning of Visual Feature Representations", Sec. 5 (decision
D7). After round t, for every client k of the round's sample K^t:

- P_k^t: penultimate features (D5) of the global model W^{t+1} on client k's **held-out** (test) split;
- Q_k: features of the reference model, trained centrally (``--data.centralized=true``), on the same inputs;
- MMD_A^t = (1/|K^t|) Σ_{k ∈ K^t} MMD²_u(P_k^t, Q_k)  (Eq. 16), logged as ``analysis/mmd``, with the
  unbiased Gaussian MMD² of :func:`~fedlight.metrics.functional.maximum_mean_discrepancy` (median-heuristic
  bandwidth, D7).

K^t includes the stragglers a strategy dropped: they were sampled. Each client contributes at most
``max_samples`` held-out samples (D7 caps it at 1000), the first ones in the split's fixed order, so the same
inputs are compared in every round and in every run; the 80/20 split is itself a random draw, so they are a
random subset of the client's samples. FFD compares two runs afterwards with :func:`feature_discrepancy_gain`.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from fedlight import checkpoint as ckpt_io
from fedlight.callbacks.base import RoundCallback, features_problem
from fedlight.errors import ConfigError
from fedlight.metrics.functional.mmd import maximum_mean_discrepancy

if TYPE_CHECKING:
    from fedlight.clients.base import FederatedClient
    from fedlight.context import RunContext

_FLAG = "--trainer.callbacks (fedlight.callbacks.FeatureDiscrepancy) init_args"
#: Settings that decide the inputs and the held-out splits: the reference must have been trained on them.
_DATA_KEYS = ("data.dataset", "data.partitioner", "data.seed", "data.test_fraction")


def feature_discrepancy_gain(mmd_a: float, mmd_b: float) -> float:
    """Federated feature discrepancy FFD(A, B) = 100 · (MMD_B − MMD_A) / MMD_B (Eq. 17), in percent.

    Positive when algorithm A's features are closer to the centrally trained model's than B's (the paper's
    B is FedAvg); use the MMD of the last round, T, of each run.

    Args:
        mmd_a: MMD_A^T, ``analysis/mmd`` of the run of algorithm A.
        mmd_b: MMD_B^T, ``analysis/mmd`` of the baseline run B.

    Returns:
        FFD(A, B) in percent.

    Raises:
        ValueError: when ``mmd_b`` is 0, where the relative gain is undefined.

    Example:
        >>> feature_discrepancy_gain(0.375, 0.5)
        25.0
        >>> feature_discrepancy_gain(0.625, 0.5)
        -25.0
    """
    if mmd_b == 0:
        raise ValueError("FFD divides by the baseline's MMD, which is 0 here: the gain is undefined.")
    return 100.0 * (mmd_b - mmd_a) / mmd_b


class FeatureDiscrepancy(RoundCallback):
    """Logs ``analysis/mmd``, the mean over the round's clients of MMD²(P_k^t, Q_k) (Eq. 16, D7).

    Per-client values go to W&B as the histogram ``analysis/mmd_clients`` (in client order of the sample).

    Args:
        reference: the centrally trained model's checkpoint, ``<run_dir>/checkpoints/last.ckpt`` of a run
            with ``--data.centralized=true`` and otherwise the same data and model (e.g.
            ``conf/fedproto/synthetic/centralized.yaml``).
        every_n_rounds: measure after every this many rounds (and after the last one).
        max_samples: at most this many held-out samples per client, the first ones (D7: 1000).
        bandwidth_multipliers: sum Gaussian kernels of these multiples of the median-heuristic bandwidth,
            e.g. ``[0.5, 1.0, 2.0]`` (D7's option); ``null`` uses the median alone.
    """

    def __init__(
        self,
        reference: str,
        every_n_rounds: int = 1,
        max_samples: int = 1000,
        bandwidth_multipliers: list[float] | None = None,
    ) -> None:
        problems = []
        if every_n_rounds < 1:
            problems.append(f"Expected {_FLAG}.every_n_rounds ≥ 1, got {every_n_rounds}. 1 measures every round.")
        if max_samples < 2:
            problems.append(f"Expected {_FLAG}.max_samples ≥ 2 (the unbiased MMD² needs two), got {max_samples}.")
        if bandwidth_multipliers is not None and (
            not bandwidth_multipliers or any(m <= 0 for m in bandwidth_multipliers)
        ):
            problems.append(
                f"Expected {_FLAG}.bandwidth_multipliers to be positive factors such as [0.5, 1.0, 2.0], or null, "
                f"got {bandwidth_multipliers}."
            )
        if problems:
            raise ConfigError(*problems)
        self.reference = reference
        self.every_n_rounds = every_n_rounds
        self.max_samples = max_samples
        self.bandwidth_multipliers = bandwidth_multipliers
        self.reference_module: FederatedClient | None = None

    def check(self, module, datamodule) -> list[str]:
        problems = features_problem("fedlight.callbacks.FeatureDiscrepancy", module)
        if not Path(self.reference).is_file():
            problems.append(
                f"{_FLAG}.reference={self.reference} does not exist. Pass the last.ckpt of a centralized run, e.g. "
                "fedlight fit --config conf/fedproto/synthetic/centralized.yaml, then "
                "<run_dir>/checkpoints/last.ckpt."
            )
        return problems

    def on_fit_start(self, context: RunContext) -> None:
        """Loads the reference checkpoint into a copy of the client module (eval mode, frozen)."""
        path = Path(self.reference)
        try:
            state = ckpt_io.load(path)
        except ConfigError as err:
            raise ConfigError(f"{_FLAG}.reference={path} is not a usable fedlight checkpoint: {err}") from None
        saved_layout = [(name, tuple(t.shape)) for name, t in state["global_state"].items() if t.is_floating_point()]
        if saved_layout != context.layout.signature():
            raise ConfigError(
                f"{_FLAG}.reference={path} holds a model with other parameters (names or shapes) than --model. "
                "Train the centralized reference with this run's --model and --data."
            )
        self._warn_on_other_data(state.get("config"), context.config, path)
        reference = copy.deepcopy(context.module)
        context.layout.load(reference, *context.layout.from_state_dict(state["global_state"]))
        self.reference_module = reference.eval().requires_grad_(False)

    def on_round_end(self, context: RunContext, round_idx: int, metrics: dict[str, Any]) -> None:
        """Adds the mean MMD² over the round's sampled clients when the round is due."""
        if not context.due(round_idx, self.every_n_rounds):
            return
        assert self.reference_module is not None, "on_fit_start did not load the reference model"
        clients = [plan.client for plan in context.plans]  # K^t, dropped stragglers included
        module = context.global_module()  # W^{t+1}, eval mode

        def client_mmd(client: int) -> tuple[float, bool]:  # (MMD², whether defined)
            p, q = self._features(context, module, client)  # P_k, Q_k: [N_k, D] each
            if len(p) < 2:
                return 0.0, False
            return float(maximum_mean_discrepancy(p, q, bandwidth_multipliers=self.bandwidth_multipliers)), True

        results = context.map_clients(client_mmd, clients)
        values = torch.tensor([value for value, _ in results], dtype=torch.float64)  # MMD² per client
        measured = torch.tensor([float(defined) for _, defined in results], dtype=torch.float64)
        if not measured.any():
            warnings.warn(
                f"No client sampled in round {round_idx + 1} has 2 held-out samples; analysis/mmd is not logged.",
                stacklevel=1,
            )
            return
        if not measured.all():
            warnings.warn(
                f"{int((measured == 0).sum())} client(s) sampled in round {round_idx + 1} have fewer than 2 held-out "
                "samples; analysis/mmd averages over the others.",
                stacklevel=1,
            )
        metrics["analysis/mmd"] = values[measured > 0].mean().item()  # MMD_A^t, Eq. 16
        metrics["analysis/mmd_clients"] = values[measured > 0].float().cpu()

    @torch.no_grad()
    def _features(self, context: RunContext, module: FederatedClient, client: int) -> tuple[Tensor, Tensor]:
        """Features ``[N, D]`` of the global and the reference model on the first ≤ max_samples held-out inputs."""
        precision = context.precision
        features: tuple[list[Tensor], list[Tensor]] = ([], [])
        taken = 0
        for batch in context.datamodule.client_batches(client, split="held_out"):
            if taken >= self.max_samples:
                break
            x = precision.convert_input(batch)[0][: self.max_samples - taken]
            taken += len(x)
            with precision.forward_context():
                for model, out in zip((module, self.reference_module), features, strict=True):
                    out.append(model.net.forward_features(x).float())
        if not taken:
            empty = torch.zeros(0, module.net.num_features)
            return empty, empty
        return torch.cat(features[0]), torch.cat(features[1])

    @staticmethod
    def _warn_on_other_data(saved: dict[str, Any] | None, current: dict[str, Any] | None, path: Path) -> None:
        """Warns when the reference was trained on other data: Q_k would then not share this run's splits."""
        if saved is None or current is None:
            return
        a, b = ckpt_io.flatten_config(saved), ckpt_io.flatten_config(current)
        differences = [
            f"{key}: {a.get(key)} there, {b.get(key)} here"
            for key in sorted(set(a) | set(b))
            if key.startswith(_DATA_KEYS) and a.get(key) != b.get(key)
        ]
        if differences:
            warnings.warn(
                f"The reference {path} was trained on other data than this run ({'; '.join(differences)}); its "
                "training set may hold this run's held-out samples.",
                stacklevel=1,
            )
