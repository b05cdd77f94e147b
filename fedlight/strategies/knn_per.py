"""kNN-Per: Marfoq, Neglia, Kameni & Vidal, *Personalized Federated Learning through Local Memorization*, ICML 2022
(arXiv 2111.09360), §3: the kNN-Per hypothesis, its kNN model and the interpolation.

The global model w is trained by FedAvg. Each client m then memorises its own training split in a datastore
S_m = {(φ_w(x_i), y_i)} of the global model's embeddings (the classifier's input, ``net.forward_features``) and
predicts with the interpolation of a local k-nearest-neighbours model and the global model:

    p_m(y|x) = λ · p_kNN(y|x) + (1 − λ) · p_w(y|x),
    p_kNN(y|x) = Σ_{i ∈ N_k(x)} 1{y_i = y} exp(−d_i / T) / Σ_{i ∈ N_k(x)} exp(−d_i / T),

where N_k(x) are the k entries of S_m nearest to φ_w(x), d_i = ‖φ_w(x) − φ_w(x_i)‖² and p_w = softmax of the global
model's logits. Training is untouched, so the global model is exactly FedAvg's; kNN-Per is how clients predict.

After every ``eval_every``-th round (and the last) this rule rebuilds every client's datastore under W^{t+1} and
scores the client's held-out split with p_m, logged as ``knn_per/acc`` and ``knn_per/loss`` (Σ correct / Σ count and
the mean of −log p_m(y|x), pooled over the clients' samples as ``clients/*`` are), ``knn_per/acc_mean`` (the
unweighted mean over clients) and ``knn_per/acc_per_client``. Every client with held-out data is scored, also when
``--trainer.eval_clients`` samples the global model's evaluation. The search is exact (as the authors' faiss
``IndexFlatL2``): ``torch.cdist`` on the device that holds the embeddings, fp64, no copy to the host; datastores
are one client's training split, small enough for a [B, n_m] distance block. A client with fewer than k training
samples uses all of them. p_kNN is computed as a softmax over the k neighbours of −d_i/T, the same ratio without the
0/0 that far neighbours give when exp(−d_i/T) underflows.

The paper picks λ_m per client (with the datastore's capacity) by grid search on a validation split, from
λ ∈ {0, 0.01, …, 1}; here λ is one fixed value for every client and the datastore holds the whole training split.
The authors' code (``omarfoq/knn-per``, ``client.py``) divides the squared distance by the embedding width D times a
length scale of 1, which is this rule's default T = D; its evaluation script interpolates the kNN probabilities with
the global model's raw logits (its ``--interpolate_logits`` flag defaults to a non-empty string), whereas the paper
and this rule interpolate probabilities.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import torch

from fedlight.errors import ConfigError
from fedlight.strategies.fedavg import FedAvg

if TYPE_CHECKING:
    from lightning import LightningModule

    from fedlight.context import RunContext
    from fedlight.plans import ClientUpdate

#: p_m(y|x) is floored here in the loss, so that λ = 1 with no neighbour of the true class gives −log 10⁻¹² ≈ 27.6
PROBABILITY_FLOOR = 1e-12


def knn_probabilities(
    queries: torch.Tensor, keys: torch.Tensor, labels: torch.Tensor, num_classes: int, k: int, temperature: float
) -> torch.Tensor:
    """p_kNN(y|x) ``[B, C]`` of ``queries`` ``[B, D]`` from a datastore of ``keys`` ``[N, D]`` with ``labels`` ``[N]``:
    the k nearest keys (all N when N < k) weighted by exp(−‖q − key‖² / T).

    >>> keys, labels = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0]]), torch.tensor([0, 1, 1])
    >>> knn_probabilities(torch.zeros(1, 2), keys, labels, num_classes=3, k=2, temperature=1.0)  # 1 : e⁻¹
    tensor([[0.7311, 0.2689, 0.0000]])
    """
    distances = torch.cdist(queries, keys, compute_mode="donot_use_mm_for_euclid_dist").square()  # [B, N]
    nearest, index = distances.topk(min(k, len(keys)), dim=1, largest=False)  # [B, k]
    weights = torch.softmax(-nearest / temperature, dim=1)  # exp(−d_i/T) / Σ_j exp(−d_j/T)
    return torch.zeros(len(queries), num_classes, dtype=weights.dtype, device=weights.device).scatter_add_(
        1, labels[index], weights
    )


class KNNPer(FedAvg):
    """FedAvg for the global model; each client scored with λ · p_kNN over its own datastore + (1 − λ) · p_w.

    Args:
        lam: λ in [0, 1], the weight of the local kNN model; 0 is the global model alone. The paper chooses λ_m per
            client on validation data from a grid over [0, 1]; here one value serves every client.
        k: the number of neighbours, ≥ 1 (the paper's experiments use k ≤ 10, 10 in its main tables).
        temperature: T > 0 of the kernel exp(−d/T) on squared Euclidean distances; ``null`` is D, the embedding
            width, as the authors' code (length scale 1).
        eval_every: score the clients' held-out splits with p_m after every this many rounds and after the last;
            0 only after the last, which is when the paper builds the datastores.
        tolerate_stragglers: aggregate stragglers' partial work; ``null`` drops them, as FedAvg.
        sampling: how the round's clients are drawn; ``null`` is ``proportional`` to n_k, as FedAvg here.
    """

    def __init__(
        self,
        lam: float = 0.5,
        k: int = 10,
        temperature: float | None = None,
        eval_every: int = 1,
        tolerate_stragglers: bool | None = None,
        sampling: Literal["proportional", "uniform"] | None = None,
    ) -> None:
        problems = []
        if not 0.0 <= lam <= 1.0:
            problems.append(f"Expected --strategy.init_args.lam (λ) in [0, 1], got {lam}; 0 is the global model alone.")
        if not k >= 1:
            problems.append(f"Expected --strategy.init_args.k ≥ 1 neighbours, got {k}; the paper uses up to 10.")
        if temperature is not None and not temperature > 0:
            problems.append(
                f"Expected --strategy.init_args.temperature (T) > 0 or null (the embedding width), got {temperature}."
            )
        if not eval_every >= 0:
            problems.append(
                f"Expected --strategy.init_args.eval_every ≥ 0 (0: only after the last round), got {eval_every}."
            )
        if problems:
            raise ConfigError(*problems)
        super().__init__(tolerate_stragglers=tolerate_stragglers, sampling=sampling)
        self.lam, self.k, self.temperature, self.eval_every = lam, k, temperature, eval_every

    def check(self, module: LightningModule, datamodule: Any) -> list[str]:
        """kNN-Per embeds through ``net.forward_features`` and needs each client's own training split."""
        problems = []
        net = getattr(module, "net", None)
        if net is None or not (hasattr(net, "forward_features") and hasattr(net, "forward_head")):
            problems.append(
                "--strategy KNNPer keeps the global model's embeddings (module.net.forward_features) and its logits "
                f"(module.net.forward_head), which --model {type(module).__name__} lacks. Use "
                "fedlight.clients.ClassificationClient with a registered network."
            )
        if getattr(datamodule, "centralized", False):
            problems.append(
                "--strategy KNNPer builds every client's datastore from its own training split, which "
                "--data.centralized=true merges into one. Set --data.centralized=false."
            )
        return problems

    def on_fit_start(self, context: RunContext) -> None:
        """Checks that the embeddings are vectors [B, D], on one batch of the first client."""
        module = context.global_module()
        with torch.no_grad():
            x, _ = context.precision.convert_input(next(context.datamodule.client_batches(0, split="train")))
            with context.precision.forward_context():
                features = module.net.forward_features(x)
        if features.ndim != 2:
            raise ConfigError(
                f"--strategy KNNPer searches vector embeddings [B, D], but --model's forward_features gives "
                f"{tuple(features.shape)}. Use a classification network."
            )

    def on_round_end(self, context: RunContext, round_idx: int, updates: list[ClientUpdate]) -> dict[str, Any]:
        """``knn_per/*``: every client's held-out split scored with p_m under W^{t+1}, when due."""
        data = context.datamodule
        if not context.due(round_idx, self.eval_every) or len(data.held_out_index) == 0:
            return {}
        module = context.global_module()  # W^{t+1}, eval mode
        groups = min(data.num_eval_groups, data.num_clients)
        sums = torch.zeros(groups, 3, dtype=torch.float64, device=context.device)  # correct, count, Σ −log p_m

        def client_sums(client: int) -> torch.Tensor:
            out = torch.zeros_like(sums)
            if bool((data.held_out_group == client).any()):
                out[client] = self._score_client(context, module, client)
            return out

        sums = context.sum_over_clients(client_sums, range(groups), sums)
        correct, count, loss = sums.unbind(1)
        present = count > 0
        per_client = torch.where(present, correct / count.clamp_min(1), torch.nan)
        return {
            "knn_per/acc": float(correct.sum() / count.sum()),
            "knn_per/loss": float(loss.sum() / count.sum()),
            "knn_per/acc_mean": float(per_client[present].mean()),
            "knn_per/acc_per_client": per_client.float().cpu(),
        }

    @torch.no_grad()
    def _score_client(self, context: RunContext, module: LightningModule, client: int) -> torch.Tensor:
        """[correct, count, Σ −log p_m(y|x)] over client ``client``'s held-out split."""
        keys, labels = [], []
        for batch in context.datamodule.client_batches(client, split="train"):
            features, _, y = self._embed(context, module, batch)
            keys.append(features)
            labels.append(y)
        datastore, datastore_labels = torch.cat(keys), torch.cat(labels)  # S_m: [n_m, D], [n_m]
        temperature = self.temperature or datastore.shape[1]
        num_classes = context.datamodule.num_classes
        out = torch.zeros(3, dtype=torch.float64, device=context.device)
        for batch in context.datamodule.client_batches(client, split="held_out"):
            features, logits, y = self._embed(context, module, batch)
            p_knn = knn_probabilities(features, datastore, datastore_labels, num_classes, self.k, temperature)
            p = self.lam * p_knn + (1.0 - self.lam) * torch.softmax(logits, dim=1)  # [B, C]
            nll = -p.gather(1, y[:, None]).squeeze(1).clamp_min(PROBABILITY_FLOOR).log()
            out[0] += (p.argmax(1) == y).sum()
            out[1] += len(y)
            out[2] += nll.sum()
        return out

    @staticmethod
    def _embed(
        context: RunContext, module: LightningModule, batch: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """φ_w(x) ``[B, D]`` and the logits ``[B, C]`` of the global model in fp64, and the labels ``[B]``."""
        x, y = context.precision.convert_input(batch)
        with context.precision.forward_context():
            features = module.net.forward_features(x)
            logits = module.net.forward_head(features)
        device = context.device
        return features.to(device, torch.float64), logits.to(device, torch.float64), y.to(device).long()
