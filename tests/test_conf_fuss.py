"""The FUSS paper's Tables 2–4 configs: one per cell, each its setting's base file plus the cell's changes."""

from pathlib import Path

import pytest
import yaml

from fedlight.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf/fuss"
ROWS = ("fedavg", "fedavg_fedcc", "fedprox", "fedprox_fedcc", "moon", "moon_fedcc")
PARSER = build_parser()


def resolved(path: Path) -> dict:
    return yaml.safe_load(PARSER.dump(PARSER.parse_args(["fit", "--config", str(path)])))["fit"]


def test_every_cell_of_tables_2_to_4_has_a_config():
    found = {p.relative_to(CONF).as_posix() for p in CONF.rglob("*.yaml") if p.name != "base.yaml"}
    table2 = {f"cityscapes/ma{n}/{row}.yaml" for n in (3, 6, 18) for row in ROWS}
    table3 = {f"cocostuff/{row}.yaml" for row in ROWS}
    modes = ("e", "c", "ec", "we", "wc", "wec")
    table4 = {
        f"cityscapes/ma{n}/table4/{m}_{x}.yaml"
        for n in (3, 6, 18)
        for m in ("fedavg", "kmeans", "maximin")
        for x in modes
    }
    table4 |= {f"cityscapes/ma{n}/table4/local_only.yaml" for n in (3, 6, 18)}
    centralized = {"cityscapes/centralized.yaml", "cocostuff/centralized.yaml"}  # Tables 2 and 3
    assert table2 | table3 | table4 | centralized <= found
    cells = table2 | table3 | table4 | centralized
    assert not {p for p in found - cells if not p.startswith(("twin/", "twin_cocostuff/"))}


@pytest.mark.parametrize(
    ("path", "clients", "steps"),
    [
        ("cityscapes/ma3/fedavg.yaml", 3, 834),
        ("cityscapes/ma6/moon.yaml", 6, 500),
        ("cityscapes/ma18/fedprox.yaml", 18, 834),
    ],
)
def test_city_splits_set_clients_and_batches_per_round(path, clients, steps):
    config = resolved(CONF / path)
    assert config["trainer"]["clients_per_round"] == clients
    assert config["data"]["dataset"]["init_args"]["num_clients"] == clients
    assert config["trainer"]["local_steps"] == steps
    assert config["trainer"]["rounds"] == 10 and config["data"]["batch_size"] == 8
    assert config["data"]["return_index"] and config["data"]["test_fraction"] == 0.0
    assert config["model"]["init_args"]["flip_tta"] is True
    assert config["model"]["init_args"]["crf"] is True  # Tables 2–3 score after the dense CRF


@pytest.mark.parametrize(
    ("path", "rule", "centroids", "extra"),
    [
        ("cityscapes/ma3/fedavg_fedcc.yaml", "FedCC", "maximin", {}),
        ("cityscapes/ma6/fedprox_fedcc.yaml", "FedCCProx", "maximin", {"mu": 0.001}),
        ("cityscapes/ma18/moon.yaml", "FedCCMOON", "average", {"temperature": 0.5}),
        ("cocostuff/fedavg_fedcc.yaml", "FedCC", "maximin", {}),
    ],
)
def test_rows_choose_the_rule_and_centroid_aggregation(path, rule, centroids, extra):
    strategy = resolved(CONF / path)["strategy"]
    assert strategy["class_path"] == f"fedlight.strategies.{rule}"
    assert strategy["init_args"]["centroids"] == centroids and strategy["init_args"]["weighting"] == "batches"
    assert extra.items() <= strategy["init_args"].items()


def test_cocostuff_is_dominant_label_dirichlet_over_18_clients_with_its_own_shifts():
    config = resolved(CONF / "cocostuff/moon_fedcc.yaml")
    assert config["data"]["partitioner"]["init_args"] == {
        "num_clients": 18,
        "alpha": 0.5,
        "min_size": 10,
        "max_retries": 1000,
    }
    assert config["trainer"]["clients_per_round"] == 18 and config["trainer"]["local_steps"] == 334
    assert config["model"]["init_args"]["preset"] == "cocostuff"


@pytest.mark.parametrize(
    ("suffix", "weighting", "aggregated"),
    [("e", "uniform", "encoder"), ("c", "uniform", "centroids"), ("ec", "uniform", "all"), ("wec", "batches", "all")],
)
def test_table_4_modes_without_tta(suffix, weighting, aggregated):
    config = resolved(CONF / f"cityscapes/ma6/table4/kmeans_{suffix}.yaml")
    assert config["model"]["init_args"]["flip_tta"] is False
    assert config["model"]["init_args"]["crf"] is False
    args = config["strategy"]["init_args"]
    assert (args["centroids"], args["weighting"], args["aggregated"]) == ("kmeans", weighting, aggregated)
    assert config["trainer"]["clients_per_round"] == 6


@pytest.mark.parametrize(
    ("path", "batch_size"), [("cityscapes/centralized.yaml", 8), ("cocostuff/centralized.yaml", 16)]
)
def test_centralized_rows_train_one_model_as_long_as_the_released_trainer(path, batch_size):
    config = resolved(CONF / path)
    assert config["data"]["centralized"] is True
    assert (config["trainer"]["rounds"], config["trainer"]["clients_per_round"]) == (1, 1)
    assert config["trainer"]["local_steps"] == 8334  # max_steps 25000 counted over three optimisers: ⌈25000 / 3⌉
    assert config["data"]["batch_size"] == batch_size
    assert config["model"]["init_args"]["crf"] is True and config["model"]["init_args"]["flip_tta"] is True


@pytest.mark.parametrize("clients", [3, 6, 18])
def test_local_only_rows_never_aggregate_and_score_without_crf(clients):
    config = resolved(CONF / f"cityscapes/ma{clients}/table4/local_only.yaml")
    assert config["strategy"]["class_path"] == "fedlight.strategies.LocalOnly"
    assert config["trainer"]["clients_per_round"] == clients and config["trainer"]["rounds"] == 10
    assert config["model"]["init_args"]["crf"] is False and config["model"]["init_args"]["flip_tta"] is False
