"""FedGen through the engine against Algorithm 1 of Zhu et al. (ICML 2021) replayed in plain torch: a one-hidden-layer
ReLU MLP over ClientImages, full-batch SGD, rounds of partial participation. Each client step adds α_t ℓ(h(G(ε, ŷ)),
ŷ) with ŷ ~ p̂(y) (Eq. 5; and the released code's β_t KL term), the models are averaged by n_k, and after every round
the generator takes Adam steps on the α_{k,y}-weighted ensemble of the round's heads plus η times the diversity term
(Eq. 4), p̂ and α from the clients' label counters. The reference writes the generator's BatchNorm and Adam out by
hand and draws ŷ, ε from the round's strategy stream as the rule documents."""

import copy

import pytest
import torch
import torch.nn.functional as F

from fedlight.clients import ClassificationClient
from fedlight.data import FederatedDataModule
from fedlight.engine.streams import RandomStreams
from fedlight.engine.trainer import FederatedTrainer
from fedlight.errors import ConfigError
from fedlight.strategies.fedavg import FedAvg
from fedlight.strategies.fedgen import FedGen
from fedlight.testing import ClientImages, ScalarClient, ScalarDataset

SIZES, SEEDS = [6, 10, 12, 6], [8, 3, 5, 15]  # client 0 lacks class 2, client 3 class 1
LR, EPOCHS, ROUNDS, CLASSES = 0.1, 2, 3, 3
SETTINGS = {
    "generator_hidden": 6, "noise_dim": 3, "generator_steps": 3, "generator_lr": 0.01, "generated_batch_size": 5,
}  # fmt: skip
ADAM_BETAS, ADAM_EPS, BN_EPS, BN_MOMENTUM = (0.9, 0.999), 1e-8, 1e-5, 0.1


class Recorded(FedGen):
    """FedGen that notes the round's clients, every step's batch and loss, and the generator's state."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.rounds, self.batches, self.losses, self.states = [], [], [], []

    def on_fit_start(self, context):
        super().on_fit_start(context)
        self.initial = copy.deepcopy(self.state_dict())

    def on_round_start(self, context, round_idx, plans):
        super().on_round_start(context, round_idx, plans)
        self.rounds.append([plan.client for plan in plans if not plan.dropped])

    def training_loss(self, module, batch, outputs):
        loss = super().training_loss(module, batch, outputs)
        self.batches.append((batch[0].clone(), batch[1].clone()))
        self.losses.append(loss.item())
        return loss

    def on_round_end(self, context, round_idx, updates):
        metrics = super().on_round_end(context, round_idx, updates)
        self.states.append(copy.deepcopy(self.state_dict()))
        return metrics


def make_client(zero=False):
    torch.manual_seed(0)
    client = ClassificationClient(
        num_classes=CLASSES, input_shape=(1, 8, 8), model="mlp", model_kwargs={"hidden": [5]},
        optimizer=lambda params: torch.optim.SGD(params, lr=LR),
    )  # fmt: skip
    if zero:
        with torch.no_grad():
            for p in client.parameters():
                p.zero_()
    return client


def fit(root, rule, sizes=SIZES, seeds=SEEDS, rounds=ROUNDS, epochs=EPOCHS, clients_per_round=2, zero=False, **kw):
    data = FederatedDataModule(ClientImages(sizes, seeds), batch_size=1000, test_fraction=0.0)
    trainer = FederatedTrainer(
        rounds=rounds, clients_per_round=clients_per_round, local_epochs=epochs, logger=None,
        enable_progress_bar=False, default_root_dir=root, **kw,
    )  # fmt: skip
    client = make_client(zero)
    start = {name: p.detach().clone() for name, p in client.net.named_parameters()}
    trainer.fit(client, data, rule)
    return trainer, start


def weights(trainer):
    """The global model's parameters by name (``net.`` dropped)."""
    state = trainer.model.layout.to_state_dict(trainer.global_state, {})
    return {name.removeprefix("net."): value for name, value in state.items()}


def seeds(trainer, round_idx):
    """The clients' and the server's seeds of round ``round_idx``, from the run's strategy stream."""
    clients, server, _ = RandomStreams(trainer.run.seed).strategy_rng(round_idx).integers(2**62, size=3)
    return int(clients), int(server)


# -- the reference ---------------------------------------------------------------------------------------------


