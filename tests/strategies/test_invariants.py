"""Invariants every aggregation rule must satisfy, through the engine.

Rules that need nothing but a state run on :class:`ScalarClient`: each client minimises ½(w − y_k)² from
the global w. Rules that read features, convolutions or previous local models (FedDecorr, MOON, FedSLS,
FedSL, FedProto) run on a small CNN classifier over 8×8 images, in full batches so that a client's result does
not depend on its batch order. The rules differ in how they combine the results, but none may move identical
clients, change a lone client's result (a server optimiser such as FedAdam steps towards it instead), depend on
the order of the clients or lose anything across a checkpoint. Wrappers around a rule (robust aggregation,
attacks, differential privacy) are held to what they promise: none depends on the order of the clients or loses
anything across a checkpoint, and a wrapper with nothing to do (no outlier to reject, no noise, a clip it never
reaches) is the rule it wraps. Rules that keep per-client state (SCAFFOLD, FedDyn, FedBN, FedPer, FedRep, Ditto)
read it through the engine during a fit, so they run on the CNN only; FedBN's CNN has BatchNorm layers. The rules
that train their own kind of client (FedCC's centroids, clustered and LADD's cluster banks) have their tester in
``test_invariants_clustered.py``.
"""

import pytest
import torch

from fedlight.clients import ClassificationClient
from fedlight.data import FederatedDataModule
from fedlight.engine.trainer import FederatedTrainer
from fedlight.strategies import (
    APFL,
    CCVR,
    DPSGD,
    MOON,
    SCAFFOLD,
    Attack,
    Ditto,
    DPFedAvg,
    ElasticAggregation,
    Fairness,
    FedAdagrad,
    FedAdam,
    FedADMM,
    FedALA,
    FedAtt,
    FedAU,
    FedAvg,
    FedAvgM,
    FedBABU,
    FedBN,
    FedDecorr,
    FedDyn,
    FedExP,
    FedFomo,
    FedGen,
    FedLC,
    FedNova,
    FedPAC,
    FedPer,
    FedProto,
    FedProx,
    FedRep,
    FedRoD,
    FedSL,
    FedSLS,
    FedYogi,
    KNNPer,
    LGFedAvg,
    LocalDP,
    LocalOnly,
    PerFedAvg,
    PFedMe,
    QFedAvg,
    RobustAggregation,
    TanFedProto,
)
from fedlight.strategies.client_privacy import ClientPrivacy
from fedlight.testing import ClientImages, ScalarClient, ScalarDataset

