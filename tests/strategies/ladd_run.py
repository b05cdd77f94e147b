"""A small LADD run on the style-cities twin, shared by the LADD tests: data, client, rule, a recording rule."""

import torch

from fedlight.clients import SelfTrainingClient
from fedlight.data import FederatedDataModule
from fedlight.data.twins.style_cities import StyleCities
from fedlight.engine.trainer import FederatedTrainer
from fedlight.strategies import LADD

SIZE = 32
CITY_KW = dict(num_clients_per_city=2, client_size=(4, 6), num_test_per_city=3, image_size=SIZE, num_object_classes=2)


def make_data(**kwargs):
    return FederatedDataModule(
        StyleCities(**CITY_KW, **kwargs), batch_size=2, test_fraction=0.0, drop_last=True, eval_batch_size=5
    )


def make_model():
    torch.manual_seed(0)
    return SelfTrainingClient(num_classes=3, input_shape=(3, SIZE, SIZE), model="mini_deeplab", lambda_kd=1.0)


def ladd(cls=LADD, **kwargs):
    options = dict(k_range=(2, 4), n_init=2, fda_size=(SIZE, SIZE), cluster_layers="bn")
    return cls(**(options | kwargs))


def fit(tmp_path, strategy, rounds=3, callbacks=None, ckpt_path=None, **trainer_kwargs):
    trainer = FederatedTrainer(
        rounds=rounds, clients_per_round=3, local_epochs=1, logger="csv", enable_progress_bar=False,
        default_root_dir=tmp_path, callbacks=callbacks, checkpoint_every=1, **trainer_kwargs,
    )  # fmt: skip
    model = make_model()
    trainer.fit(model, make_data(), strategy, ckpt_path=ckpt_path)
    return trainer, model


class Recording(LADD):
    """Keeps each cluster's model when a round starts and the teachers each client was handed."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.members, self.globals, self.handed, self.initial = {}, {}, {}, None

    def on_fit_start(self, context):
        self.initial = context.global_state.clone()
        super().on_fit_start(context)

    def on_round_start(self, context, round_idx, plans):
        self.members[round_idx] = [context.bank.member(c).clone() for c in range(context.bank.num_clusters)]
        self.globals[round_idx] = context.global_state.clone()
        self.handed[round_idx] = {}
        super().on_round_start(context, round_idx, plans)

    def on_client_fit_start(self, context, module, plan):
        self.handed[context.round][plan.client] = {
            role: context.layout.flatten(teacher).clone() for role, teacher in module.teachers.items()
        }