def generate(g, noise, labels, train):
    """G(ε, y) from the state ``g``; in train mode with batch statistics, which update g's running ones."""
    a = torch.cat([noise, F.one_hot(labels, CLASSES).float()], dim=1) @ g["body.0.weight"].T  # [B, H]
    if train:
        mean, var = a.mean(dim=0), a.var(dim=0, unbiased=False)
        with torch.no_grad():
            g["body.1.running_mean"] = (1 - BN_MOMENTUM) * g["body.1.running_mean"] + BN_MOMENTUM * mean
            unbiased = var * len(a) / (len(a) - 1)
            g["body.1.running_var"] = (1 - BN_MOMENTUM) * g["body.1.running_var"] + BN_MOMENTUM * unbiased
            g["body.1.num_batches_tracked"] = g["body.1.num_batches_tracked"] + 1
    else:
        mean, var = g["body.1.running_mean"], g["body.1.running_var"]
    h = torch.relu((a - mean) / torch.sqrt(var + BN_EPS) * g["body.1.weight"] + g["body.1.bias"])
    return h @ g["out.weight"].T + g["out.bias"]  # [B, D]


def cross_entropy(logits, labels):
    return -(logits - torch.logsumexp(logits, dim=1, keepdim=True))[torch.arange(len(labels)), labels]  # [B]


def train_generator(g, adam, heads, counts, seed, rule):
    """Eq. 4: ``generator_steps`` Adam steps on the heads' weighted ensemble (+ η L_div); returns p̂."""
    prior = counts.sum(dim=0) / counts.sum()
    alpha = counts / counts.sum(dim=0).clamp(min=1)  # [K, C] α_{k,y}
    draws = torch.Generator().manual_seed(seed)
    trained = ["body.0.weight", "body.1.weight", "body.1.bias", "out.weight", "out.bias"]
    for _ in range(rule.generator_steps):
        labels = torch.multinomial(prior, rule.generated_batch_size, replacement=True, generator=draws)
        noise = torch.randn(rule.generated_batch_size, rule.noise_dim, generator=draws)
        for name in trained:
            g[name] = g[name].detach().requires_grad_()
        z = generate(g, noise, labels, train=True)
        logits = [z @ w.T + b for w, b in heads]
        weight = [alpha[k, labels].float() for k in range(len(heads))]  # α_{k, y_i}
        if rule.ensemble == "logits":
            teacher = cross_entropy(sum(a[:, None] * g_k for a, g_k in zip(weight, logits, strict=True)), labels).mean()
        else:
            teacher = sum(a * cross_entropy(g_k, labels) for a, g_k in zip(weight, logits, strict=True)).mean()
        pairs = [
            ((noise[i] - noise[j]) ** 2).mean() * (z[i] - z[j]).abs().mean()
            for i in range(len(z)) for j in range(len(z))
        ]  # fmt: skip
        loss = teacher + rule.diversity * torch.exp(-torch.stack(pairs).mean())
        grads = torch.autograd.grad(loss, [g[name] for name in trained])
        adam["step"] += 1
        t, (b1, b2) = adam["step"], ADAM_BETAS
        for name, grad in zip(trained, grads, strict=True):
            m = adam["m"][name] = b1 * adam["m"].get(name, 0) + (1 - b1) * grad
            v = adam["v"][name] = b2 * adam["v"].get(name, 0) + (1 - b2) * grad**2
            g[name] = (g[name] - rule.generator_lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + ADAM_EPS)).detach()
    return prior