STRATEGIES = {
    "fedavg": FedAvg,
    "fedprox": lambda: FedProx(mu=0.5),
    "fedatt": lambda: FedAtt(sigma=0.0),
    "fairness": Fairness,
    "fedavgm": lambda: FedAvgM(momentum=0.5),
    "fednova": FedNova,
    "fedau": FedAU,
    "fedadagrad": lambda: FedAdagrad(server_lr=0.5, tau=0.1),
    "fedyogi": lambda: FedYogi(server_lr=0.5, tau=0.1),
    "fedadam": lambda: FedAdam(server_lr=0.5, tau=0.1),
    "qfedavg": lambda: QFedAvg(q=1.0),
    "fedexp": FedExP,
    "fedexp_iterate": lambda: FedExP(average_last_two=False),
    "fedadmm": lambda: FedADMM(rho=0.5),
    "elastic": lambda: ElasticAggregation(sensitivity="loss"),
    "fedfomo": lambda: FedFomo(num_models=2),
}
# Server optimisers take one adaptive step towards a lone client instead of landing on it; test_fedopt.py holds them
# to Algorithm 2 of their paper, test_qfedavg.py q-FedAvg (whose step is shortened by q F^{q−1}‖Δw‖²) to its own.
# Every other rule's aggregate of one client is that client.
# FedADMM's lone client sends w + y/ρ with y = ρ(w − θ), so the server lands on 2w − θ rather than on w.
# Elastic aggregation scales a lone client's step by ζ ≠ 1; FedFomo keeps no global model (W stays W^0).
SERVER_OPTIMISERS = {"fedadagrad", "fedyogi", "fedadam", "qfedavg", "fedadmm", "elastic", "fedfomo"}
# Rules that need a network with features and convolutions; every rule of STRATEGIES runs there too.
IMAGE_STRATEGIES = {
    "fedavg": FedAvg,
    "feddecorr": lambda: FedDecorr(beta=1.0),
    "moon": lambda: MOON(mu=1.0),
    "fedsls": lambda: FedSLS(server_lr=0.5),
    "fedsls_dynamic": lambda: FedSLS(mode="dynamic"),
    "fedsl": lambda: FedSL(factor=2),
    "fedavgm": lambda: FedAvgM(momentum=0.5),
    "fednova": FedNova,
    "fedau": FedAU,
    "fedproto": FedProto,
    "scaffold": lambda: SCAFFOLD(server_lr=0.5),
    "feddyn": lambda: FedDyn(alpha=0.1),
    "fedbn": FedBN,
    "fedper": FedPer,
    "fedrep": lambda: FedRep(head_epochs=1),
    "ditto": lambda: Ditto(lam=0.5),
    "fedadagrad": lambda: FedAdagrad(server_lr=0.05, tau=0.01),
    "fedyogi": lambda: FedYogi(server_lr=0.05, tau=0.01),
    "fedadam": lambda: FedAdam(server_lr=0.05, tau=0.01),
    "qfedavg": lambda: QFedAvg(q=1.0),
    "fedexp": FedExP,
    "fedlc": lambda: FedLC(tau=1.0),
    "fedrod": FedRoD,
    "pfedme": lambda: PFedMe(lam=15.0, inner_steps=5, personal_lr=0.05),
    "per_fedavg_hf": lambda: PerFedAvg(variant="hessian_free", alpha=0.1),
    "per_fedavg_fo": lambda: PerFedAvg(variant="first_order", alpha=0.1),
    "apfl": lambda: APFL(alpha=0.5, adapt_alpha=True),
    "fedadmm": lambda: FedADMM(rho=0.5),
    # every client's mixing weights learned on its whole data: a random s% would be drawn from each client's own
    # seed, which a permutation of the clients' data changes
    "fedala": lambda: FedALA(layer_idx=2, rand_percent=100),
    "tan_fedproto": lambda: TanFedProto(lam=1.0),
    "lg_fedavg": LGFedAvg,
    "fedbabu": lambda: FedBABU(finetune_epochs=1),
    # calibrated every round, so that a run resumed for more rounds continues as a straight run does (the default
    # calibrates after the last round only, which a 1-round run has already done)
    "ccvr": lambda: CCVR(calibrate_every=1, virtual_per_class=20, calib_steps=5),
    "knn_per": lambda: KNNPer(k=3),
    "elastic": ElasticAggregation,
    "fedfomo": lambda: FedFomo(num_models=2, val_fraction=1.0),
    "fedpac": lambda: FedPAC(lam=1.0, head_epochs=1),
    "local_only": LocalOnly,
    "fedgen": lambda: FedGen(generator_hidden=8, noise_dim=4, generator_steps=5, generated_batch_size=8),
}
# CCVR pools the clients' class covariances with N_c − 1 denominators (Eq. 4), so three identical clients give a
# covariance (3N − 3)/(3N − 1) times one client's, and different virtual features: not where one alone ends.
NOT_ONE_OF_MANY = {"ccvr"}
# Wrappers: seven clients, so that Krum's and Bulyan's f = 1 is admissible and an attacker is drawn. DP's noise is
# drawn from the run's seed, since the tests below compare separate runs (secret noise: tests/strategies/test_dp.py).
pytestmark = pytest.mark.filterwarnings("ignore:DPFedAvg draws its noise")
WRAPPERS = {
    "median": lambda: RobustAggregation(FedAvg(), aggregator="median"),
    "trimmed_mean": lambda: RobustAggregation(FedAvg(), aggregator="trimmed_mean", beta=0.2),
    "krum": lambda: RobustAggregation(FedAvg(), aggregator="krum", f=1),
    "multi_krum": lambda: RobustAggregation(FedAvg(), aggregator="multi_krum", f=1, m=3),
    "bulyan": lambda: RobustAggregation(FedAvg(), aggregator="bulyan", f=1),
    "sign_flip": lambda: Attack(FedAvg(), kind="sign_flip", fraction=0.3),
    "gaussian": lambda: Attack(FedAvg(), kind="gaussian", fraction=0.3),
    "dp": lambda: DPFedAvg(FedAvg(), clip_norm=0.5, noise_multiplier=0.8, insecure_seeded_noise=True),
    "local_dp": lambda: LocalDP(FedAvg(), clip_norm=0.5, epsilon=0.5, insecure_seeded_noise=True),
    "dp_sgd": lambda: DPSGD(FedAvg(), max_grad_norm=0.5, noise_multiplier=0.8, insecure_seeded_noise=True),
}
# …and with nothing to do: every client alike (nothing to reject), no noise and a clip never reached.
NEUTRAL_WRAPPERS = {
    "median": lambda: RobustAggregation(FedAvg(), aggregator="median"),
    "trimmed_mean": lambda: RobustAggregation(FedAvg(), aggregator="trimmed_mean", beta=0.2),
    "krum": lambda: RobustAggregation(FedAvg(), aggregator="krum", f=1),
    "bulyan": lambda: RobustAggregation(FedAvg(), aggregator="bulyan", f=1),
    "dp": lambda: DPFedAvg(FedAvg(), clip_norm=1e6, noise_multiplier=0.0),
    "local_dp": lambda: LocalDP(FedAvg(), clip_norm=1e6, epsilon=1e15, mechanism="laplace", delta=0.0),
    "dp_sgd": lambda: DPSGD(FedAvg(), max_grad_norm=1e6, noise_multiplier=0.0),
}
SEVEN = ([4, 6, 10, 8, 6, 12, 4], [1.0, -2.0, 4.0, 0.5, 1.5, -1.0, 2.0])


