"""LADD: style-driven clustered federated self-training (Shenaj et al., *Learning Across Domains and Devices:
Style-Driven Source-Free Domain Adaptation in Clustered Federated Learning*, WACV 2023).

The server starts from a model pre-trained on a labelled source domain and adapts it on unlabelled
clients (FFREEDA). On top of :class:`~fedlight.strategies.clustered_fedavg.ClusteredFedAvg` (cluster-specific
layers, Sec. 3.3 and Eq. 3 per parameter group) this rule adds:

- **Style clusters** (Sec. 4.2, Alg. 2). Before the first round each client's style s̄_k, the mean FDA
  amplitude window of its training images (:func:`fedlight.data.style.fda.client_style`), is computed once; the
  clients are clustered by k-means with the k in ``k_range`` of highest silhouette
  (:func:`~fedlight.strategies.clustering.select_style_clusters`), or read from one of LADD's cluster files.
- **Routed evaluation** (Sec. 4.2). Every evaluation image goes to the cluster whose centroid is nearest to
  its own style and is scored by that cluster's model (``test/routed/<metric>``), beside the global model.
- **Teachers** (Sec. 4.3), handed to :class:`~fedlight.clients.self_training.SelfTrainingClient`:
  ``kd`` is the pre-trained model W^0, fixed for the whole run; ``pseudo`` is the client's cluster model w_c,
  refreshed when r mod ω = 0 (none in round 0: the student labels itself), and from round t_start on the
  cluster's SWA teacher, the running mean w_g ← (1 − a)·w_g + a·w_c, a = 1/(n + 1), of the cluster models at
  the refreshes, BatchNorm statistics included (:meth:`fedlight.teachers.Teachers.average_in`).

Images and styles. Evaluation and training batches hold normalised tensors; styles are statistics of raw
images, so the normalisation the dataset applied (``input_mean``/``input_std``, LADD's 0.5/0.5 by default) is
undone first. Routes of evaluation batches are cached by the batch's content: images and centroids do not
change during a run, and an image's FFT at 1024×512 costs more than scoring it.

Where LADD's released code differs from the paper, the paper is the default and the code's behaviour a flag
(``docs/ladd.md`` has the table; ``conf/ladd/<dataset>/released_code/`` the rows that turn them all on):

- unsampled clusters keep θ_c (the code resets them to the global model: ``reset_unsampled_clusters``);
- every cluster has its own pseudo-label teacher (the code loads each client's cluster model into one shared
  model, in the order the clients are listed, so every client gets the cluster model of the last client
  listed: ``shared_pseudo_teacher``);
- the SWA teacher averages each cluster's model with its BatchNorm statistics (``swa_of_global``: the code
  copies, at round t_start − 1, the whole model it holds then, and from t_start averages the global model's
  parameters into it, so its BatchNorm statistics stay those of the copy; the teacher is used from the first
  refresh at or after t_start − 1);
- in round 0 the students label themselves (``first_round_teacher: global``: W^0 is the teacher, as the code
  runs rows without clusters);
- every test image is scored by the cluster nearest its own style (``test_routing: released``: the code's test
  loop, :mod:`fedlight.strategies.ladd_released`, which scores each image by an unrelated image's cluster and
  reports as "global" the previous image's cluster model).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from fedlight.data.style.fda import FDA_SIZE, client_style, extract_style
from fedlight.errors import ConfigError
from fedlight.strategies import ladd_released as released
from fedlight.strategies.clustered_fedavg import ClusteredFedAvg
from fedlight.strategies.clustering import (
    cluster_centroids,
    read_cluster_file,
    route_to_cluster,
    select_style_clusters,
    write_cluster_file,
)
from fedlight.teachers import Teachers

if TYPE_CHECKING:
    from torch import nn

    from fedlight.context import RunContext
    from fedlight.data.datamodule import FederatedDataModule
    from fedlight.plans import ClientPlan, ClientUpdate

Split = Literal["clients", "test"]


def client_ids(datamodule: FederatedDataModule) -> list[str]:
    """The id of every client of a natural partition, in its order (sorted ids); ``"0"``, ``"1"``… otherwise."""
    groups = datamodule.pool.groups
    if groups is None:
        return [str(k) for k in range(datamodule.num_clients)]
    ids = [str(g) for g in np.unique(groups)]
    assert len(ids) == datamodule.num_clients, f"{len(ids)} natural ids for {datamodule.num_clients} clients"
    return ids


class LADD(ClusteredFedAvg):
    """Style-clustered FedAvg with cluster-specific layers and per-cluster pseudo-label and SWA teachers.

    Args:
        cluster_layers: entries kept per cluster (Table 7): ``bn``, ``backbone``, ``classifier`` (LADD cls),
            ``all`` (LADD all), glob patterns or a list of them.
        clustering: cluster the clients; false runs one global model with the same teachers (Table 5's rows
            without "Clu").
        clusters_file: a LADD cluster file (``{"0": [client ids], ...}``) to read instead of clustering the
            styles; ids are the dataset's natural client ids.
        k_range: ``[m, n)``, the numbers of clusters tried (4 to 19 in LADD).
        n_init: N, k-means restarts per k (10).
        fda_b: half-width b of the style window (1: LADD's 3×3; Table 6's 1×1 and 5×5 are 0 and 2).
        fda_size: ``(H, W)`` images are resized to before their spectrum is taken (LADD: 512×1024).
        input_mean: per-channel mean the dataset subtracted, undone before styles are taken.
        input_std: per-channel standard deviation the dataset divided by.
        kd_teacher: hand the pre-trained model W^0 to the clients as the distillation teacher.
        teacher_step: ω, the pseudo-label teacher is refreshed when r mod ω = 0 (r ≥ 1; r = 0 too with
            ``first_round_teacher: global``).
        swa_start: t_start, the first round whose refresh averages into the SWA teacher; null: no SWA teacher.
        reset_unsampled_clusters: a cluster without clients in a round restarts from the global model (LADD's
            code) instead of keeping its values (the paper).
        shared_pseudo_teacher: every client's pseudo-label teacher is the cluster model of the client the dataset
            lists last (the order of its split files), as LADD's code hands one shared model to every client.
        swa_of_global: LADD's code's SWA teacher, one for all clusters: at round t_start − 1 a copy of the model
            the code holds then (the global model; in runs with clusters, the cluster model of the last test
            image by its own style, which the code's test loop leaves loaded), then from t_start the running
            mean of the global model's parameters, its BatchNorm statistics staying those of the copy.
        first_round_teacher: the pseudo-label teacher of round 0, when no cluster model exists yet: ``student``
            (the student labels itself, as LADD's code does with clusters) or ``global`` (W^0, as LADD's code
            does in runs without clusters).
        test_routing: ``style``: every test image is scored by the cluster nearest its own style (the paper);
            ``released``: as LADD's released test loop scores it (:mod:`~fedlight.strategies.ladd_released`),
            and the round's metrics add that loop's "global" score, ``test/released_global/<metric>``, and how
            often its routing agrees with the images' own clusters (``routing/released_agreement``, beside the
            ``routing/chance_agreement`` of a random reassignment).
        routed_splits: evaluation splits scored by each image's style-routed cluster model.
        tolerate_stragglers: aggregate stragglers' partial work; ``null`` drops them.
        sampling: how the round's clients are drawn; ``null`` is ``uniform``, as in LADD.
    """

    def __init__(
        self,
        cluster_layers: str | list[str] = "classifier",
        clustering: bool = True,
        clusters_file: str | None = None,
        k_range: tuple[int, int] = (4, 20),
        n_init: int = 10,
        fda_b: int | None = 1,
        fda_size: tuple[int, int] = FDA_SIZE,
        input_mean: tuple[float, float, float] = (0.5, 0.5, 0.5),
        input_std: tuple[float, float, float] = (0.5, 0.5, 0.5),
        kd_teacher: bool = True,
        teacher_step: int = 1,
        swa_start: int | None = None,
        reset_unsampled_clusters: bool = False,
        shared_pseudo_teacher: bool = False,
        swa_of_global: bool = False,
        first_round_teacher: Literal["student", "global"] = "student",
        test_routing: Literal["style", "released"] = "style",
        routed_splits: Sequence[Split] = ("test", "clients"),
        tolerate_stragglers: bool | None = None,
        sampling: Literal["proportional", "uniform"] | None = None,
    ) -> None:
        flag = "--strategy.init_args"
        problems = []
        if teacher_step < 1:
            problems.append(f"Expected {flag}.teacher_step (ω) ≥ 1, got {teacher_step}.")
        if swa_start is not None and swa_start < 1:
            problems.append(f"Expected {flag}.swa_start (t_start) ≥ 1 or null (no SWA teacher), got {swa_start}.")
        if len(k_range) != 2 or k_range[0] >= k_range[1]:
            problems.append(f"Expected {flag}.k_range = [m, n) with m < n, got {list(k_range)}.")
        if min(input_std) <= 0:
            problems.append(f"Expected {flag}.input_std > 0 per channel, got {list(input_std)}.")
        if first_round_teacher not in ("student", "global"):
            problems.append(
                f"Expected {flag}.first_round_teacher to be 'student' or 'global', got {first_round_teacher!r}."
            )
        if test_routing not in ("style", "released"):
            problems.append(f"Expected {flag}.test_routing to be 'style' or 'released', got {test_routing!r}.")
        if problems:
            raise ConfigError(*problems)
        # the clusters are found in on_fit_start; one placeholder cluster until then
        super().__init__([0], cluster_layers, reset_unsampled_clusters, False, tolerate_stragglers, sampling)
        self.clustering = clustering
        self.clusters_file = clusters_file
        self.k_range = (int(k_range[0]), int(k_range[1]))
        self.n_init = n_init
        self.fda_b = fda_b
        self.fda_size = (int(fda_size[0]), int(fda_size[1]))
        self.input_mean = torch.tensor(input_mean, dtype=torch.float32)[:, None, None]  # [3, 1, 1]
        self.input_std = torch.tensor(input_std, dtype=torch.float32)[:, None, None]
        self.kd_teacher = kd_teacher
        self.teacher_step = teacher_step
        self.swa_start = swa_start
        self.shared_pseudo_teacher = shared_pseudo_teacher
        self.swa_of_global = swa_of_global
        self.first_round_teacher = first_round_teacher
        self.test_routing = test_routing
        self.routed_splits = tuple(routed_splits) if clustering else ()
        self.teachers = Teachers()
        self.styles: torch.Tensor | None = None  # s̄_k, [K, D] float64
        self.centroids: torch.Tensor | None = None  # μ_c, [C, D] float64
        self.silhouettes: dict[int, float] = {}
        self._routes: dict[tuple, torch.Tensor] = {}  # evaluation batch fingerprint → [B] cluster
        self._last_listed = 0  # the client the dataset lists last (shared_pseudo_teacher)
        self._test_own: torch.Tensor | None = None  # [N] each test image's own-style cluster, dataset order
        self._test_index: dict[str, int] = {}  # test image digest → dataset index (test_routing: released)

    def check(self, module: nn.Module, datamodule: Any) -> list[str]:
        if getattr(module, "kd_label_weights", False) and not getattr(datamodule.dataset, "train_labels", True):
            return [
                f"--model.init_args.kd_label_weights=true weighs each pixel's distillation term by its training "
                f"label, but {type(datamodule.dataset).__name__}'s clients have no labels (LADD's code leaves the "
                "term unweighted there). Set --model.init_args.kd_label_weights=false."
            ]
        return []

    # -- styles and clusters -----------------------------------------------------------------------------
    def raw_images(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, 3, H, W]`` normalised inputs → raw RGB in [0, 1] (padding may leave values just outside)."""
        return (x.float() * self.input_std.to(x.device) + self.input_mean.to(x.device)).clamp(0.0, 1.0)

    def image_styles(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, D]`` float64 FDA styles of a batch of normalised images."""
        return extract_style(self.raw_images(x), self.fda_b, self.fda_size)

    def on_fit_start(self, context: RunContext) -> None:
        """Clusters the clients by style (once: a resumed run has them) and stores W^0 as the KD teacher."""
        data = context.datamodule
        if self.centroids is None:
            ids = client_ids(data)
            if self.clustering:
                self._find_clusters(context, ids)
            else:
                self.clusters = [0] * data.num_clients
                self.centroids = torch.zeros(1, 0, dtype=torch.float64)
            self._lookup = torch.tensor(self.clusters)
            if self.clustering and context.rank == 0 and context.run_dir is not None:
                write_cluster_file(context.run_dir / "clusters.json", self.clusters, ids)
        if self.kd_teacher and "kd" not in self.teachers:
            self.teachers.set("kd", context.global_state)  # W^0: the pre-trained model (--trainer.init_from)
        self._last_listed = released.last_listed_client(data)
        if self.clustering and (self.test_routing == "released" or self.swa_of_global):
            self._find_test_clusters(context)
        super().on_fit_start(context)

    def _find_test_clusters(self, context: RunContext) -> None:
        """Every test image's own-style cluster and digest, in dataset order, as the code's test client finds them."""
        own, self._test_index = [], {}
        for x, *_ in context.datamodule.test_batches():
            own.append(route_to_cluster(self.image_styles(x).cpu(), self.centroids))
            for digest in released.image_digests(x):
                self._test_index.setdefault(digest, len(self._test_index))  # a repeated image keeps its first index
        self._test_own = torch.cat(own)

    def _find_clusters(self, context: RunContext, ids: list[str]) -> None:
        data = context.datamodule

        def style_of(client: int) -> torch.Tensor:
            images = (self.raw_images(x) for x, _ in data.client_batches(client, "train"))
            return client_style(images, self.fda_b, self.fda_size).cpu()  # [D]

        self.styles = torch.stack(context.map_clients(style_of, range(data.num_clients)))  # [K, D]
        if self.clusters_file is not None:
            labels = read_cluster_file(self.clusters_file, ids)
            centroids = cluster_centroids(self.styles.numpy(), labels)
        else:
            chosen = select_style_clusters(
                self.styles.numpy(), range(*self.k_range), self.n_init, context.seed, "--strategy.init_args.k_range"
            )
            labels, centroids, self.silhouettes = chosen.labels, chosen.centroids, chosen.silhouettes
        self.clusters = [int(c) for c in labels]
        self.centroids = torch.as_tensor(centroids, dtype=torch.float64)

    def num_clusters(self) -> int:
        return max(self.clusters) + 1 if self.clustering else 0

    def route(self, context: RunContext, batch: Any, split: str) -> torch.Tensor:
        """``[B]`` the cluster whose centroid μ_c is nearest to each image's own style (LADD, Sec. 4.2); test images
        under ``test_routing: released``, the cluster the code's test loop scores them by."""
        x = batch[0]
        sample = x[..., ::4, ::4].detach().float().cpu().contiguous().numpy()
        key = (split, tuple(x.shape), hashlib.blake2b(sample.tobytes(), digest_size=16).hexdigest())
        if key not in self._routes:
            if split == "test" and self.test_routing == "released":
                if self._test_own is None:  # an evaluation without a fit (``fedlight test``) starts here
                    self._find_test_clusters(context)
                index = torch.tensor([self._test_index[d] for d in released.image_digests(x)])
                self._routes[key] = self._released_routes()[index]
            else:
                self._routes[key] = route_to_cluster(self.image_styles(x).cpu(), self.centroids)
        return self._routes[key].to(x.device)

    def _released_routes(self) -> torch.Tensor:
        return released.released_routes(self._test_own, released.sampler_order(len(self._test_own)))

    # -- teachers ----------------------------------------------------------------------------------------
    def _teacher_cluster(self, client: int) -> int:
        if not self.clustering:
            return 0
        return self.clusters[self._last_listed if self.shared_pseudo_teacher else client]

    def _swa_from(self) -> int | None:
        """The first refresh round whose pseudo-label teacher is the SWA teacher (None: never)."""
        if self.swa_start is None:
            return None
        return self.swa_start - 1 if self.swa_of_global else self.swa_start

    def pseudo_teacher_name(self, cluster: int, round_idx: int) -> str | None:
        """The name in :attr:`teachers` of cluster ``cluster``'s pseudo-label teacher in round ``round_idx`` (None: the
        student labels itself): the one set at the last refresh, the last round r ≤ ``round_idx`` with r mod ω = 0."""
        refresh = round_idx - round_idx % self.teacher_step
        if refresh == 0 and self.first_round_teacher == "student":
            return None  # round 0: no cluster model has been trained yet, the students label themselves
        swa_from = self._swa_from()
        if swa_from is not None and refresh >= swa_from:
            return "swa/global" if self.swa_of_global else f"swa/{cluster}"
        return f"pseudo/{cluster}"

    def on_round_start(self, context: RunContext, round_idx: int, plans: list[ClientPlan]) -> None:
        """Refreshes the pseudo-label teachers when r mod ω = 0: the cluster models, or their running mean."""
        if self.swa_of_global and self.swa_start is not None and round_idx == self.swa_start - 1:
            self._copy_for_swa(context, round_idx)
        if round_idx % self.teacher_step or (round_idx == 0 and self.first_round_teacher == "student"):
            return
        swa = self.swa_start is not None and round_idx >= self.swa_start
        if swa and self.swa_of_global:
            self._average_global(context)
            return
        for cluster in range(max(self.num_clusters(), 1)):
            member = context.bank.member(cluster if self.clustering else None)  # w_c: [P]
            if swa:
                self.teachers.average_in(f"swa/{cluster}", member)  # w_g ← (1 − a)·w_g + a·w_c, a = 1/(n+1)
            else:
                self.teachers.set(f"pseudo/{cluster}", member)

    def _copy_for_swa(self, context: RunContext, round_idx: int) -> None:
        """LADD's code's SWA teacher before its first average: a copy of the model the code holds at round
        t_start − 1, whose buffers it keeps. After a round, the code's test loop has left there the cluster model
        of the last test image (by its own style) in runs with clusters, the global model otherwise."""
        held = context.global_state
        if self.clustering and round_idx > 0:
            held = context.bank.member(int(self._test_own[-1]))
        self.teachers.set("swa/global", held)
        self.teachers.counts["swa/global"] = 0  # the first average overwrites the parameters

    def _average_global(self, context: RunContext) -> None:
        """LADD's code: the global model's parameters averaged into one teacher, its buffers as copied."""
        new = context.global_state.detach().float().cpu()
        buffers = ~context.layout.parameter_mask(context.module)  # [P] BatchNorm statistics
        new = torch.where(buffers, self.teachers.states["swa/global"], new)
        self.teachers.average_in("swa/global", new)

    def client_teachers(self, context: RunContext, plan: ClientPlan) -> Mapping[str, nn.Module]:
        teachers: dict[str, nn.Module] = {}
        if "kd" in self.teachers:
            teachers["kd"] = self.teachers.module("kd", context.module, context.layout)
        name = self.pseudo_teacher_name(self._teacher_cluster(plan.client), context.round)
        if name is not None:
            teachers["pseudo"] = self.teachers.module(name, context.module, context.layout, role="pseudo")
        return teachers

    def on_round_end(self, context: RunContext, round_idx: int, updates: Sequence[ClientUpdate]) -> dict[str, Any]:
        metrics = {"clusters/k": float(self.num_clusters())}
        if self.clustering:
            metrics.update(super().on_round_end(context, round_idx, updates))
        if self.clustering and self.test_routing == "released":
            metrics.update(self._released_test_metrics(context))
        swa_counts = [n for name, n in self.teachers.counts.items() if name.startswith("swa/")]
        metrics["teachers/swa_states"] = float(max(swa_counts, default=0))
        return metrics

    def _released_test_metrics(self, context: RunContext) -> dict[str, float]:
        """The released test loop's "global" score of the new models, and how its routing meets the own clusters."""
        own, order = self._test_own, released.sampler_order(len(self._test_own))
        scores = released.score_test_set(context, released.released_global_members(own, order))
        return {
            **{f"test/released_global/{k}": v for k, v in scores.items()},
            "routing/released_agreement": float((released.released_routes(own, order) == own).double().mean()),
            "routing/chance_agreement": released.chance_agreement(own),
        }

    # -- state -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "clusters": torch.tensor(self.clusters),
            "centroids": None if self.centroids is None else self.centroids.clone(),
            "styles": None if self.styles is None else self.styles.clone(),
            "silhouettes": {str(k): v for k, v in self.silhouettes.items()},
            "teachers": self.teachers.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.clusters = [int(c) for c in state["clusters"]]
        self._lookup = torch.tensor(self.clusters)
        self.centroids = state["centroids"]
        self.styles = state["styles"]
        self.silhouettes = {int(k): float(v) for k, v in state["silhouettes"].items()}
        self.teachers.load_state_dict(state["teachers"])