def replay(trainer, rule, start):
    """Algorithm 1 on the rounds, batches and seeds the run used, from its W^0 and G^0; the global weights, the
    generator's state after every round and every client step's loss."""
    w = [start[k] for k in ("encoder.1.weight", "encoder.1.bias", "head.weight", "head.bias")]
    g = {name: t.clone() for name, t in rule.initial["generator"].items()}
    adam, prior = {"step": 0, "m": {}, "v": {}}, torch.full((CLASSES,), 1 / CLASSES, dtype=torch.float64)
    generators, losses, steps = [], [], iter(rule.batches)
    for t, clients in enumerate(rule.rounds):
        client_seed, server_seed = seeds(trainer, t)
        alpha_t, beta_t = rule.alpha * rule.decay**t, rule.beta * rule.decay**t
        trained, sizes, counts = [], [], []
        for _ in clients:
            draws = torch.Generator().manual_seed(client_seed)  # every client of the round draws alike
            params = [p.clone().requires_grad_() for p in w]
            count = torch.zeros(CLASSES, dtype=torch.float64)
            for _ in range(EPOCHS):
                x, y = next(steps)
                a1, c1, a2, c2 = params
                logits = torch.relu(x.flatten(1) @ a1.T + c1) @ a2.T + c2
                loss = cross_entropy(logits, y).mean()
                drawn = torch.multinomial(prior, rule.generated_batch_size, replacement=True, generator=draws)
                noise = torch.randn(rule.generated_batch_size, rule.noise_dim, generator=draws)
                with torch.no_grad():
                    z = generate(g, noise, drawn, train=False)
                loss = loss + alpha_t * cross_entropy(z @ a2.T + c2, drawn).mean()  # Eq. 5
                if rule.beta > 0:
                    noise = torch.randn(len(y), rule.noise_dim, generator=draws)
                    with torch.no_grad():
                        target = torch.softmax(generate(g, noise, y, train=False) @ a2.T + c2, dim=1)
                    log_probs = torch.log_softmax(logits, dim=1)
                    loss = loss + beta_t * (target * (target.log() - log_probs)).sum() / len(y)
                losses.append(loss.item())
                count += torch.bincount(y, minlength=CLASSES)
                grads = torch.autograd.grad(loss, params)
                params = [(p - LR * d).detach().requires_grad_() for p, d in zip(params, grads, strict=True)]
            trained.append([p.detach() for p in params])
            sizes.append(len(y))
            counts.append(count)
        total = sum(sizes)
        w = [sum(n / total * p[i] for n, p in zip(sizes, trained, strict=True)) for i in range(4)]
        heads = [(p[2], p[3]) for p in trained]
        prior = train_generator(g, adam, heads, torch.stack(counts), server_seed, rule)
        generators.append({name: t.clone() for name, t in g.items()})
    got = dict(zip(("encoder.1.weight", "encoder.1.bias", "head.weight", "head.bias"), w, strict=True))
    return got, generators, losses


# -- the tests -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {"alpha": 0.7, "beta": 0.4, "decay": 0.9, "diversity": 0.5, "ensemble": "logits"},
        {"alpha": 1.5, "beta": 0.0, "decay": 1.0, "diversity": 0.0, "ensemble": "losses"},
    ],
    ids=["eq4_with_code_terms", "code_ensemble"],
)
def test_rounds_of_partial_participation_follow_algorithm_1(tmp_path, options):
    rule = Recorded(**SETTINGS, **options)
    trainer, start = fit(tmp_path, rule)
    assert len(rule.rounds) == ROUNDS and all(len(clients) == 2 for clients in rule.rounds)
    assert len({k for clients in rule.rounds for k in clients}) >= 3  # the rounds' clients differ
    expected, generators, losses = replay(trainer, rule, start)
    # (a) every client step's regularised loss
    assert rule.losses == pytest.approx(losses, rel=1e-5, abs=1e-6)
    # (b) the generator after every round: weights, BatchNorm statistics; p̂ from the round's label counters
    assert len(rule.states) == ROUNDS
    for t, (state, reference) in enumerate(zip(rule.states, generators, strict=True)):
        for name, value in reference.items():
            torch.testing.assert_close(state["generator"][name], value, rtol=1e-5, atol=1e-6, msg=f"{t}: {name}")
    # the global model
    got = weights(trainer)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert trainer.history[-1]["fedgen/ensemble_loss"] > 0


def test_the_last_round_label_counters_give_the_prior(tmp_path):
    rule = Recorded(**SETTINGS)
    fit(tmp_path, rule)
    labels = [ClientImages._draw(n, s)[1] for n, s in zip(SIZES, SEEDS, strict=True)]
    counts = sum(torch.bincount(labels[k], minlength=CLASSES) for k in rule.rounds[-1]).double()
    torch.testing.assert_close(rule.state_dict()["prior"], counts / counts.sum())
    assert [torch.bincount(y, minlength=CLASSES).tolist() for y in labels] == [
        [3, 3, 0],
        [3, 5, 2],
        [4, 5, 3],
        [5, 0, 1],
    ]