@pytest.fixture(params=list(STRATEGIES), ids=list(STRATEGIES))
def make_strategy(request):
    return STRATEGIES[request.param]


@pytest.fixture(params=list(IMAGE_STRATEGIES), ids=list(IMAGE_STRATEGIES))
def make_image_strategy(request):
    return IMAGE_STRATEGIES[request.param]


def fit(root, sizes, values, strategy, rounds=1, lr=1.0, init=0.0, ckpt_path=None, **trainer_kwargs):
    """Returns the trainer after ``rounds`` rounds from w = ``init``.

    Client k trains on int(0.5·sizes[k]) samples of target values[k], in one full batch per epoch.
    """
    data = FederatedDataModule(ScalarDataset(sizes, values), batch_size=10_000, test_fraction=0.5)
    trainer_kwargs = {"clients_per_round": len(sizes), "local_epochs": 1, **trainer_kwargs}
    trainer = FederatedTrainer(
        rounds=rounds, logger=None, enable_progress_bar=False, default_root_dir=root, **trainer_kwargs
    )
    client = ScalarClient(lr=lr)
    with torch.no_grad():
        client.w.fill_(init)
    trainer.fit(client, data, strategy, ckpt_path=ckpt_path)
    return trainer


def test_identical_clients_are_a_fixed_point(make_strategy, tmp_path):
    trainer = fit(tmp_path, [6, 8, 12], [1.5, 1.5, 1.5], make_strategy(), rounds=3, lr=0.5, init=1.5, local_epochs=2)
    assert trainer.global_state.item() == pytest.approx(1.5, abs=1e-7)
    # From elsewhere, identical clients end where any one of them would alone.
    many = fit(tmp_path, [6, 8, 12], [1.5, 1.5, 1.5], make_strategy(), lr=0.5, local_epochs=2)
    alone = fit(tmp_path, [8], [1.5], make_strategy(), lr=0.5, local_epochs=2)
    assert many.global_state.item() == pytest.approx(alone.global_state.item(), abs=1e-7)


@pytest.mark.parametrize("name", [name for name in STRATEGIES if name not in SERVER_OPTIMISERS])
def test_one_client_reproduces_itself(name, tmp_path):
    # Two half steps of SGD on ½(w − 3)² (plus FedProx's term): whatever the client reaches is the new model.
    make_strategy = STRATEGIES[name]
    one = fit(tmp_path, [7], [3.0], make_strategy(), lr=0.5, local_epochs=2)
    client = ScalarClient(lr=0.5)
    strategy = make_strategy()
    optimizer = client.configure_optimizers()
    strategy.on_client_fit_start(None, client, None)
    for _ in range(2):
        loss = strategy.training_loss(client, None, client.training_step((None, torch.full((3,), 3.0)), 0))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert one.global_state.item() == pytest.approx(client.w.item())


