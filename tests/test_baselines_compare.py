"""benchmarks/baselines/compare.py: the configs it finds, the rounds it expects, and the verdicts of its table."""

import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks" / "baselines"))
import compare  # noqa: E402


@pytest.mark.parametrize("protocol", ["digits", "synthetic"])
def test_every_config_of_a_protocol_is_a_rule_and_fedavg_comes_first(protocol):
    rules = compare.rules_of(protocol)
    assert rules[0] == "fedavg"
    assert sorted(rules) == sorted(p.stem for p in (REPO / "conf" / "baselines" / protocol).glob("*.yaml"))
    assert {"fedadam", "fedyogi", "fedadagrad"} <= set(rules)


def test_rounds_follow_the_config_chain(tmp_path):
    assert compare._config_rounds(REPO / "conf" / "baselines" / "digits" / "fedadam.yaml") == 100  # conf/digits
    assert compare._config_rounds(REPO / "conf" / "baselines" / "synthetic" / "fedyogi.yaml") == 200  # base.yaml
    (tmp_path / "base.yaml").write_text(yaml.safe_dump({"trainer": {"rounds": 9}}))
    (tmp_path / "row.yaml").write_text("config: base.yaml\ntrainer:\n  rounds: 4\n")
    assert compare._config_rounds(tmp_path / "row.yaml") == 4  # the row's own value wins, as in fedlight fit


def test_a_difference_within_the_spread_is_not_resolved():
    finals = {
        "fedavg": {0: 0.50, 1: 0.60, 2: 0.55},
        "steady": {0: 0.52, 1: 0.62, 2: 0.57},  # +2 pp on every seed: resolved
        "noisy": {0: 0.60, 1: 0.55, 2: 0.50},  # differences +10, −5, −5 pp: mean 0 within 2 se
        "broken": {},
    }
    rows = {line.split(" | ")[0][2:]: line for line in compare.table(finals, list(finals)).splitlines()[2:]}
    assert rows["steady"].endswith("| +2.00 ± 0.00 (se, n = 3) | resolved |")
    assert "+0.00 ± 5.00 (se, n = 3) | not resolved |" in rows["noisy"]
    assert rows["broken"] == "| broken | failed | – | – |"
    assert "55.00 ± 5.00 (n = 3)" in rows["fedavg"]


def test_a_seed_fedavg_lacks_is_left_out_of_the_difference():
    finals = {"fedavg": {0: 0.5, 1: 0.6}, "x": {0: 0.6, 1: 0.7, 2: 0.9}}
    line = compare.table(finals, ["fedavg", "x"]).splitlines()[-1]
    assert "(n = 3)" in line and "(se, n = 2)" in line


def test_the_command_runs_the_config_with_the_seed(tmp_path):
    run = compare.Run("digits", "fedyogi", 2, rounds=3, overrides=("--trainer.local_epochs=1",))
    args = compare.command(run, tmp_path)
    assert args[1:5] == ["-m", "fedlight", "fit", "--config"]
    assert args[5] == str(REPO / "conf" / "baselines" / "digits" / "fedyogi.yaml")
    assert "--seed_everything=2" in args and "--trainer.rounds=3" in args and "--trainer.local_epochs=1" in args
    assert f"--trainer.name={run.name}" in args and not any(a.startswith("--ckpt_path") for a in args)


def test_a_personalised_rule_is_scored_with_its_own_models_and_the_others_with_the_global_one(tmp_path):
    def write(name, header, rows):
        folder = tmp_path / name / "version_0"
        folder.mkdir(parents=True)
        (folder / "metrics.csv").write_text("\n".join([header, *rows]) + "\n")

    write("ditto", "round,clients/acc,clients/personal/acc", ["0,0.4,0.7", "1,,", "2,0.5,0.8"])
    write("fedavg", "round,clients/acc", ["0,0.45", "1,0.55"])
    write("knn_per", "round,clients/acc,knn_per/acc", ["0,0.45,0.6"])
    assert compare.scores(tmp_path, "ditto") == [0.4, 0.5]  # the round that did not evaluate is left out
    assert compare.own_scores(tmp_path, "ditto") == [0.7, 0.8]
    assert compare.own_scores(tmp_path, "fedavg") == compare.scores(tmp_path, "fedavg") == [0.45, 0.55]
    assert compare.own_scores(tmp_path, "knn_per") == [0.6]  # its interpolated predictor
