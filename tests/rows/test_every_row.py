"""Every config under conf/ runs one round the way its user runs it: ``fedlight fit --config <row>``.

Each row runs through the command's own entry point with its own network, rule, wrappers, callbacks, metrics,
loggers and data reader, shrunk only in size by flags (one round, at most two clients per round, one local epoch
or step, small batches, and each dataset's own size flags). The data are miniatures written in each dataset's
real on-disk layout (``tests/miniatures``) under the folders the rows name, and the pretrained weights the rows
name are read from a local mirror laid out as the Hugging Face cache that a machine without network copies in.
A row that starts from an earlier stage's checkpoint (LADD's source pre-training) has that stage run first, as
the README tells its user. Every row must finish its round, score the global model and write its run folder.

Rows are run in one process per test worker, in a working folder of that worker: ``data/``, ``runs/`` and
``pretrained/`` relative to it, exactly as in the repository's root.
"""

from __future__ import annotations

import csv
import math
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from miniatures import registry
from miniatures.weights import write_mirror

from fedlight.cli import build_parser, run

REPO = Path(__file__).resolve().parents[2]
CONF = REPO / "conf"
#: files stacked after a row rather than run alone (no model of their own), with the row each is tried on
ADD_ONS = {
    "analysis.yaml": "fedproto/synthetic/fedproto_delta50.yaml",
    "batched_clients.yaml": "fedproto/synthetic/fedavg_delta0.yaml",
    "two_cpu_processes.yaml": "digits/fedavg.yaml",
    "mnist_subset.yaml": "fedproto/mnist/fedavg_delta0.yaml",
    "latent_analysis.yaml": "fedsls/cifar10/fedsls_alpha0.5.yaml",
}


def _is_add_on(path: Path) -> bool:
    return not {"model", "config"} & set(yaml.safe_load(path.read_text()))


ROWS = sorted(p for p in CONF.rglob("*.yaml") if "sweeps" not in p.relative_to(CONF).parts)


@pytest.fixture(scope="session")
def parser():
    return build_parser()


@pytest.fixture(scope="session")
def workspace(tmp_path_factory) -> Path:
    """This worker's working folder, with the weights mirror; miniatures are written into it as rows need them."""
    folder = tmp_path_factory.mktemp("workspace")
    write_mirror(folder / "hub", folder)
    return folder