def test_result_does_not_depend_on_client_order(make_strategy, tmp_path):
    sizes, values = [4, 6, 10, 8], [1.0, -2.0, 4.0, 0.5]
    order = [2, 0, 3, 1]
    kwargs = {"rounds": 2, "lr": 0.5, "local_epochs": 2}
    w = fit(tmp_path, sizes, values, make_strategy(), **kwargs).global_state
    w_permuted = fit(tmp_path, [sizes[i] for i in order], [values[i] for i in order], make_strategy(), **kwargs)
    torch.testing.assert_close(w_permuted.global_state, w)


def test_state_round_trips(make_strategy, tmp_path):
    strategy, clone = make_strategy(), make_strategy()
    clone.load_state_dict(strategy.state_dict())
    assert clone.state_dict() == strategy.state_dict()
    # Through a checkpoint: 1 round, then resume for a second, equals 2 rounds in one go.
    sizes, values = [4, 6, 10], [1.0, -2.0, 4.0]
    straight = fit(tmp_path, sizes, values, make_strategy(), rounds=2, lr=0.5, local_epochs=2)
    first = fit(tmp_path, sizes, values, make_strategy(), rounds=1, lr=0.5, local_epochs=2)
    ckpt = first.run_dir / "checkpoints" / "last.ckpt"
    resumed = fit(tmp_path, sizes, values, make_strategy(), rounds=2, lr=0.5, local_epochs=2, ckpt_path=ckpt)
    torch.testing.assert_close(resumed.global_state, straight.global_state, rtol=0, atol=0)


# -- rules on a CNN ------------------------------------------------------------------------------------


def fit_images(root, sizes, seeds, strategy, rounds=2, ckpt_path=None):
    """Returns the trainer after ``rounds`` rounds of every client, 2 full-batch SGD steps each, from one W^0."""
    data = FederatedDataModule(ClientImages(sizes, seeds), batch_size=1000, test_fraction=0.0)
    trainer = FederatedTrainer(
        rounds=rounds, clients_per_round=len(sizes), local_epochs=2, logger=None, enable_progress_bar=False,
        default_root_dir=root,
    )  # fmt: skip
    torch.manual_seed(0)
    client = ClassificationClient(
        num_classes=3,
        input_shape=(1, 8, 8),
        model="cnn",
        model_kwargs={"hidden": 8, "batch_norm": isinstance(strategy, FedBN)},
        optimizer=lambda params: torch.optim.SGD(params, lr=0.05),
    )
    trainer.fit(client, data, strategy, ckpt_path=ckpt_path)
    return trainer


@pytest.mark.parametrize("name", [name for name in IMAGE_STRATEGIES if name not in NOT_ONE_OF_MANY])
def test_identical_image_clients_end_where_one_alone_does(name, tmp_path):
    make_image_strategy = IMAGE_STRATEGIES[name]
    many = fit_images(tmp_path, [12, 12, 12], [7, 7, 7], make_image_strategy())
    alone = fit_images(tmp_path, [12], [7], make_image_strategy())
    torch.testing.assert_close(many.global_state, alone.global_state, rtol=1e-5, atol=1e-6)


def test_image_result_does_not_depend_on_client_order(make_image_strategy, tmp_path):
    sizes, seeds = [10, 14, 8], [1, 2, 3]
    order = [2, 0, 1]
    w = fit_images(tmp_path, sizes, seeds, make_image_strategy()).global_state
    permuted = fit_images(tmp_path, [sizes[i] for i in order], [seeds[i] for i in order], make_image_strategy())
    # summation orders differ (batch order, BatchNorm statistics): float noise, which FedDecorr's
    # standardisation of near-constant features amplifies
    torch.testing.assert_close(permuted.global_state, w, rtol=1e-4, atol=1e-5)


def test_image_state_round_trips_through_a_checkpoint(make_image_strategy, tmp_path):
    sizes, seeds = [10, 14, 8], [1, 2, 3]
    straight = fit_images(tmp_path, sizes, seeds, make_image_strategy(), rounds=3)
    first = fit_images(tmp_path, sizes, seeds, make_image_strategy(), rounds=1)
    ckpt = first.run_dir / "checkpoints" / "last.ckpt"
    resumed = fit_images(tmp_path, sizes, seeds, make_image_strategy(), rounds=3, ckpt_path=ckpt)
    torch.testing.assert_close(resumed.global_state, straight.global_state, rtol=0, atol=0)
    strategy, clone = resumed.run.strategy, make_image_strategy()
    clone.load_state_dict(strategy.state_dict())
    _assert_same_state(clone.state_dict(), strategy.state_dict())


