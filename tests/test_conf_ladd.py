"""LADD's configs: one file per row of the paper's Tables 2–7 (and the twin's), each a base file plus its changes."""

from functools import cache
from pathlib import Path

import pytest
import yaml

from fedlight.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf/ladd"
PARSER = build_parser()

#: row → (clustering, cluster_layers, kd teacher and λ_KD > 0, SWA teacher) of the federated rows (Tables 3, 5, 7)
FEDERATED = {
    "ladd_all": (True, "all", True, True),
    "ladd_cls": (True, "classifier", True, True),
    "ladd_bn": (True, "bn", True, True),
    "ladd_backbone": (True, "backbone", True, True),
    "fda_st_kd_clu": (True, "all", True, False),
    "fda_st_kd_swat": (False, "all", True, True),
    "fda_st_kd": (False, "all", True, False),
    "fedavg_st": (False, "all", False, False),
    "st": (False, "all", False, False),
    "st_kd_swat_clu": (True, "all", True, True),
}
#: the federated rows that start from the pre-training without FDA (Table 5's rows without its FDA mark)
WITHOUT_FDA = {"st", "st_kd_swat_clu"}
#: pre-training row → FDA window half-width b (None: no restyling), Tables 5 and 6
PRETRAINING = {"source_only": None, "pretrain_fda": 1, "pretrain_fda_1x1": 0, "pretrain_fda_5x5": 2}
#: MCD's rows (Tables 2–4 and the twin), FTDA's (Table 2 and the twin)
MCD = {"mcd_centralized", "mcd_fl_uda"}
FTDA = {"ftda_centralized", "ftda_federated"}
#: Table 8's rows on the twin (CrossCity's are crosscity_4clients/)
TABLE8 = {"table8_source_only", "table8_pretrain_fda", "table8_ladd"}
ROWS = {
    "crosscity": set(FEDERATED) | set(PRETRAINING) | MCD,
    "crosscity_4clients": {"source_only", "pretrain_fda", "ladd"},
    "twin": set(FEDERATED) | set(PRETRAINING) | {"oracle_federated", "daformer"} | MCD | FTDA | TABLE8,
    "cityscapes": {"source_only", "pretrain_fda", "fedavg_st", "ladd_cls", "ladd_all", "oracle_federated",
                   "oracle_centralized", "daformer"} | MCD | FTDA,
    "mapillary": {"source_only", "pretrain_fda", "fedavg_st", "ladd_cls", "ladd_all", "oracle_federated"} | MCD,
}  # fmt: skip


@cache
def resolved(path: Path) -> dict:
    return yaml.safe_load(PARSER.dump(PARSER.parse_args(["fit", "--config", str(path)])))["fit"]


def _flat(tree: dict, prefix: tuple = ()) -> dict[tuple, object]:
    out = {}
    for key, value in tree.items():
        out.update(_flat(value, (*prefix, key)) if isinstance(value, dict) else {(*prefix, key): value})
    return out


def _differing(a: dict[tuple, object], b: dict[tuple, object]) -> set[tuple]:
    """The keys where two flattened configs differ, the run's name (its file's) left out."""
    return {key for key in a.keys() | b.keys() if a.get(key) != b.get(key)} - {("trainer", "name")}


@pytest.mark.parametrize("path", sorted(CONF.rglob("*.yaml")), ids=lambda p: str(p.relative_to(CONF)))
def test_every_ladd_config_parses(path):
    config = resolved(path)
    assert config["model"]["class_path"].startswith("fedlight.clients.")


@pytest.mark.parametrize("dataset", sorted(ROWS))
def test_every_row_has_a_file(dataset):
    rows = {p.stem for p in (CONF / dataset).glob("*.yaml")} - {"base", "pretrain_base"}
    assert rows == ROWS[dataset]