@pytest.fixture
def in_workspace(workspace, monkeypatch):
    """The rows' relative paths resolve in the workspace; the hub is read from its cache, offline, as a user
    without network would set ``HF_HUB_OFFLINE=1`` and ``HF_HUB_CACHE``."""
    from huggingface_hub import constants

    monkeypatch.chdir(workspace)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(workspace / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return workspace


def _resolved(parser, args: list[str]) -> dict[str, Any]:
    return yaml.safe_load(parser.dump(parser.parse_args(["fit", *args])))["fit"]


def _datasets(node: Any) -> list[dict[str, Any]]:
    """Every dataset named anywhere in a resolved config (``data.dataset``, a pre-training's ``evaluate_on``, a
    style target), as its ``class_path``/``init_args`` node."""
    if isinstance(node, list):
        return [found for item in node for found in _datasets(item)]
    if not isinstance(node, dict):
        return []
    own = [node] if str(node.get("class_path", "")).startswith("fedlight.data.") else []
    return own + [found for value in node.values() for found in _datasets(value)]


def _default_root(class_path: str) -> str | None:
    import importlib
    import inspect

    module, _, name = class_path.rpartition(".")
    parameter = inspect.signature(getattr(importlib.import_module(module), name)).parameters.get("root")
    return None if parameter is None or parameter.default is inspect.Parameter.empty else parameter.default


def _miniature_flags(config: dict[str, Any], written: dict[tuple[str, str], list[str]]) -> list[str]:
    """Writes the miniature of every dataset the config reads (once per root) and returns the flags that point
    the main dataset's row at it."""
    miniatures, flags = registry(), []
    main = config["data"]["dataset"]
    for node in _datasets(config):
        name = node["class_path"].rpartition(".")[2]
        if name not in miniatures:
            continue
        root = (node.get("init_args") or {}).get("root") or _default_root(node["class_path"])
        if root is not None and (name, root) not in written:
            written[name, root] = miniatures[name].write(Path(root))
        if node is main:
            flags += [*written.get((name, root), []), *miniatures[name].flags_for(config)]
    return flags


def _shrink(config: dict[str, Any]) -> list[str]:
    trainer, data = config["trainer"], config["data"]
    # with stragglers, enough clients that a round still trains one fully (δ = 0.8 of 5 leaves 1)
    clients = 2 if trainer.get("straggler_fraction", 0.0) < 0.5 else 5
    flags = [
        "--trainer.rounds=1",
        f"--trainer.clients_per_round={min(trainer['clients_per_round'], clients)}",
        "--trainer.local_epochs=1",
        "--trainer.enable_progress_bar=false",
        f"--data.batch_size={min(data['batch_size'], 4)}",
    ]
    if trainer.get("local_steps"):
        flags.append("--trainer.local_steps=1")
    return flags


def _stage_config(row: Path, init_from: str) -> Path | None:
    """The config whose run writes ``init_from`` (``<root>/<name>/version_0/checkpoints/last.ckpt``): ``<name>.yaml``
    beside the row or in a folder above it."""
    parts = Path(init_from).parts
    if len(parts) < 4 or parts[-2:] != ("checkpoints", "last.ckpt"):
        return None
    name = parts[-4]
    for folder in [row.parent, *row.parent.parents]:
        if (folder / f"{name}.yaml").is_file():
            return folder / f"{name}.yaml"
        if folder == CONF:
            return None
    return None


def _run_row(parser, configs: list[Path], written: dict, depth: int = 0) -> tuple[dict[str, float], Path]:
    """Runs the stacked ``configs`` for one round (their stage first, if it has not run); returns the metrics
    and the run folder."""
    stack = [arg for path in configs for arg in ("--config", str(path))]
    config = _resolved(parser, stack)
    init_from = config["trainer"].get("init_from")
    if init_from and not Path(init_from).is_file():
        stage = _stage_config(configs[0], init_from)
        assert stage is not None and depth < 2, f"nothing under conf/ writes {init_from}"
        _run_row(parser, [stage], written, depth + 1)
        assert Path(init_from).is_file(), f"{stage} did not write {init_from}"
    flags = [*_shrink(config), *_miniature_flags(config, written)]  # a miniature's own flags win
    if str(configs[-1].relative_to(CONF)) in GUARD_LIFTED:
        flags.append("--trainer.max_update_ratio=null")
    folder = Path(config["trainer"]["default_root_dir"]) / config["trainer"]["name"]
    before = set(folder.glob("version_*"))
    metrics = run(["fit", *stack, *flags])
    (run_dir,) = set(folder.glob("version_*")) - before
    return metrics, run_dir


#: rows whose miniature (random pixels, a handful of images, random weights) drives the row's real-data setting past
#: the trainer's update guard (``--trainer.max_update_ratio``); the guard is lifted for these rows alone, and why is
#: said here. The round must still finish with finite scores.
GUARD_LIFTED = {
    # MCD's step A and its four step-C updates share G's SGD momentum (0.9), so each batch moves G about five times
    # step A's update; on random pixels and a random DeepLab at lr 0.05, over the doubled Cityscapes images, one
    # epoch's update reaches 1.5 times the guard's bound (the other MCD rows stay within it)
    "ladd/cityscapes/mcd_centralized.yaml",
}


@pytest.fixture(scope="session")
def written() -> dict:
    """The miniatures this worker has written, (dataset, root) → the flags that read it."""
    return {}


@pytest.mark.parametrize("path", ROWS, ids=lambda p: str(p.relative_to(CONF)))
def test_the_row_runs_one_round_end_to_end(parser, in_workspace, written, path):
    configs = [CONF / ADD_ONS[path.name], path] if path.name in ADD_ONS and _is_add_on(path) else [path]
    metrics, run_dir = _run_row(parser, configs, written)
    failed = {key: metrics.get(key, 0.0) for key in ("round/clients_failed", "round/clients_nonfinite")}
    assert not any(failed.values()), f"clients were left out of the round: {failed} (see {run_dir}/client_errors)"
    # per-class scores of classes absent from a miniature's test set are NaN by definition; the summaries are not
    scores = {key: metrics[key] for key in ("test/acc", "test/miou", "test/loss") if key in metrics}
    assert scores, f"the run scored nothing on its test set: {sorted(metrics)}"
    assert all(math.isfinite(value) for value in scores.values()), scores
    main = scores.get("test/miou", scores.get("test/acc"))
    assert main is not None and 0.0 <= main <= 1.0, scores
    with open(run_dir / "metrics.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    assert rows and any(key.startswith("test/") and rows[-1][key] for key in rows[-1]), "nothing logged"
    assert (run_dir / "checkpoints" / "last.ckpt").is_file() and (run_dir / "config.yaml").is_file()
    assert os.path.samefile(Path.cwd(), in_workspace)
    # a row's checkpoint holds its whole network (a frozen ViT-B/8 is 340 MB): 418 of them would fill a disk; a
    # later row that starts from this one runs it again as its stage
    shutil.rmtree(run_dir)