def _assert_same_state(a, b):
    assert type(a) is type(b)
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_same_state(a[key], b[key])
    elif isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    else:
        assert a == b


# -- wrappers around a rule ------------------------------------------------------------------------------


# An attack's attackers are client identities drawn from the run's stream: permuting which data each client
# holds changes what the attackers send, so attacks are held to the round trip only (and, in
# test_robust_distributed.py, to giving one process's result with two).
# Local DP's and DP-SGD's noise is drawn per client identity too (each client its own stream), so the same holds.
@pytest.mark.parametrize(
    "name", [name for name in WRAPPERS if not isinstance(WRAPPERS[name](), Attack | ClientPrivacy)]
)
def test_a_wrapped_result_does_not_depend_on_client_order(name, tmp_path):
    (sizes, values), order = SEVEN, [5, 2, 0, 6, 3, 1, 4]
    kwargs = {"rounds": 2, "lr": 0.5, "local_epochs": 2}
    w = fit(tmp_path, sizes, values, WRAPPERS[name](), **kwargs).global_state
    permuted = fit(tmp_path, [sizes[i] for i in order], [values[i] for i in order], WRAPPERS[name](), **kwargs)
    torch.testing.assert_close(permuted.global_state, w)


@pytest.mark.parametrize("name", list(WRAPPERS))
def test_a_wrapped_state_round_trips_through_a_checkpoint(name, tmp_path):
    sizes, values = SEVEN
    straight = fit(tmp_path, sizes, values, WRAPPERS[name](), rounds=3, lr=0.5)
    first = fit(tmp_path, sizes, values, WRAPPERS[name](), rounds=1, lr=0.5)
    ckpt = first.run_dir / "checkpoints" / "last.ckpt"
    resumed = fit(tmp_path, sizes, values, WRAPPERS[name](), rounds=3, lr=0.5, ckpt_path=ckpt)
    torch.testing.assert_close(resumed.global_state, straight.global_state, rtol=0, atol=0)
    clone = WRAPPERS[name]()
    clone.load_state_dict(resumed.run.strategy.state_dict())
    _assert_same_state(clone.state_dict(), resumed.run.strategy.state_dict())


@pytest.mark.parametrize("name", list(NEUTRAL_WRAPPERS))
def test_a_wrapper_with_nothing_to_do_is_the_rule_it_wraps(name, tmp_path):
    sizes, values = SEVEN[0], [1.5] * 7  # identical clients: no outlier to reject
    wrapped = fit(tmp_path, sizes, values, NEUTRAL_WRAPPERS[name](), rounds=2, lr=0.5, init=-1.0)
    plain = fit(tmp_path, sizes, values, FedAvg(), rounds=2, lr=0.5, init=-1.0)
    assert wrapped.global_state.item() == pytest.approx(plain.global_state.item(), abs=1e-6)
    assert plain.global_state.item() != pytest.approx(-1.0)  # the rounds did move the model


def test_a_wrapper_keeps_its_rule_s_per_client_state_and_personal_scores(tmp_path):
    def fit(strategy):
        # equal sizes: DPFedAvg averages the updates uniformly over K', FedAvg by n_k
        data = FederatedDataModule(ClientImages([12, 12, 12], [1, 2, 3]), batch_size=1000, test_fraction=0.5)
        trainer = FederatedTrainer(
            rounds=2, clients_per_round=2, local_epochs=2, logger=None, enable_progress_bar=False,
            default_root_dir=tmp_path,
        )  # fmt: skip
        torch.manual_seed(0)
        client = ClassificationClient(
            num_classes=3, input_shape=(1, 8, 8), model="cnn", model_kwargs={"hidden": 8},
            optimizer=lambda params: torch.optim.SGD(params, lr=0.05),
        )  # fmt: skip
        trainer.fit(client, data, strategy)
        return trainer

    plain = fit(Ditto(lam=0.5, sampling="uniform"))
    wrapped = fit(DPFedAvg(Ditto(lam=0.5, sampling="uniform"), clip_norm=1e6, noise_multiplier=0.0))
    torch.testing.assert_close(wrapped.global_state, plain.global_state)
    personal = {key: value for key, value in plain.history[-1].items() if key.startswith("clients/personal/")}
    assert personal and all(wrapped.history[-1][key] == pytest.approx(value) for key, value in personal.items())
