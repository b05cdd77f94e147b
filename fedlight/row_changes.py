"""What a command changes in the paper row it runs.

A file under ``conf/<paper>/`` (``fedproto``, ``fedsls``, ``fuss``, ``ladd``) is a row: one cell of one of the paper's
tables, in the paper's setting (``docs/rows.md`` lists where a row still departs from it, and why). A command that
runs a row and changes one of its settings, with a flag (``--model.init_args.model_kwargs.pretrained=false``) or a
later ``--config`` file, runs a different experiment. ``fedlight fit`` says so on the console when the run starts,
and records it in the run's W&B notes (``--trainer.wandb_notes``), which ``config.yaml`` and every checkpoint keep.

Settings that decide only where and how the same experiment runs (the run folder and name, the loggers, the data's
and weights' locations, devices, precision-free execution modes, the seed) are not changes of the experiment.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: the folders of ``conf/`` that hold the papers' rows
PAPERS = ("fedproto", "fedsls", "fuss", "ladd")
#: folders of a paper's rows that are offline twins of the paper's experiments, not its setting
TWINS = (
    ("fuss", "twin"), ("fuss", "twin_cocostuff"), ("ladd", "twin"),
    ("fedproto", "scenes"), ("fedproto", "scenes_macro"),
)  # fmt: skip
#: rows that reproduce a paper's released code rather than the paper
RELEASED_CODE = "released_code"

#: settings (dotted, without ``init_args``) that place or watch a run without changing what it trains or scores
PLACEMENT = frozenset({
    "seed_everything", "ckpt_path",
    "trainer.default_root_dir", "trainer.name", "trainer.logger", "trainer.enable_progress_bar",
    "trainer.wandb_project", "trainer.wandb_entity", "trainer.wandb_mode", "trainer.wandb_group",
    "trainer.wandb_tags", "trainer.wandb_notes", "trainer.callbacks", "trainer.checkpoint_every",
    "trainer.accelerator", "trainer.threads", "trainer.devices", "trainer.num_nodes", "trainer.start_method",
    "trainer.channels_last", "trainer.client_batching", "trainer.compile_batched", "trainer.compile_steps",
    "trainer.gather_budget_mb", "trainer.client_state_budget_mb", "trainer.keep_client_states",
    "trainer.fail_fast", "trainer.rendezvous_timeout", "trainer.init_from", "data.eval_batch_size",
    "data.num_workers", "data.test_groups",
})  # fmt: skip
#: last parts of a setting that name where a file or folder is, or how it is fetched
LOCATIONS = frozenset({"root", "download", "checksums", "pretrained_file", "style_file", "clusters_file"})

#: how many changed settings the note names before it counts the rest
SHOWN = 6


def row_kind(path: str | Path) -> str | None:
    """``"paper"``, ``"twin"`` or ``"released code"`` for a row file under ``conf/<paper>/``, else None.

    >>> row_kind("conf/fedsls/cifar10/fedsls_alpha0.5.yaml"), row_kind("conf/fuss/twin/fedavg.yaml")
    ('paper', 'twin')
    >>> row_kind("conf/ladd/crosscity/released_code/ladd.yaml"), row_kind("conf/fedproto/analysis.yaml")
    ('released code', None)
    >>> print(row_kind("my_experiments/fedsls.yaml"))
    None
    """
    parts = Path(path).resolve().parts
    for i in range(len(parts) - 3):
        if parts[i] == "conf" and parts[i + 1] in PAPERS:
            inside = parts[i + 1 : -1]
            if tuple(inside[:2]) in TWINS:
                return "twin"
            return "released code" if RELEASED_CODE in inside else "paper"
    return None


def flattened(config: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted key, value)`` for each leaf of a resolved configuration, without the ``init_args`` levels.

    >>> dict(flattened({"model": {"class_path": "C", "init_args": {"lr": 0.1, "kw": {"a": 1}}}, "seed": 0}))
    {'model.class_path': 'C', 'model.lr': 0.1, 'model.kw.a': 1, 'seed': 0}
    """
    if isinstance(config, dict):  # an empty one has no leaves
        for key, value in config.items():
            yield from flattened(value, prefix if key == "init_args" else f"{prefix}{key}.")
    else:
        yield prefix.rstrip("."), config


def changed_settings(row: dict[str, Any], run: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(setting, row's value, run's value)`` for each setting of the experiment that ``run`` changes in ``row``
    (both resolved configurations); a setting only one of them has is None in the other.

    >>> row = {"trainer": {"rounds": 2000, "name": "r"}, "model": {"init_args": {"model_kwargs": {"pretrained": True}}}}
    >>> run = {"trainer": {"rounds": 20, "name": "mine"}, "model": {"init_args": {"model_kwargs": {}}}}
    >>> changed_settings(row, run)
    [('trainer.rounds', 2000, 20), ('model.model_kwargs.pretrained', True, None)]
    """
    before, after = dict(flattened(row)), dict(flattened(run))
    changes = []
    for key in [*before, *(key for key in after if key not in before)]:
        if key in PLACEMENT or key.rsplit(".", 1)[-1] in LOCATIONS:
            continue
        if before.get(key) != after.get(key):
            changes.append((key, before.get(key), after.get(key)))
    return changes


def note(row: str | Path, kind: str, changes: list[tuple[str, Any, Any]]) -> str:
    """One sentence naming the row, the changed settings (the first :data:`SHOWN` of them) and whose setting the run
    is not.

    >>> note("conf/fedsls/a.yaml", "paper", [("model.model_kwargs.pretrained", True, False)])
    "Not the paper's setting: this run changes conf/fedsls/a.yaml's model.model_kwargs.pretrained (true → false)."
    """
    named = [f"{key} ({_yaml(old)} → {_yaml(new)})" for key, old, new in changes[:SHOWN]]
    if len(changes) > SHOWN:
        named.append(f"and {len(changes) - SHOWN} more")
    whose = {"paper": "the paper's", "twin": "the twin's", "released code": "the released code's"}[kind]
    return f"Not {whose} setting: this run changes {row}'s {', '.join(named)}."


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)