@pytest.mark.parametrize("row", sorted(FTDA))
def test_ftda_fine_tunes_the_source_only_model_as_the_oracle_of_its_setting(row):
    config = resolved(CONF / "cityscapes" / f"{row}.yaml")
    oracle = resolved(CONF / "cityscapes" / f"{row.replace('ftda', 'oracle')}.yaml")
    assert config["trainer"]["init_from"] == "runs/ladd/cityscapes/source_only/version_0/checkpoints/last.ckpt"
    assert config["model"]["class_path"] == oracle["model"]["class_path"] == "fedlight.clients.SourcePretrainingClient"
    assert config["data"] == oracle["data"] and config["strategy"] == oracle["strategy"]


def test_the_twins_ftda_is_its_federated_oracle_from_the_source_only_model_and_pooled_as_its_mcd():
    """The twin has no centralized oracle: its centralized FTDA pools the federated one's clients and trains as long
    as the twin's centralized MCD (30 epochs, poly decay)."""
    twin = CONF / "twin"
    federated, centralized = (_flat(resolved(twin / f"ftda_{name}.yaml")) for name in ("federated", "centralized"))
    oracle, mcd = _flat(resolved(twin / "oracle_federated.yaml")), _flat(resolved(twin / "mcd_centralized.yaml"))
    start = ("trainer", "init_from")
    assert _differing(federated, oracle) == {start}
    assert federated[start] == "runs/ladd/twin/source_only/version_0/checkpoints/last.ckpt"
    pooled = {("trainer", "rounds"), ("trainer", "clients_per_round"), ("data", "centralized"),
              ("model", "init_args", "poly_power")}  # fmt: skip
    assert _differing(centralized, federated) == pooled
    assert {key: centralized[key] for key in pooled} == {key: mcd[key] for key in pooled}


@pytest.mark.parametrize("dataset", ["cityscapes", "crosscity", "mapillary"])
def test_mcd_reads_the_source_with_its_target_classes_and_differs_between_settings_only_in_pooling(dataset):
    federated, centralized = (resolved(CONF / dataset / f"{row}.yaml") for row in sorted(MCD)[::-1])
    model = federated["model"]["init_args"]
    assert federated["model"]["class_path"] == "fedlight.clients.MCDClient"
    assert model["source"]["init_args"]["target"] == dataset and model["discrepancy_images"] == "target"
    assert (
        federated["trainer"].get("init_from") is None and federated["data"]["dataset"] == centralized["data"]["dataset"]
    )
    assert not federated["data"]["centralized"] and centralized["data"]["centralized"]


@pytest.mark.parametrize("dataset", ["crosscity", "twin"])
@pytest.mark.parametrize("row", sorted(FEDERATED))
def test_federated_rows_switch_exactly_their_components(dataset, row):
    clustering, layers, kd, swa = FEDERATED[row]
    config = resolved(CONF / dataset / f"{row}.yaml")
    strategy, model = config["strategy"]["init_args"], config["model"]["init_args"]
    assert config["strategy"]["class_path"] == "fedlight.strategies.LADD"
    assert strategy["clustering"] is clustering and strategy["cluster_layers"] == layers
    assert strategy["kd_teacher"] is kd and (model["lambda_kd"] > 0) is kd
    assert (strategy.get("swa_start") is not None) is swa  # the dump leaves out null values
    pretraining = "source_only" if row in WITHOUT_FDA else "pretrain_fda"
    assert config["trainer"]["init_from"] == f"runs/ladd/{dataset}/{pretraining}/version_0/checkpoints/last.ckpt"


@pytest.mark.parametrize("dataset", ["crosscity", "twin"])
@pytest.mark.parametrize("row", sorted(PRETRAINING))
def test_pretraining_rows_set_the_fda_window(dataset, row):
    b = PRETRAINING[row]
    augment = resolved(CONF / dataset / f"{row}.yaml")["data"]["train_transform"]["init_args"]
    assert augment.get("style_file") == (None if b is None else f"runs/ladd/{dataset}/styles_b{b}.pt")
    if b is not None:
        assert augment["b"] == b and augment["target"]["class_path"].startswith("fedlight.data.")


