"""``fedlight sweep``: the sweep files of conf/sweeps/ run locally on Optuna, killed and continued."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from processes import communicate_within, run_within

from fedlight.errors import ConfigError
from fedlight.sweep import trial_name
from fedlight.sweep_file import SweepFile, base_command

REPO = Path(__file__).resolve().parents[1]
SWEEPS = sorted((REPO / "conf" / "sweeps").glob("*.yaml"))
#: a trial: two rounds of the digits demo with two clients of one epoch, a checkpoint every round
TINY = [
    "--trainer.rounds=2", "--trainer.clients_per_round=2", "--trainer.local_epochs=1", "--trainer.checkpoint_every=1",
    "--trainer.logger=csv", "--trainer.enable_progress_bar=false",
]  # fmt: skip


def _sweep_file(tmp_path: Path, method: str = "grid", parameters: dict | None = None) -> Path:
    path = tmp_path / "tiny.yaml"
    parameters = parameters or {
        "model.init_args.optimizer.init_args.lr": {"values": [0.01, 0.1]},
        "seed_everything": {"values": [0, 1]},
    }
    path.write_text(
        yaml.safe_dump(
            {
                "program": "fedlight",
                "method": method,
                "metric": {"name": "test/acc", "goal": "maximize"},
                "parameters": parameters,
                "command": ["${env}", "fedlight", "fit", "--config", str(REPO / "conf/digits/fedavg.yaml"),
                            "--trainer.wandb_mode=online", "${args}"],
            }
        )
    )  # fmt: skip
    return path


def _trials(storage: str, study: str) -> list:
    import optuna

    return optuna.load_study(study_name=study, storage=storage).get_trials(deepcopy=False)


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.name)
def test_every_sweep_file_reads_as_a_local_sweep(path):
    content = yaml.safe_load(path.read_text())
    sweep = SweepFile.read(path)
    assert sweep.method == content["method"] and sweep.metric == content["metric"]["name"]
    expected = 1
    for spec in content["parameters"].values():
        expected *= len(spec["values"])
    assert len(sweep.grid) == expected
    assert sweep.command[0] == "fit" and not any(w.startswith(("${", "--trainer.wandb_mode")) for w in sweep.command)


def test_names_and_commands():
    assert trial_name({"a.b.lr": 0.1, "c.lr": 2}) == "b.lr=0.1-c.lr=2"  # the same last part: one more part each
    assert base_command(["fedlight", "validate", "--config", "x.yaml", "${args_no_hyphens}"]) == [
        "validate", "--config", "x.yaml"
    ]  # fmt: skip


def test_a_bad_sweep_file_lists_every_problem(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(
        yaml.safe_dump({"method": "hyperband", "metric": {"goal": "up"}, "parameters": {"a": {"min": 0, "max": 1,
                        "distribution": "q_normal"}, "b": 3}})
    )  # fmt: skip
    with pytest.raises(ConfigError) as info:
        SweepFile.read(path)
    message = str(info.value)
    for part in (
        "method is 'hyperband'",
        "metric.name is missing",
        "metric.goal is 'up'",
        "parameters.a",
        "parameters.b",
    ):
        assert part in message


def test_random_without_a_budget_names_both_ways_to_give_one_before_writing_anything(tmp_path, capsys):
    from fedlight.cli import main

    path = _sweep_file(tmp_path, "random", {"model.init_args.optimizer.init_args.lr": {"min": 0.001, "max": 0.1}})
    with pytest.raises(SystemExit) as info:
        main(["sweep", str(path), f"--root={tmp_path / 'runs'}"])
    assert info.value.code == 2
    message = capsys.readouterr().err
    assert "--trials N" in message and "run_cap" in message
    assert not (tmp_path / "runs").exists()


def test_a_missing_optuna_is_one_message_naming_the_extra(tmp_path, monkeypatch, capsys):
    from fedlight.cli import main

    monkeypatch.setitem(sys.modules, "optuna", None)  # import optuna raises ImportError
    with pytest.raises(SystemExit) as info:
        main(["sweep", str(_sweep_file(tmp_path)), f"--root={tmp_path / 'runs'}"])
    assert info.value.code == 2
    assert "pip install 'fedlight[sweep]'" in capsys.readouterr().err


def test_a_random_sweep_runs_its_trials_named_after_their_values(tmp_path, monkeypatch, capsys):
    pytest.importorskip("optuna", reason="sweeps need the optional extra fedlight[sweep]")
    from fedlight.cli import main

    monkeypatch.setenv("WANDB_MODE", "disabled")
    path = _sweep_file(
        tmp_path, "random", {"model.init_args.optimizer.init_args.lr": {"min": 0.001, "max": 0.1,
                                                                         "distribution": "log_uniform_values"}}
    )  # fmt: skip
    root = tmp_path / "runs"
    main(["sweep", str(path), f"--root={root}", "--trials=2", "--seed=3", *TINY])
    storage = f"sqlite:///{root / 'tiny' / 'sweep.db'}"
    trials = _trials(storage, "tiny")
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE"]
    for trial in trials:
        lr = trial.params["model.init_args.optimizer.init_args.lr"]
        assert 0.001 <= lr <= 0.1
        run = root / "tiny" / f"lr={lr}" / "version_0"
        config = yaml.safe_load((run / "config.yaml").read_text())
        assert config["model"]["init_args"]["optimizer"]["init_args"]["lr"] == lr
        assert config["trainer"]["wandb_group"] == "tiny"  # W&B runs grouped by the sweep
        last = (run / "metrics.csv").read_text().splitlines()[-1].split(",")
        header = (run / "metrics.csv").read_text().splitlines()[0].split(",")
        assert float(last[header.index("test/acc")]) == pytest.approx(trial.value)
    table = capsys.readouterr().out
    assert "2 of 2 trials complete" in table and table.count("| complete |") == 2


def test_a_killed_grid_sweep_continues_in_two_processes_with_every_point_once(tmp_path):
    pytest.importorskip("optuna", reason="sweeps need the optional extra fedlight[sweep]")
    root, marker = tmp_path / "runs", tmp_path / "starts"
    killer = {"class_path": "fedlight.testing.SigkillOnce",
              "init_args": {"round_idx": 1, "marker": str(marker), "skip": 1}}  # fmt: skip
    command = [sys.executable, "-m", "fedlight", "sweep", str(_sweep_file(tmp_path)), f"--root={root}",
               "--heartbeat=1", *TINY, f"--trainer.callbacks+={json.dumps(killer)}"]  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    # The first trial runs both rounds; the second is killed as its round 2 starts, after round 1's checkpoint.
    first = run_within(command, cpu_budget=600, env=env, cwd=tmp_path, capture_output=True, text=True)
    assert first.returncode == -signal.SIGKILL, first.stderr[-2000:]
    storage = f"sqlite:///{root / 'tiny' / 'sweep.db'}"
    assert [t.state.name for t in _trials(storage, "tiny")] == ["COMPLETE", "RUNNING"]  # as the kill left them

    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    workers = [subprocess.Popen(command, env=env, cwd=tmp_path, **pipes) for _ in range(2)]
    outputs = [communicate_within(worker, cpu_budget=600) for worker in workers]
    assert [worker.returncode for worker in workers] == [0, 0], [err[-2000:] for _, err in outputs]

    trials = _trials(storage, "tiny")
    complete = [t for t in trials if t.state.name == "COMPLETE"]
    points = sorted((t.params["model.init_args.optimizer.init_args.lr"], t.params["seed_everything"]) for t in complete)
    assert points == [(0.01, 0), (0.01, 1), (0.1, 0), (0.1, 1)]  # every point of the grid, none twice
    killed = trials[1]
    assert killed.state.name == "FAIL"
    retry = next(t for t in complete if t.system_attrs.get("failed_trial") == killed.number)
    assert retry.params == killed.params
    # the retry continued the killed run from its round-1 checkpoint instead of starting a second one
    run = Path(retry.user_attrs["run"])
    assert sorted(p.name for p in run.iterdir()) == ["version_0"]
    rounds = [line.split(",")[0] for line in (run / "version_0" / "metrics.csv").read_text().splitlines()[1:]]
    assert rounds == ["1", "2"]


def test_a_sweep_stopped_before_it_ends_is_not_a_new_sweep(tmp_path, monkeypatch):
    pytest.importorskip("optuna", reason="sweeps need the optional extra fedlight[sweep]")
    from fedlight.cli import main

    monkeypatch.setenv("WANDB_MODE", "disabled")
    path = _sweep_file(tmp_path, parameters={"seed_everything": {"values": [0, 1]}})
    root = tmp_path / "runs"
    main(["sweep", str(path), f"--root={root}", *TINY])
    started = time.time()
    main(["sweep", str(path), f"--root={root}", *TINY])  # nothing left: the table only
    assert time.time() - started < 30
    assert len(_trials(f"sqlite:///{root / 'tiny' / 'sweep.db'}", "tiny")) == 2


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("method: grid\nmetric: a: b\n", "is not valid YAML at line 2, column 10"),
        ("method: grid\nmetric: test/acc\nparameters: {a: {values: [1]}}\n", "metric is 'test/acc'; give a mapping"),
        (
            "method: grid\nmetric: {name: test/acc}\nparameters: {a: {values: 0.01}}\n",
            "values is 0.01; give a non-empty",
        ),
        ("method: grid\nmetric: {name: test/acc}\nparameters: {a: {values: []}}\n", "values is []; give a non-empty"),
        ("method: grid\nmetric: {name: test/acc}\nparameters: [a, b]\n", "parameters is a list; give a mapping"),
        ("method: random\nmetric: {name: test/acc}\nparameters: {a: {min: 1, max: 0.1}}\n", "min 1 > max 0.1"),
    ],
    ids=["yaml", "metric-text", "values-scalar", "values-empty", "parameters-list", "min-above-max"],
)
def test_a_malformed_sweep_file_is_one_message_naming_it(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        SweepFile.read(path)
    assert message in str(info.value) and str(path) in str(info.value)


def _failing_sweep(tmp_path: Path, path: Path) -> list:
    """Runs the sweep ``path``, which must exit with an error; returns its trials' states."""
    from fedlight.cli import main

    root = tmp_path / "runs"
    with pytest.raises(SystemExit) as info:
        main(["sweep", str(path), f"--root={root}", *TINY])
    assert info.value.code == 2
    return [t.state.name for t in _trials(f"sqlite:///{root / 'tiny' / 'sweep.db'}", "tiny")]


