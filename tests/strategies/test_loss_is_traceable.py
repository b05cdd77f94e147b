"""Whether a rule's loss may run inside a compiled whole step is the answer of the class whose loss is in use.

A subclass that overrides ``training_loss`` alone (and might keep parameter objects across the call) must not
inherit its parent's yes: under ``--trainer.compile_steps`` its term would add nothing to the gradient.
"""

import pytest

from fedlight.strategies import (
    MOON,
    SCAFFOLD,
    FedAvg,
    FedCCMOON,
    FedCCProx,
    FedDecorr,
    FedDyn,
    FedProx,
    RobustAggregation,
)
from fedlight.strategies.base import traceable_loss

RULES = [FedProx, SCAFFOLD, FedDyn, FedCCProx, FedCCMOON, MOON, FedDecorr]


def _overriding_the_loss(rule: type) -> type:
    class Overriding(rule):
        def training_loss(self, module, batch, outputs):
            return super().training_loss(module, batch, outputs)

    return Overriding


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.__name__)
def test_a_subclass_that_overrides_the_loss_is_not_traceable_until_it_says_so(rule):
    assert rule().loss_is_traceable()
    assert not _overriding_the_loss(rule)().loss_is_traceable()

    class Marked(rule):
        @traceable_loss
        def training_loss(self, module, batch, outputs):
            return super().training_loss(module, batch, outputs)

    assert Marked().loss_is_traceable()


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.__name__)
def test_a_subclass_that_keeps_its_parents_loss_keeps_its_answer(rule):
    class OtherHook(rule):
        def on_round_start(self, context, round_idx):
            return super().on_round_start(context, round_idx)

    assert OtherHook().loss_is_traceable()


def test_a_wrapper_answers_for_its_rule_and_for_itself():
    assert RobustAggregation(rule=FedProx()).loss_is_traceable()
    assert not RobustAggregation(rule=_overriding_the_loss(FedProx)()).loss_is_traceable()
    assert not _overriding_the_loss(RobustAggregation)(rule=FedAvg()).loss_is_traceable()