@pytest.mark.parametrize(
    ("dataset", "rounds", "per_round", "lr", "lambda_kd", "omega", "t_start"),
    [  # T, clients per round, lr, λ_KD, ω, t_start (the paper, Sec. 5 and supplementary)
        ("cityscapes", 300, 5, 5e-5, 10.0, 5, 200),
        ("crosscity", 1000, 4, 1e-2, 20.0, 1, 400),
        ("mapillary", 100, 6, 1e-2, 10.0, 5, 50),
    ],
)
def test_the_papers_hyper_parameters_per_dataset(dataset, rounds, per_round, lr, lambda_kd, omega, t_start):
    config = resolved(CONF / dataset / "ladd_all.yaml")
    trainer, model, strategy = config["trainer"], config["model"]["init_args"], config["strategy"]["init_args"]
    assert (trainer["rounds"], trainer["clients_per_round"], trainer["local_epochs"]) == (rounds, per_round, 1)
    optimizer = model["optimizer"]["init_args"]
    assert (optimizer["lr"], optimizer["momentum"], optimizer.get("weight_decay", 0)) == (lr, 0.9, 0)
    assert (model["lambda_kd"], strategy["teacher_step"], strategy["swa_start"]) == (lambda_kd, omega, t_start)
    assert config["data"]["batch_size"] == 16 and config["data"]["drop_last"] is True
    assert strategy["clusters_file"].startswith(f"data/ladd/clusters_dir/{dataset}_b1_cluster_")


@pytest.mark.parametrize(
    ("dataset", "row", "read_size"),
    [  # LADD's get_dataset: RandomScale(0.7, 2) + RandomCrop(512×1024) of the full-resolution image
        ("cityscapes", "ladd_all", [1024, 2048]),
        ("crosscity", "ladd_all", [1024, 2048]),
        ("cityscapes", "pretrain_fda", [1052, 1914]),
        ("crosscity", "pretrain_fda", [1052, 1914]),
        ("mapillary", "pretrain_fda", [1052, 1914]),
    ],
)
def test_training_crops_are_512_by_1024_windows_of_the_full_resolution_image(dataset, row, read_size):
    data = resolved(CONF / dataset / f"{row}.yaml")["data"]
    transform = data["train_transform"]
    geometry = transform["init_args"].get("geometry", transform)  # pre-training nests it under the restyling
    assert data["dataset"]["init_args"]["size"] == read_size
    assert geometry["init_args"]["crop_size"] == [512, 1024] and geometry["init_args"]["scale"] == [0.7, 2.0]


def test_mapillary_trains_on_width_1024_windows_without_random_scale():
    data = resolved(CONF / "mapillary/ladd_all.yaml")["data"]  # LADD: FixedResize(width=1024) + RandomCrop
    dataset = data["dataset"]["init_args"]
    assert (dataset["train_width"], dataset["crop"], dataset["flip"]) == (1024, [512, 1024], True)
    assert data.get("train_transform") is None and dataset["test_width"] == 1024


#: what every row of a released_code/ folder changes in the dataset's own row, besides the dataset's λ_KD and labels
RELEASED = {
    ("data", "shuffle"): "fixed",
    ("strategy", "init_args", "reset_unsampled_clusters"): True,
    ("strategy", "init_args", "shared_pseudo_teacher"): True,
    ("strategy", "init_args", "swa_of_global"): True,
    ("strategy", "init_args", "test_routing"): "released",
}
LAMBDA_KD, LABEL_WEIGHTS = ("model", "init_args", "lambda_kd"), ("model", "init_args", "kd_label_weights")


