"""Every rule that ``fedlight.strategies`` exports has a row in one of the shared testers, so a rule added without
one fails here instead of going untested by the invariants."""

import inspect

import fedlight.strategies as strategies
from fedlight.strategies import FedOpt, RuleWrapper, Strategy
from tests.strategies import test_invariants as plain
from tests.strategies import test_invariants_clustered as clustered

#: exported classes that are not rules of their own, and where their behaviour is tested instead
NOT_RULES = {
    Strategy: "the base class every rule extends",
    RuleWrapper: "the base class of the wrappers",
    FedOpt: "FedAdam, FedYogi and FedAdagrad are its variants, each in the tester",
}


def classes_in_testers() -> set[type]:
    factories = [
        *plain.STRATEGIES.values(),
        *plain.IMAGE_STRATEGIES.values(),
        *plain.WRAPPERS.values(),
        *plain.NEUTRAL_WRAPPERS.values(),
        *clustered.CENTROID_RULES.values(),
        *clustered.BANK_RULES.values(),
        *(factory for _, factory in clustered.RUNS.values()),
    ]
    return {type(factory()) for factory in factories}


def test_every_exported_rule_is_in_a_shared_tester():
    exported = {
        value
        for name in strategies.__all__
        if inspect.isclass(value := getattr(strategies, name)) and issubclass(value, Strategy)
    }
    missing = sorted(rule.__name__ for rule in exported - classes_in_testers() - set(NOT_RULES))
    assert not missing, f"rules with no row in tests/strategies/test_invariants*.py: {', '.join(missing)}"


def test_the_check_sees_a_rule_left_out():
    class Unlisted(Strategy):
        pass

    assert Unlisted not in classes_in_testers() and strategies.FedAvg in classes_in_testers()