def test_a_metric_no_run_logs_stops_the_sweep_after_its_first_trial(tmp_path, monkeypatch, capsys):
    pytest.importorskip("optuna", reason="sweeps need the optional extra fedlight[sweep]")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    path = _sweep_file(tmp_path)
    path.write_text(path.read_text().replace("name: test/acc", "name: test/accuracy"))
    assert _failing_sweep(tmp_path, path) == ["FAIL"], "one trial's compute, not the grid's four"
    captured = capsys.readouterr()
    assert "logged no finite test/accuracy" in captured.out  # the table's reason column
    assert "A trial logged no test/accuracy" in captured.err and "Traceback" not in captured.err


def test_a_flag_the_command_refuses_fails_its_trial_and_the_sweep_exits_non_zero(tmp_path, monkeypatch, capsys):
    pytest.importorskip("optuna", reason="sweeps need the optional extra fedlight[sweep]")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    path = _sweep_file(tmp_path, parameters={"trainer.no_such_option": {"values": [1]}})
    assert _failing_sweep(tmp_path, path) == ["FAIL"], "not left RUNNING in the database"
    captured = capsys.readouterr()
    assert "fedlight refused the trial's flags" in captured.out and "1 trial(s) of the sweep failed" in captured.err


def _open_together(barrier, storage, sweep_file, results):
    from fedlight.sweep import open_study
    from fedlight.sweep_file import SweepFile

    file = SweepFile.read(Path(sweep_file))
    barrier.wait()  # every process creates the new study at the same moment
    try:
        open_study(file, storage, "together", 10, None)
        results.put("ok")
    except Exception as error:
        results.put(f"{type(error).__name__}: {error}")