@pytest.mark.parametrize(
    ("dataset", "row", "changes"),
    [  # the code's λ_KD (Cityscapes 20, the paper 10) and its KD weighting by label id where clients have labels
        ("cityscapes", "ladd_all", {LAMBDA_KD: 20.0, LABEL_WEIGHTS: True}),
        ("cityscapes", "ladd_cls", {LAMBDA_KD: 20.0, LABEL_WEIGHTS: True}),
        ("crosscity", "ladd_all", {}),
        ("crosscity", "ladd_cls", {}),
        ("mapillary", "ladd_all", {LABEL_WEIGHTS: True}),
        # the code's config for this row runs plain FedAvg
        ("mapillary", "ladd_cls", {LABEL_WEIGHTS: True,
                                   ("strategy", "init_args", "clustering"): False,
                                   ("strategy", "init_args", "first_round_teacher"): "global"}),
        ("twin", "ladd_all", {}),
        ("twin", "ladd_cls", {}),
        ("twin", "ladd_bn", {}),
        ("twin", "ladd_backbone", {}),
        ("twin", "fda_st_kd_swat", {("strategy", "init_args", "first_round_teacher"): "global"}),
    ],
)  # fmt: skip
def test_released_code_rows_differ_from_the_papers_by_exactly_the_codes_behaviours(dataset, row, changes):
    paper = _flat(resolved(CONF / dataset / f"{row}.yaml"))
    code = _flat(resolved(CONF / dataset / "released_code" / f"{row}.yaml"))
    expected = {**RELEASED, **changes}
    differing = {key for key in paper.keys() | code.keys() if paper.get(key) != code.get(key)}
    if dataset == "mapillary" and row == "ladd_cls":  # no clusters: the test loop's routing never runs
        differing.discard(("strategy", "init_args", "test_routing"))
        expected.pop(("strategy", "init_args", "test_routing"))
    assert differing == set(expected)
    assert {key: code[key] for key in expected} == expected


def test_every_released_row_has_its_papers_row():
    for folder in CONF.glob("*/released_code"):
        rows = {p.stem for p in folder.glob("*.yaml")} - {"base"}
        assert rows and rows <= ROWS[folder.parent.name], folder


#: what Table 8's rows change in the FFREEDA row they follow: one client per city, scored city by city
TABLE8_SPLIT = {
    ("data", "dataset", "init_args", "one_client_per_city"): True,
    ("data", "test_groups"): True,
}


@pytest.mark.parametrize(
    ("table8", "ffreeda", "changes"),
    [
        ("crosscity_4clients/ladd", "crosscity/fda_st_kd_swat", {
            ("trainer", "default_root_dir"): "runs/ladd/crosscity_4clients",
            ("trainer", "init_from"): "runs/ladd/crosscity_4clients/pretrain_fda/version_0/checkpoints/last.ckpt",
            ("strategy", "init_args", "clusters_file"): None,
        }),
        ("twin/table8_ladd", "twin/fda_st_kd_swat", {
            ("trainer", "init_from"): "runs/ladd/twin/table8_pretrain_fda/version_0/checkpoints/last.ckpt",
            ("trainer", "clients_per_round"): 4,
        }),
        ("crosscity_4clients/source_only", "crosscity/source_only", {
            ("trainer", "default_root_dir"): "runs/ladd/crosscity_4clients",
            ("data", "test_groups"): True,
        }),
        ("twin/table8_source_only", "twin/source_only", {("data", "test_groups"): True}),
    ],
)  # fmt: skip
def test_table8_rows_are_their_ffreeda_rows_on_one_client_per_city_scored_by_city(table8, ffreeda, changes):
    """Table 8's LADD is Table 5's FDA+ST+KD+SWAt (no clusters) on the four city clients, from the FDA pre-training
    on those four clients' styles; its source only is Table 3's, scored city by city."""
    row, base = _flat(resolved(CONF / f"{table8}.yaml")), _flat(resolved(CONF / f"{ffreeda}.yaml"))
    expected = changes if "source_only" in table8 else {**TABLE8_SPLIT, **changes}
    differing = {key for key in row.keys() | base.keys() if row.get(key) != base.get(key)} - {("trainer", "name")}
    assert differing == set(expected)
    assert {key: row.get(key) for key in expected} == expected
    assert row.get(("strategy", "init_args", "clustering"), False) is False


@pytest.mark.parametrize("dataset", ["crosscity_4clients", "twin"])
def test_table8s_pretraining_restyles_with_the_four_city_clients_styles(dataset):
    name = "pretrain_fda" if dataset == "crosscity_4clients" else "table8_pretrain_fda"
    data = resolved(CONF / dataset / f"{name}.yaml")["data"]
    augment = data["train_transform"]["init_args"]
    assert augment["target"]["init_args"]["one_client_per_city"] is True and augment["b"] == 1
    assert augment["style_file"].endswith(("crosscity_4clients/styles_b1.pt", "twin/styles_cities_b1.pt"))
    assert data["test_groups"] is True
