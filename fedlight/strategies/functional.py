"""Pure aggregation maths shared by the strategies.

Model states travel as one flat fp32 vector (see :class:`fedlight.state.FlatState`), so every rule
here is a few tensor operations over ``[K, P]`` or ``[P]`` tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from fedlight.errors import ConfigError


def weighted_average(states: torch.Tensor, weights: torch.Tensor | Sequence[float]) -> torch.Tensor:
    """Returns Σ_k w_k θ_k / Σ_k w_k (FedAvg, Eq. 3 of the prototype-margin paper with w_k = n_k).

    Args:
        states: ``[K, P]`` client states.
        weights: ``[K]`` non-negative weights, not necessarily normalised.

    >>> weighted_average(torch.tensor([[0.0, 2.0], [4.0, 6.0]]), [1.0, 3.0])
    tensor([3., 5.])
    """
    weights = torch.as_tensor(weights, dtype=states.dtype, device=states.device)
    assert weights.shape == states.shape[:1], f"{weights.shape[0]} weights for {states.shape[0]} states"
    total = weights.sum()
    assert total > 0, f"weights must have a positive sum, got {weights.tolist()}"
    return (weights / total) @ states


def sample_clients(
    num_samples: np.ndarray,
    k: int,
    rng: np.random.Generator,
    proportional: bool = True,
) -> np.ndarray:
    """Draws ``k`` distinct clients, with probability ∝ n_k (the papers' default) or uniformly.

    Sampling ∝ n_k without replacement is sequential: each draw renormalises the remaining
    clients' sizes, as ``numpy.random.Generator.choice(..., replace=False, p=...)`` does.

    Args:
        num_samples: ``[N]`` training-sample counts of all clients.
        k: clients to draw, ``1 ≤ k ≤ N``.
        rng: the round's generator.
        proportional: ∝ n_k if true, uniform otherwise.

    Returns:
        ``[k]`` sorted client indices.

    >>> sample_clients(np.array([5, 5, 5]), 3, np.random.default_rng(0)).tolist()
    [0, 1, 2]
    """
    p = num_samples / num_samples.sum() if proportional else None
    return np.sort(rng.choice(len(num_samples), size=k, replace=False, p=p))


def straggler_plan(
    k: int, fraction: float, local_epochs: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Plans the local workload of ``k`` sampled clients, a fraction δ of them stragglers (decision D4).

    ``k − round(k·(1 − δ))`` clients, chosen uniformly, are stragglers, as in FedProx's simulation.
    A straggler manages only F' ~ UniformInt{1, …, F−1} epochs. F' = 0 is excluded on purpose: a
    client returning the received model unchanged would get the largest prototype margin. With F = 1
    there is no shorter workload, and a tolerated straggler runs the one epoch.

    Args:
        k: number of sampled clients.
        fraction: δ ∈ [0, 1].
        local_epochs: F ≥ 1.
        rng: the round's generator.

    Returns:
        ``([k] bool straggler mask, [k] int epochs)`` in the order of the sampled clients.

    >>> mask, epochs = straggler_plan(10, 0.5, 20, np.random.default_rng(0))
    >>> int(mask.sum()), bool((epochs[mask] < 20).all()), bool((epochs[~mask] == 20).all())
    (5, True, True)
    """
    num_active = round(k * (1.0 - fraction))
    mask = np.zeros(k, dtype=bool)
    mask[rng.choice(k, size=k - num_active, replace=False)] = True
    epochs = np.full(k, local_epochs, dtype=np.int64)
    if local_epochs > 1:
        epochs[mask] = rng.integers(1, local_epochs, size=int(mask.sum()))
    return mask, epochs


def parameter_step(
    global_state: torch.Tensor, aggregate: torch.Tensor, scale: float, is_parameter: torch.Tensor
) -> torch.Tensor:
    """The server step W^t + scale·(A − W^t) on parameters, and the aggregate A itself on buffers.

    A rule with a server learning rate (FedSLS's η, FedAU's η_g Σω/N, FedNova's τ_eff) steps the parameters
    from W^t towards the clients' aggregate; BatchNorm statistics are no parameters and take the aggregate.

    >>> w, a = torch.tensor([1.0, 1.0]), torch.tensor([3.0, 5.0])
    >>> parameter_step(w, a, 0.5, torch.tensor([True, False]))
    tensor([2., 5.])
    """
    return torch.where(is_parameter, global_state + scale * (aggregate - global_state), aggregate)


def server_momentum(
    global_state: torch.Tensor,
    aggregate: torch.Tensor,
    velocity: torch.Tensor,
    beta: float,
    lr: float = 1.0,
    form: str = "hsu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One FedAvgM server step (Hsu et al. 2019): returns ``(W^{t+1}, v^{t+1})``.

    With the pseudo-gradient Δ = W^t − avg_k W_k^{t+1}::

        hsu:  v ← βv + Δ,          W^{t+1} = W^t − η v
        ema:  v ← βv + (1 − β)Δ,   W^{t+1} = W^t − η v     (MOON's and FedDecorr's code)

    The EMA form is the Hsu form with the server learning rate scaled by (1 − β). β = 0 with η = 1 is FedAvg.

    Args:
        global_state: ``[P]`` W^t.
        aggregate: ``[P]`` the weighted average of the clients' states.
        velocity: ``[P]`` v, zeros before the first round.
        beta: β ∈ [0, 1).
        lr: η, the server learning rate.
        form: ``hsu`` or ``ema``.

    Two rounds with the same pseudo-gradient 1: v = 1 then 0.5·1 + 1 = 1.5.

    >>> w, v = server_momentum(torch.tensor([5.0]), torch.tensor([4.0]), torch.zeros(1), beta=0.5)
    >>> w, v = server_momentum(w, w - 1.0, v, beta=0.5)
    >>> w.item(), v.item()
    (2.5, 1.5)
    """
    if form not in ("hsu", "ema"):
        raise ConfigError(f"Expected --strategy.init_args.form to be 'hsu' or 'ema', got {form!r}.")
    pseudo_gradient = global_state - aggregate  # Δ: updates are the opposite of gradients
    step = pseudo_gradient if form == "hsu" else (1.0 - beta) * pseudo_gradient
    velocity = beta * velocity + step
    return global_state - lr * velocity, velocity


def adaptive_server_step(
    global_state: torch.Tensor,
    aggregate: torch.Tensor,
    first_moment: torch.Tensor,
    second_moment: torch.Tensor,
    variant: str,
    lr: float,
    beta1: float,
    beta2: float,
    tau: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One server step of FedAdagrad, FedYogi or FedAdam (Reddi et al., ICLR 2021, Algorithm 2): ``(x, m, v)``.

    With Δ_t = avg_k x_k − x_t, the clients' average update (line 10)::

        m_t = β1 m_{t−1} + (1 − β1) Δ_t                              (line 11)
        adagrad:  v_t = v_{t−1} + Δ_t²                               (line 12)
        yogi:     v_t = v_{t−1} − (1 − β2) Δ_t² sign(v_{t−1} − Δ_t²)   (line 13)
        adam:     v_t = β2 v_{t−1} + (1 − β2) Δ_t²                    (line 14)
        x_{t+1} = x_t + η m_t / (√v_t + τ)                           (line 15)

    all per coordinate. There is no bias correction of m or v: Algorithm 2 has none.

    Args:
        global_state: ``[P]`` x_t.
        aggregate: ``[P]`` the average of the clients' states, x_t + Δ_t.
        first_moment: ``[P]`` m_{t−1}, zeros before the first round.
        second_moment: ``[P]`` v_{t−1}, at least τ² before the first round.
        variant: ``adagrad``, ``yogi`` or ``adam``.
        lr: η, the server learning rate.
        beta1: β1 ∈ [0, 1), the decay of m.
        beta2: β2 ∈ [0, 1), the decay of v (unused by Adagrad).
        tau: τ > 0, the degree of adaptivity.

    One round of each from x = 0, Δ = 4, m = 0, v = τ² = 9, with η = 2, β1 = 0.5, β2 = 0.75: m = 2, and
    v = 9 + 16 = 25 (Adagrad), 9 + 0.25·16 = 13 (Yogi: v < Δ², so v grows), 0.75·9 + 0.25·16 = 10.75 (Adam).

    >>> zero, four = torch.zeros(1), torch.full((1,), 4.0)
    >>> x, m, v = adaptive_server_step(zero, four, zero, torch.full((1,), 9.0), "adagrad", 2.0, 0.5, 0.75, 3.0)
    >>> x.item(), m.item(), v.item()  # x = 2·2 / (5 + 3)
    (0.5, 2.0, 25.0)
    >>> [adaptive_server_step(zero, four, zero, torch.full((1,), 9.0), kind, 2.0, 0.5, 0.75, 3.0)[2].item()
    ...  for kind in ("yogi", "adam")]
    [13.0, 10.75]
    """
    delta = aggregate - global_state  # Δ_t: the clients' average update, the opposite of a gradient
    first_moment = beta1 * first_moment + (1.0 - beta1) * delta
    square = delta * delta
    if variant == "adagrad":
        second_moment = second_moment + square
    elif variant == "yogi":
        second_moment = second_moment - (1.0 - beta2) * square * torch.sign(second_moment - square)
    elif variant == "adam":
        second_moment = beta2 * second_moment + (1.0 - beta2) * square
    else:
        raise ConfigError(f"Expected a server optimiser 'adagrad', 'yogi' or 'adam', got {variant!r}.")
    return global_state + lr * first_moment / (second_moment.sqrt() + tau), first_moment, second_moment


def fednova_normalizer(steps: int, momentum: float = 0.0, lr_mu: float = 0.0) -> float:
    """FedNova's a_i: how many plain-SGD steps a client's ``steps`` local steps amount to (Wang et al. 2020).

    The client's accumulated update is w^t − w_i = η Σ_s (effective step s); d_i = (w^t − w_i)/a_i is then
    the average of the local gradients. Per step, as the official optimizer (``JYWa/FedNova``) counts:

    - plain SGD: a += 1, so a_i = τ_i;
    - momentum ρ: c ← ρc + 1, a += c, so a_i = Σ_{s=1}^{τ} Σ_{j<s} ρ^j = [τ − ρ(1 − ρ^τ)/(1 − ρ)]/(1 − ρ);
    - proximal term (η μ > 0): a ← a(1 − ημ) + 1, so a_i = Σ_{j<τ} (1 − ημ)^j (after the momentum
      increment when both are on, as in the official code).

    Args:
        steps: τ_i, the local steps run.
        momentum: ρ of SGD with momentum.
        lr_mu: η μ, the local learning rate times FedProx's μ.

    >>> fednova_normalizer(5), fednova_normalizer(2, momentum=0.5), fednova_normalizer(2, lr_mu=0.5)
    (5.0, 2.5, 1.5)
    """
    counter, normalizer = 0.0, 0.0
    for _ in range(steps):
        if momentum != 0:
            counter = counter * momentum + 1.0
            normalizer += counter
        if lr_mu != 0:
            normalizer = normalizer * (1.0 - lr_mu) + 1.0
        if momentum == 0 and lr_mu == 0:
            normalizer += 1.0
    return normalizer


def maximin_select(points: torch.Tensor, k: int, start: int = 0) -> torch.Tensor:
    """FedCC-Maximin (FUSS paper, Eq. 16): ``k`` pooled centroids chosen greedily to be far apart.

    The first pick is row ``start``; every further pick is the pooled row whose smallest Euclidean
    distance to the rows already picked is the largest (ties go to the lowest index). The paper starts
    from a random centroid; the official code always starts from the first pooled row (client 0,
    centroid 0), hence the default. Draw ``start`` from a generator for the paper's variant. The
    distances are taken on the raw rows, as the official code does, although clients assign pixels
    by cosine similarity: normalise the rows first to select by angle.

    Args:
        points: ``[P, D]`` pooled centroids of all clients (Eq. 14), ``P ≥ k``.
        k: number of global centroids.
        start: index of the first pick.

    Returns:
        ``[k, D]`` copies of the selected rows, in the order they were picked.

    Row 0 first, then the farthest row (2), then the row farthest from both (1):

    >>> maximin_select(torch.tensor([[0.0, 0.0], [1.0, 0.0], [5.0, 0.0], [4.0, 0.0]]), 3).tolist()
    [[0.0, 0.0], [5.0, 0.0], [1.0, 0.0]]
    """
    assert points.ndim == 2, f"expected pooled centroids [P, D], got shape {tuple(points.shape)}"
    assert 1 <= k <= points.shape[0], f"cannot select {k} of {points.shape[0]} pooled centroids"
    assert 0 <= start < points.shape[0], f"start row {start} out of range for {points.shape[0]} rows"
    selected = [start]
    nearest = torch.cdist(points, points[start : start + 1]).squeeze(1)  # [P] distance to the selected set
    for _ in range(k - 1):
        pick = int(torch.argmax(nearest))
        selected.append(pick)
        nearest = torch.minimum(nearest, torch.cdist(points, points[pick : pick + 1]).squeeze(1))
    return points[selected].clone()


def kmeans_centroids(
    points: torch.Tensor, k: int, seed: int = 42, n_init: int = 10, normalize: bool = False
) -> torch.Tensor:
    """FedCC-kMeans (FUSS paper, Eq. 15): the ``k`` k-means centres of the pooled centroids.

    scikit-learn's ``KMeans`` (k-means++ seeding, ``n_init`` restarts, ``random_state=seed``) on the raw
    rows, as the official code runs it. With ``normalize`` the rows are L2-normalised first, so that the
    clustering agrees with the cosine assignment the clients use; the centres are then means of unit
    vectors and are returned as they are.

    Args:
        points: ``[P, D]`` pooled centroids of all clients (Eq. 14), ``P ≥ k``.
        k: number of global centroids.
        seed: ``random_state`` of ``KMeans`` (42 in the official code).
        n_init: number of k-means restarts (10 in the official code).
        normalize: L2-normalise the rows before clustering.

    Returns:
        ``[k, D]`` cluster centres, in the dtype and on the device of ``points``.

    >>> points = torch.tensor([[0.0, 0.0], [0.0, 2.0], [10.0, 0.0], [10.0, 2.0]])
    >>> sorted(kmeans_centroids(points, 2).tolist())
    [[0.0, 1.0], [10.0, 1.0]]
    """
    from sklearn.cluster import KMeans  # scikit-learn costs about a second to import; only FedCC needs it

    assert points.ndim == 2, f"expected pooled centroids [P, D], got shape {tuple(points.shape)}"
    assert 1 <= k <= points.shape[0], f"cannot find {k} clusters among {points.shape[0]} pooled centroids"
    rows = torch.nn.functional.normalize(points, dim=1) if normalize else points
    kmeans = KMeans(n_clusters=k, random_state=seed, n_init=n_init).fit(rows.detach().double().cpu().numpy())
    return torch.as_tensor(kmeans.cluster_centers_, dtype=points.dtype, device=points.device)