def test_processes_that_start_one_new_sweep_together_do_not_race_on_its_database(tmp_path):
    """Creating the tables and the study is not atomic: six processes opening a new SQLite sweep at once all get the
    one study (before the fix, four of five such starts had a process fail on 'table studies already exists')."""
    import multiprocessing

    pytest.importorskip("optuna", reason="sweeps need the optional extra fedlight[sweep]")
    context = multiprocessing.get_context("spawn")
    for attempt in range(3):
        storage = f"sqlite:///{tmp_path / str(attempt) / 'sweep.db'}"
        barrier, results = context.Barrier(6), context.Queue()
        arguments = (barrier, storage, str(SWEEPS[0]), results)
        processes = [context.Process(target=_open_together, args=arguments) for _ in range(6)]
        for process in processes:
            process.start()
        outcomes = [results.get(timeout=300) for _ in processes]
        for process in processes:
            process.join()
        assert outcomes == ["ok"] * 6, outcomes
        assert len(_trials(storage, "together")) == 0  # one study, opened by all


def test_an_attempt_killed_before_its_first_checkpoint_is_replaced_not_left_beside_the_rerun(tmp_path, capsys):
    pytest.importorskip("optuna", reason="sweeps need the optional extra fedlight[sweep]")
    from fedlight.cli import main
    from fedlight.engine.rundir import RunLock

    path = _sweep_file(tmp_path, parameters={"model.init_args.optimizer.init_args.lr": {"values": [0.1]}})
    trial_root = tmp_path / "runs" / "tiny" / trial_name({"model.init_args.optimizer.init_args.lr": 0.1})
    killed = trial_root / "version_0"  # what a kill before round 1's checkpoint leaves: a config, a dead owner's lock
    killed.mkdir(parents=True)
    (killed / "config.yaml").write_text("trainer: {rounds: 2}\n")
    (killed / "run.lock").write_text('{"pid": 999999, "host": "gone"}')
    busy = trial_root / "version_7"  # another process's attempt, still writing: left alone
    busy.mkdir()
    lock = RunLock(busy)
    lock.acquire()
    try:
        main(["sweep", str(path), f"--root={tmp_path / 'runs'}", *TINY, "--trainer.wandb_mode=disabled"])
    finally:
        lock.release()
    assert sorted(p.name for p in trial_root.iterdir()) == ["version_7", "version_8"]
    assert (trial_root / "version_8" / "checkpoints" / "last.ckpt").is_file()  # the rerun
    assert f"removed {killed}, an attempt stopped before its first checkpoint" in capsys.readouterr().err
