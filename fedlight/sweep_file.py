"""A W&B sweep file read and checked for the local runner: method, metric, swept and fixed parameters, command.

Every problem of a file (YAML that does not parse, a ``metric`` or ``parameters`` that is not a mapping, ``values``
that is not a non-empty list, ``min`` above ``max``, a method or distribution the runner does not take) is reported
together, naming the file, before any trial runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import product
from pathlib import Path
from typing import Any

import yaml

from fedlight.errors import ConfigError

#: W&B's sweep methods and the Optuna sampler of each
METHODS = ("grid", "random", "bayes")
#: W&B's distributions of a parameter given by min and max that the local runner draws from
DISTRIBUTIONS = ("uniform", "int_uniform", "log_uniform_values", "log_uniform")


@dataclass(frozen=True)
class SweepFile:
    """What a W&B sweep file says, checked: method, metric, swept and fixed parameters, and the base command."""

    name: str
    method: str
    metric: str
    maximize: bool
    swept: dict[str, dict[str, Any]]
    fixed: dict[str, Any]
    command: list[str]
    run_cap: int | None = None
    grid: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def read(cls, path: Path, method: str | None = None) -> SweepFile:
        """Reads and checks ``path``; every problem is reported together."""
        if not path.is_file():
            raise ConfigError(f"The sweep file {path} does not exist.")
        try:
            content = yaml.safe_load(path.read_text())
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            raise ConfigError(
                f"The sweep file {path} is not valid YAML{where}: {getattr(err, 'problem', None) or err}."
            ) from None
        if not isinstance(content, dict):
            raise ConfigError(f"The sweep file {path} is not a W&B sweep (method, metric, parameters, command).")
        problems = []
        method = method or content.get("method")
        if method not in METHODS:
            problems.append(f"{path}: method is {method!r}; the local runner takes one of {', '.join(METHODS)}.")
        metric = content.get("metric") or {}
        if not isinstance(metric, dict):
            problems.append(
                f"{path}: metric is {metric!r}; give a mapping, e.g. metric: {{name: test/acc, goal: maximize}}."
            )
            metric = {"name": "?"}
        if not metric.get("name"):
            problems.append(f"{path}: metric.name is missing; name the logged value to optimise (e.g. test/acc).")
        goal = metric.get("goal", "minimize")
        if goal not in ("maximize", "minimize"):
            problems.append(f"{path}: metric.goal is {goal!r}; use maximize or minimize.")
        swept, fixed = {}, {}
        parameters = content.get("parameters") or {}
        if not isinstance(parameters, dict):
            problems.append(
                f"{path}: parameters is a {type(parameters).__name__}; give a mapping of each flag to its values."
            )
            parameters = {}
        for key, spec in parameters.items():
            if not isinstance(spec, dict):
                problems.append(f"{path}: parameters.{key} must be a mapping (values, value, or min and max).")
            elif "value" in spec:
                fixed[key] = spec["value"]
            elif "values" in spec and "probabilities" not in spec:
                if not isinstance(spec["values"], list) or not spec["values"]:
                    problems.append(
                        f"{path}: parameters.{key}.values is {spec['values']!r}; give a non-empty list "
                        f"(values: [{spec['values']!r}]), or value: for a fixed one."
                    )
                    continue
                swept[key] = {"values": list(spec["values"])}
            elif {"min", "max"} <= spec.keys() and not all(
                isinstance(spec[k], int | float) and not isinstance(spec[k], bool) for k in ("min", "max")
            ):
                problems.append(
                    f"{path}: parameters.{key} needs numbers for min and max, got {spec['min']!r}, {spec['max']!r}."
                )
            elif {"min", "max"} <= spec.keys() and spec["min"] > spec["max"]:
                problems.append(f"{path}: parameters.{key} has min {spec['min']} > max {spec['max']}; swap them.")
            elif {"min", "max"} <= spec.keys() and method != "grid":
                distribution = spec.get("distribution") or (
                    "int_uniform" if all(isinstance(spec[k], int) for k in ("min", "max")) else "uniform"
                )
                if distribution not in DISTRIBUTIONS:
                    problems.append(
                        f"{path}: parameters.{key} has distribution {distribution}; the local runner draws from "
                        f"{', '.join(DISTRIBUTIONS)} (or give values)."
                    )
                swept[key] = {"min": spec["min"], "max": spec["max"], "distribution": distribution}
            else:
                problems.append(
                    f"{path}: parameters.{key} must give values (a list), value, or min and max (random or bayes "
                    "only); probabilities and nested parameters are not supported by the local runner."
                )
        if not swept:
            problems.append(f"{path}: no parameter is swept (give at least one parameter with values or min/max).")
        command = base_command(content.get("command"))
        if problems:
            raise ConfigError(*problems)
        grid = []
        if method == "grid":
            grid = [dict(zip(swept, point, strict=True)) for point in product(*(s["values"] for s in swept.values()))]
        return cls(
            name=path.stem, method=method, metric=metric["name"], maximize=goal == "maximize", swept=swept,
            fixed=fixed, command=command, run_cap=content.get("run_cap"), grid=grid,
        )  # fmt: skip

    def budget(self, trials: int | None) -> int:
        """How many trials the sweep has in all: the grid's points (at most ``run_cap``), else ``trials`` or
        ``run_cap``."""
        if self.method == "grid":
            return min(len(self.grid), self.run_cap or len(self.grid))
        budget = trials or self.run_cap
        if budget is None or budget < 1:
            raise ConfigError(
                f"A {self.method} sweep needs its number of trials: pass --trials N to fedlight sweep, or add "
                "run_cap: N to the sweep file."
            )
        return budget


def base_command(command: list[str] | None) -> list[str]:
    """The fedlight arguments of a W&B sweep command: from the subcommand on, without W&B's ``${…}`` macros and
    without ``--trainer.wandb_mode``, which the W&B agent needs for its server (here the configuration, the
    environment or a flag given to ``fedlight sweep`` decides).

    >>> base_command(["${env}", "fedlight", "fit", "--config", "a.yaml", "--trainer.wandb_mode=online", "${args}"])
    ['fit', '--config', 'a.yaml']
    >>> base_command(None)
    ['fit']
    """
    words = [str(word) for word in command or []]
    start = next((i for i, word in enumerate(words) if word in ("fit", "validate", "test")), None)
    if start is None:
        return ["fit"]
    return [w for w in words[start:] if not w.startswith("${") and not w.startswith("--trainer.wandb_mode")]