def test_one_step_from_zero_by_hand(tmp_path):
    # From all-zero weights the features relu(0) are 0 and every logit is 0, so only the head moves: its bias by
    # −η [(⅓ − π_k) + α (⅓ − π̂)], π_k client k's class shares, π̂ the shares of the ŷ drawn from p̂ = ⅓ (round 0,
    # the same draws for both clients); the average weighs the two clients by n_k / 12.
    sizes, seeds_ = [6, 6], [8, 15]
    alpha = 2.0
    rule = FedGen(**SETTINGS, alpha=alpha)
    trainer, _ = fit(tmp_path, rule, sizes, seeds_, rounds=1, epochs=1, clients_per_round=2, zero=True)
    client_seed, _ = seeds(trainer, 0)
    drawn = torch.multinomial(
        torch.full((3,), 1 / 3, dtype=torch.float64),
        5,
        replacement=True,
        generator=torch.Generator().manual_seed(client_seed),
    )
    drawn_shares = torch.bincount(drawn, minlength=3) / 5
    shares = (torch.tensor([3.0, 3.0, 0.0]) / 6 + torch.tensor([5.0, 0.0, 1.0]) / 6) / 2  # (π_0 + π_3) / 2
    got = weights(trainer)
    torch.testing.assert_close(got["head.bias"], -LR * ((1 / 3 - shares) + alpha * (1 / 3 - drawn_shares)))
    assert not got["encoder.1.weight"].any() and not got["encoder.1.bias"].any()
    assert got["head.weight"].any()  # the generated features are not 0: the regulariser moves the head's weight
    # FedAvg moves the bias by the real batches alone
    fedavg, _ = fit(tmp_path, FedAvg(), sizes, seeds_, rounds=1, epochs=1, clients_per_round=2, zero=True)
    torch.testing.assert_close(weights(fedavg)["head.bias"], -LR * (1 / 3 - shares))


def test_without_its_terms_it_is_fedavg(tmp_path):
    rule = Recorded(**SETTINGS, alpha=0.0, beta=0.0)
    trainer, _ = fit(tmp_path, rule)
    fedavg, _ = fit(tmp_path, FedAvg(sampling="uniform"))
    assert torch.equal(trainer.global_state, fedavg.global_state)
    # the generator still learns from the heads
    assert not torch.equal(rule.states[-1]["generator"]["out.weight"], rule.initial["generator"]["out.weight"])


def test_a_resumed_run_equals_a_straight_one(tmp_path):
    straight, _ = fit(tmp_path / "straight", FedGen(**SETTINGS, beta=0.5, decay=0.9))
    first, _ = fit(tmp_path / "first", FedGen(**SETTINGS, beta=0.5, decay=0.9), rounds=1)
    assert first.run.strategy.state_dict()["optimizer"]["state"]  # Adam has moments to carry over
    ckpt = first.run_dir / "checkpoints" / "last.ckpt"
    data = FederatedDataModule(ClientImages(SIZES, SEEDS), batch_size=1000, test_fraction=0.0)
    resumed = FederatedTrainer(
        rounds=ROUNDS, clients_per_round=2, local_epochs=EPOCHS, logger=None, enable_progress_bar=False,
        default_root_dir=tmp_path / "first",
    )  # fmt: skip
    resumed.fit(make_client(), data, FedGen(**SETTINGS, beta=0.5, decay=0.9), ckpt_path=ckpt)
    assert torch.equal(resumed.global_state, straight.global_state)
    a, b = resumed.run.strategy.state_dict(), straight.run.strategy.state_dict()
    for name, value in b["generator"].items():
        assert torch.equal(a["generator"][name], value), name
    assert torch.equal(a["prior"], b["prior"])
    for index, moments in b["optimizer"]["state"].items():
        for key, value in moments.items():
            assert torch.equal(a["optimizer"]["state"][index][key], value), (index, key)


def test_bad_settings_are_refused(tmp_path):
    with pytest.raises(ConfigError) as err:
        FedGen(generated_batch_size=1, generator_lr=0.0, alpha=-1.0, decay=1.5, noise_dim=0)
    message = str(err.value)
    for flag in ("generated_batch_size ≥ 2", "generator_lr > 0", "alpha ≥ 0", "decay in (0, 1]", "noise_dim ≥ 1"):
        assert f"--strategy.init_args.{flag}" in message, flag
    with pytest.raises(ConfigError, match="ensemble logits"):
        FedGen(ensemble="mean")
    # no head, no features, regression targets: refused at set-up, before any round
    data = FederatedDataModule(ScalarDataset([4, 6], [1.0, 2.0]), batch_size=100)
    trainer = FederatedTrainer(rounds=1, clients_per_round=2, logger=None, default_root_dir=tmp_path)
    with pytest.raises(ConfigError) as err:
        trainer.fit(ScalarClient(), data, FedGen())
    message = str(err.value)
    assert "head='net.head'" in message and "forward_features" in message and "integer class" in message
    assert not trainer.history
