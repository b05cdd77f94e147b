"""The FedSLS paper's Table 1 configs: one per cell, each its dataset's base file plus the cell's changes."""

import copy
from pathlib import Path

import pytest
import yaml

from fedlight.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
DATASETS = ("cifar10", "cifar100", "cinic10", "tinyimagenet")
METHODS = {
    "fedavg": "FedAvg",
    "fedprox": "FedProx",
    "moon": "MOON",
    "feddecorr": "FedDecorr",
    "fedau": "FedAU",
    "fedsls": "FedSLS",
    "fedsl_f2": "FedSL",
    "fedsl_f4": "FedSL",
    "fedsl_f8": "FedSL",
}
ALPHAS = ("0.5", "0.1", "0.05")


PARSER = build_parser()  # building it costs more than parsing a file with it


def resolved(path: Path) -> dict:
    return yaml.safe_load(PARSER.dump(PARSER.parse_args(["fit", "--config", str(path)])))["fit"]


def test_every_cell_of_table_1_has_a_config():
    rows = {p.relative_to(REPO / "conf/fedsls").as_posix() for p in (REPO / "conf/fedsls").rglob("*_alpha*.yaml")}
    expected = {f"{d}/{m}_alpha{a}.yaml" for d in DATASETS for m in METHODS for a in ALPHAS}
    assert rows == expected


def without(config: dict, *paths: str) -> dict:
    """A deep copy of ``config`` without the dotted ``paths`` (those that exist)."""
    config = copy.deepcopy(config)
    for path in paths:
        *parents, leaf = path.split(".")
        node = config
        for key in parents:
            node = node.get(key) or {}
        node.pop(leaf, None)
    return config


# trainer.name: a run is named after its own first config file
CHANGES = (
    "config",
    "strategy",
    "data.partitioner.init_args.alpha",
    "model.init_args.model_kwargs.projection_dim",
    "trainer.name",
)


@pytest.mark.parametrize("dataset", DATASETS)
def test_rows_hold_only_their_cells_changes(dataset):
    # A nested section (data:, model:) in a row would replace base.yaml's whole section, so rows change
    # single values with dotted keys; resolved examples are checked below.
    for method, rule in METHODS.items():
        for alpha in ALPHAS:
            row = yaml.safe_load((REPO / "conf/fedsls" / dataset / f"{method}_alpha{alpha}.yaml").read_text())
            assert set(row) <= set(CHANGES) and row["config"] == "base.yaml"
            assert row["data.partitioner.init_args.alpha"] == float(alpha)
            assert row.get("strategy", {"class_path": "fedlight.strategies.FedAvg"})["class_path"].endswith(rule)
            assert ("model.init_args.model_kwargs.projection_dim" in row) == (method == "moon")


@pytest.mark.parametrize("method", METHODS)
def test_resolved_rows_are_the_base_file_plus_their_changes(method):
    base = resolved(REPO / "conf/fedsls/cifar100/base.yaml")
    assert base["trainer"]["local_steps"] == 10 and base["data"]["batch_size"] == 64
    assert base["data"]["partitioner"]["init_args"]["num_clients"] == 100
    row = resolved(REPO / f"conf/fedsls/cifar100/{method}_alpha0.05.yaml")
    assert row["data"]["partitioner"]["init_args"]["alpha"] == 0.05
    assert row["strategy"]["class_path"] == f"fedlight.strategies.{METHODS[method]}"
    assert row["strategy"]["init_args"].get("sampling") in (None, "uniform")  # None: the rule's default, uniform
    projection = row["model"]["init_args"]["model_kwargs"].get("projection_dim")
    assert projection == (256 if method == "moon" else None)
    assert without(row, *CHANGES) == without(base, *CHANGES)  # everything else is the base file's
