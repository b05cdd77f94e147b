"""What each paper table costs to reproduce: one round of its rows at full size, timed here and extrapolated.

For every paper table, the script reads each row config (``conf/<paper>/<dataset>/<row>.yaml``) as ``fedlight fit``
parses it and counts the work of one of its rounds (:mod:`workload`): the clients a round trains, the batches each
trains (local steps, or local epochs of its training split, stragglers included), the samples an evaluation scores
and how many evaluations a run makes, and the rule's own passes. Rows that train the same network on the same data
with the same loss form a *family*; one representative row of each family is built through the command line's
parser (:func:`fedlight.cli.build_parser`, its pretrained weights switched off, since they do not change the time),
and the script times on this machine (:mod:`timing`), on random tensors of the real shapes:

- **training steps** of the row's client module with the row's rule, run by the engine's own local loop
  (:meth:`fedlight.engine.local_fit.LocalTraining.train_steps`: the client's ``training_step``, the rule's
  ``training_loss``, the backward pass and every optimizer's step) at the row's batch size and crop: after one
  warm-up step (two for steps under a second; none when the process has just trained the same network at the same
  shapes with another loss, since what a first step pays for those shapes is paid), the median of as many steps
  as fit in a few seconds, at least two. MOON and
  FedProx get their frozen copies and anchors from the rule's own ``on_client_fit_start``, MOON a previous model;
  LADD's self-training gets frozen copies of its network as the pseudo-label and distillation teachers;
- **evaluation batches**: ``validation_step`` and the metric's update on a batch at the evaluation size (one of
  FUSS's 16-image batches is timed on 2 images and scaled, since one image at 320² with flip TTA and the dense CRF
  takes tens of seconds); each evaluated sample costs its share of the batch;
- the **one-off** work of a run: FUSS's backbone features of every training image, computed once per run by
  :meth:`fedlight.data.features.feature_cache.FeatureCache.build` (timed on 2 images), and FedSLS's static weights
  (one local epoch on every client, timed as steps, and a guided-backpropagation pass over every training image,
  :func:`fedlight.metrics.functional.saliency.saliency_norms`, timed on one batch).

A round then costs ``steps × s/step`` plus the rule's passes over the trained clients' data (MO-FedProto's
prototypes before and after training: one evaluation-sized forward per sample each), and a run adds its evaluations
(LADD's clustered rows score every test image twice, by the global model and by its style's cluster model) and its
one-off work. A table's cost is the sum over its rows of rounds × seeds × that. Not timed: reading, decoding and
augmenting images (batches are ready tensors), sampling, aggregation, logging, checkpoints and the analyses'
callbacks, all small beside the steps of the large rows. A measurement is shared by families that differ only in
their number of classes (CIFAR-10 and CIFAR-100, LADD's three targets).

Seeds are the papers' own: FedProto (Michieli & Ozay) reports single runs (its clients and batch orders are fixed
across runs), FedSLS five seeds per cell (its text also speaks of 10 experiments and of three trials with five seeds:
5 is the fewest runs that reading allows), FUSS single runs except COCO-Stuff's FedAvg and FedAvg + FedCC (four more
seeds), LADD single runs (mean ± std over the last 10 % of rounds). LADD's ``released_code/`` rows, which compare with
the released code rather than fill a table, are left out.

A "CPU-day" is a day of this machine: all its cores, ``torch.set_num_threads(2)``. GPU-hours are printed only when
a GPU timed the steps, which this script does not do.

    python benchmarks/rows/cost.py                   # every table (about 12 minutes on 2 cores)
    python benchmarks/rows/cost.py --tables LADD     # tables whose title contains "LADD"
    python benchmarks/rows/cost.py --reduced         # < 2 minutes: one step and one small batch per family,
                                                     # dense inputs shrunk 4×: a smoke test, not a cost
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import os
import platform
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import (  # noqa: E402
    is_dense,
    is_fuss,
    loss_owner,
    shrink,
    time_evaluation,
    time_feature_cache,
    time_saliency,
    time_training,
    training_batch,
)
from workload import (  # noqa: E402
    Federation,
    RoundPlan,
    evaluations,
    federation,
    instantiate,
    round_work,
    warmup_steps,
)

SECONDS_PER_DAY = 86_400.0
THREADS = 2
#: Weight options switched off in the built modules (no network here; random weights time the same).
NO_WEIGHTS = {"pretrained": False, "encoder_weights": None, "pretrained_file": None}
#: Images timed per FUSS evaluation batch and per feature-cache build.
VIT_IMAGES = 2


@dataclass(frozen=True)
class Table:
    """A paper table: its title and its row configs (globs under ``conf/``)."""

    title: str
    rows: tuple[str, ...]
    seeds: int = 1
    seeds_of: dict[str, int] = field(default_factory=dict)  # row stem → seeds, where a row has its own


TABLES = (
    Table("FedProto, Synthetic (Tables 2–4)", ("fedproto/synthetic/*.yaml",)),
    Table("FedProto, MNIST (Tables 2–4)", ("fedproto/mnist/*.yaml",)),
    Table("FedProto, FEMNIST (Tables 2, 4)", ("fedproto/femnist/*.yaml",)),
    Table("FedProto, CelebA (Tables 2, 4)", ("fedproto/celeba/*.yaml",)),
    Table("FedProto, FPascal (Fig. 5)", ("fedproto/pascal/*.yaml",)),
    Table("FedProto, FPascal macro (Fig. 5)", ("fedproto/pascal_macro/*.yaml",)),
    Table("FedSLS Table 1, CIFAR-10", ("fedsls/cifar10/*.yaml",), seeds=5),
    Table("FedSLS Table 1, CIFAR-100", ("fedsls/cifar100/*.yaml",), seeds=5),
    Table("FedSLS Table 1, CINIC-10", ("fedsls/cinic10/*.yaml",), seeds=5),
    Table("FedSLS Table 1, TinyImageNet", ("fedsls/tinyimagenet/*.yaml",), seeds=5),
    Table("FUSS Table 2, Cityscapes", ("fuss/cityscapes/*.yaml", "fuss/cityscapes/ma*/*.yaml")),
    Table("FUSS Table 4, Cityscapes", ("fuss/cityscapes/ma*/table4/*.yaml",)),
    Table("FUSS Table 3, COCO-Stuff", ("fuss/cocostuff/*.yaml",), seeds_of={"fedavg": 5, "fedavg_fedcc": 5}),
    Table("LADD Table 2, Cityscapes", ("ladd/cityscapes/*.yaml",)),
    Table("LADD Tables 3, 5–7, CrossCity", ("ladd/crosscity/*.yaml",)),
    Table("LADD Table 4, Mapillary", ("ladd/mapillary/*.yaml",)),
)
BASES = {"base.yaml", "pretrain_base.yaml"}  # what rows build on, not rows


# -- rows --------------------------------------------------------------------------------------------------
@dataclass
class Row:
    """One row config, parsed, with its work counted."""

    path: Path
    seeds: int
    cfg: Any  # the parsed ``fit`` namespace
    strategy: Any
    federation: Federation
    input_shape: tuple[int, ...]
    rounds: int
    evaluations: int
    plan: RoundPlan

    @property
    def model_args(self) -> dict[str, Any]:
        return self.cfg.model.init_args.as_dict()

    @property
    def client(self) -> str:
        return self.cfg.model.class_path.rsplit(".", 1)[-1]

    @property
    def caches_features(self) -> bool:
        """The run computes its frozen backbone's features once (FUSS's ``BackboneFeatureCache``)."""
        callbacks = self.cfg.trainer.callbacks or []
        return any(getattr(c, "class_path", "").endswith(".BackboneFeatureCache") for c in callbacks)

    @property
    def static_saliency(self) -> bool:
        """The rule computes FedSLS's static weights with the model before the first round."""
        return getattr(self.strategy, "uses_model", False) and getattr(self.strategy, "mode", None) == "static"


def row_paths(table: Table) -> list[Path]:
    """The table's row configs: its globs under ``conf/`` (absolute paths as they are), bases left out."""
    paths = set()
    for pattern in table.rows:
        paths |= {Path(pattern)} if Path(pattern).is_absolute() else set((REPO / "conf").glob(pattern))
    return sorted(p for p in paths if p.name not in BASES)


_DATA: dict[str, tuple[Federation, tuple[int, ...]]] = {}


def parse(parser: Any, path: Path) -> Any:
    """The ``fit`` namespace of a row, as ``fedlight fit --config <row>`` parses it; a row the parser refuses raises
    ``ValueError`` with the parser's message."""
    messages = io.StringIO()
    try:
        with contextlib.redirect_stderr(messages):
            return parser.parse_args(["fit", "--config", str(path)])
    except SystemExit:
        errors = [line for line in messages.getvalue().splitlines() if line.strip()]
        reason = next(
            (line for line in errors if "Problem with given class_path" in line), errors[-1] if errors else ""
        )
        raise ValueError(f"the parser refuses it: {reason.strip()}") from None


def read_row(parser: Any, path: Path, seeds: int) -> Row:
    """A row as ``fedlight fit`` parses it, with its rule built (cheap) and its data's shapes (no files read)."""
    from fedlight.data.datamodule import FederatedDataModule

    cfg = parse(parser, path).fit
    strategy = instantiate(cfg.strategy)
    trainer, data = cfg.trainer, cfg.data
    plan = RoundPlan(
        clients_per_round=trainer.clients_per_round,
        local_epochs=trainer.local_epochs,
        local_steps=trainer.local_steps,
        straggler_fraction=trainer.straggler_fraction,
        tolerate_stragglers=strategy.tolerate_stragglers,
        proportional=strategy.sampling == "proportional",
        batch_size=data.batch_size,
        drop_last=data.drop_last,
    )
    key = str(data)  # rows of one table share their data, and so their partition
    if key not in _DATA:
        transform = None if data.train_transform is None else instantiate(data.train_transform)
        shapes = FederatedDataModule(instantiate(data.dataset), batch_size=data.batch_size, train_transform=transform)
        _DATA[key] = (federation(data), tuple(shapes.input_shape))
    clients, shape = _DATA[key]
    return Row(
        path=path,
        seeds=seeds,
        cfg=cfg,
        strategy=strategy,
        federation=clients,
        input_shape=shape,
        rounds=trainer.rounds,
        evaluations=evaluations(trainer.rounds, trainer.eval_every),
        plan=plan,
    )


def network(row: Row) -> str:
    """The network a row trains, for grouping: registered name and its shape options (no weights)."""
    args = row.model_args
    if "backbone" in args:
        return args["backbone"]
    options = {k: v for k, v in (args.get("model_kwargs") or {}).items() if k not in NO_WEIGHTS}
    return args["model"] + "".join(f" {k}={v}" for k, v in sorted(options.items()))


def teachers(row: Row) -> tuple[str, ...]:
    """The frozen teachers a LADD self-training step runs (none for other clients)."""
    if row.client != "SelfTrainingClient":
        return ()
    kd = getattr(row.strategy, "kd_teacher", False) and row.model_args.get("lambda_kd", 0) > 0
    return ("pseudo", "kd") if kd else ("pseudo",)


def step_key(row: Row) -> tuple:
    return (row.client, network(row), row.input_shape, row.plan.batch_size, loss_owner(row.strategy), teachers(row))


def eval_key(row: Row) -> tuple:
    args = row.model_args
    shape = row.federation.test_shape or row.input_shape
    return (network(row), shape, row.cfg.data.eval_batch_size, args.get("flip_tta"), args.get("crf"))


def family_key(row: Row) -> tuple:
    trainer = row.cfg.trainer
    work = (trainer.clients_per_round, trainer.local_epochs, trainer.local_steps, row.cfg.data.centralized)
    dataset = row.cfg.data.dataset.class_path
    return (step_key(row), eval_key(row), dataset, work, row.rounds, trainer.eval_every)


# -- building and timing ----------------------------------------------------------------------------------
_BUILT: dict[str, tuple[Any, Any]] = {}


def build(parser: Any, row: Row) -> tuple[Any, Any, Any]:
    """The row's client module, rule and data module, built by the command line's parser without weights.

    The last module built is reused by the next row with the same model and data sections (FUSS's rules share a
    ViT-B/8); its rule is always the row's own, built afresh.
    """
    key = f"{row.cfg.model}|{row.cfg.data}"
    if key in _BUILT:
        module, data = _BUILT[key]
        return module, instantiate(row.cfg.strategy), data
    _BUILT.clear()
    gc.collect()
    cfg = parse(parser, row.path)
    args = cfg.fit.model.init_args
    kwargs = getattr(args, "model_kwargs", None)
    for key, off in NO_WEIGHTS.items():
        if isinstance(kwargs, dict) and key in kwargs:
            kwargs[key] = off
    if getattr(args, "pretrained", None) is not None:  # FUSS's backbone: a random initialisation
        args.pretrained = None
    objects = parser.instantiate(cfg)["fit"]
    torch.set_num_threads(THREADS)  # building the trainer set its own thread count
    _BUILT[key] = (objects.model, objects.data)
    return objects.model, objects.strategy, objects.data


@dataclass
class Measured:
    """Seconds measured for one family (``None``: not part of its rows' work)."""

    step: float
    batchnorm: bool  # the network trains BatchNorm (the engine then skips a last batch of one sample)
    eval_sample: float
    eval_images: int
    cache_image: float | None = None
    saliency_image: float | None = None


def measure(parser: Any, rows: list[Row], reduced: bool, cache: dict) -> Measured:
    """Times what the rows of a family run, on their first row; what was measured for another family with the
    same step or evaluation key is reused."""
    row = rows[0]
    skey, ekey = step_key(row), eval_key(row)
    wanted = [("step", skey), ("eval", ekey)]
    if any(r.caches_features for r in rows):
        wanted.append(("cache", (network(row), row.input_shape)))
    if any(r.static_saliency for r in rows):
        wanted.append(("saliency", (network(row), row.input_shape)))
    missing = [key for key in wanted if key not in cache]
    if missing:
        module, strategy, data = build(parser, row)
        dense, classes = is_dense(module), data.num_classes
        shape = shrink(row.input_shape, reduced, dense)
        batch = min(row.plan.batch_size, 2) if reduced else row.plan.batch_size
        for what, key in missing:
            name = row.path.relative_to(REPO / "conf")
            if what == "step":
                step, durations = time_training(
                    module, strategy, training_batch(module, shape, batch, classes), teachers(row), reduced,
                    (network(row), shape, batch),
                )  # fmt: skip
                seconds = ", ".join(f"{d:.3g}" for d in durations)
                print(f"  {name}: training steps, batch {batch} × {shape}: {seconds} s", flush=True)
                batchnorm = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in module.modules())
                cache[what, key] = {"step": step, "batchnorm": batchnorm}
            elif what == "eval":
                eval_shape = shrink(row.federation.test_shape or row.input_shape, reduced, dense)
                images = row.cfg.data.eval_batch_size
                images = min(images, 2 if reduced else VIT_IMAGES) if reduced or is_fuss(module) else images
                per_sample = time_evaluation(module, eval_shape, images, classes, row.federation.groups)
                print(f"  {name}: evaluation, {images} × {eval_shape}: {per_sample:.3g} s per sample", flush=True)
                cache[what, key] = {"eval_sample": per_sample, "eval_images": images}
            elif what == "cache":
                per_image = time_feature_cache(module, shape, VIT_IMAGES)
                print(f"  {name}: backbone features of {VIT_IMAGES} images: {per_image:.3g} s per image", flush=True)
                cache[what, key] = {"cache_image": per_image}
            else:
                size = batch if reduced else next(r for r in rows if r.static_saliency).strategy.batch_size
                per_image = time_saliency(module, shape, size, classes)
                print(f"  {name}: guided backpropagation, batch {size}: {per_image:.3g} s per image", flush=True)
                cache[what, key] = {"saliency_image": per_image}
    found: dict[str, Any] = {}
    for key in wanted:
        found.update(cache[key])
    return Measured(**found)


# -- costs ------------------------------------------------------------------------------------------------
@dataclass
class RowCost:
    """Seconds of one run of a row."""

    row: Row
    steps: float  # training batches per round
    clients: float  # clients that train per round
    train_round: float  # seconds of a round's local work (steps and the rule's passes)
    evaluation: float  # seconds of one evaluation
    one_off: float  # seconds of the run's one-off work

    @property
    def run(self) -> float:
        return self.row.rounds * self.train_round + self.row.evaluations * self.evaluation + self.one_off

    @property
    def per_round(self) -> float:
        return self.run / self.row.rounds

    @property
    def total(self) -> float:
        return self.run * self.row.seeds


def row_cost(row: Row, measured: Measured) -> RowCost:
    """A run's seconds from the row's work and its family's measurements."""
    from dataclasses import replace

    min_last_batch = 2 if measured.batchnorm else 1
    work = round_work(row.federation.train, replace(row.plan, min_last_batch=min_last_batch))
    strategy = row.strategy
    passes = 0
    if type(strategy).__name__ == "FedProto":  # prototypes after training, and before it for the LPM
        passes = 1 + int(strategy.use_lpm)
    train_round = work.steps * measured.step + passes * work.samples * measured.eval_sample
    scorers = 1 + int("test" in getattr(strategy, "routed_splits", ()))  # the cluster model scores each image too
    evaluation = scorers * row.federation.test * measured.eval_sample
    one_off = 0.0
    if row.caches_features:
        one_off += row.federation.images * measured.cache_image
    if row.static_saliency:
        train = row.federation.train
        one_off += warmup_steps(train, row.plan.batch_size, strategy.warmup_epochs) * measured.step
        one_off += int(train.sum()) * measured.saliency_image
    return RowCost(row, work.steps, work.clients, train_round, evaluation, one_off)


# -- output -----------------------------------------------------------------------------------------------
def days(seconds: float) -> str:
    """Days, to two significant figures.

    >>> days(0.0), days(864.0), days(86_400 * 1234.5), days(86_400 * 3.14159)
    ('< 0.01', '0.01', '1,200', '3.1')
    """
    value = seconds / SECONDS_PER_DAY
    if value < 0.01:
        return "< 0.01"
    rounded = float(f"{value:.2g}")
    return f"{rounded:,.0f}" if rounded >= 100 else f"{rounded:g}"


LOSS_NAMES = {
    "Strategy": "task loss",
    "FedProx": "+ proximal term",
    "FedCCProx": "+ proximal term",
    "MOON": "+ model-contrastive term",
    "FedCCMOON": "+ model-contrastive term",
    "FedDecorr": "+ decorrelation term",
}


def family_label(row: Row) -> str:
    """What a family trains: network, input and batch, and the loss of its steps."""
    skey = step_key(row)
    loss = LOSS_NAMES.get(skey[4], skey[4])
    if row.client == "SelfTrainingClient":
        roles = " and ".join({"pseudo": "pseudo-label", "kd": "KD"}[t] for t in skey[5])
        loss = f"self-training with {roles} teachers"
    elif row.client == "SourcePretrainingClient":
        loss = "supervised with HNM" + (", centralized" if len(row.federation.train) == 1 else "")
    elif row.client == "UnsupervisedSegmentationClient":
        loss = f"STEGO head on cached features, {loss}"
    elif len(row.federation.train) == 1:
        loss += ", centralized"
    shape = "×".join(map(str, skey[2]))
    return f"{skey[1].split(' ')[0]} {shape}, batch {skey[3]}: {loss}"


def one_off(costs: list[RowCost]) -> str:
    """The one-off hours of a run, for the family's rows that have any (FUSS's features, FedSLS's static weights).

    A family whose rows differ shows the largest, with how many rows have it.
    """
    hours = [c.one_off / 3600 for c in costs if c.one_off > 0]
    if not hours:
        return "–"
    return f"{max(hours):.2g}" + ("" if len(hours) == len(costs) else f" ({len(hours)} rows)")


def first_line(err: BaseException) -> str:
    """An error's type and the first line of its message."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"


def count(value: float) -> str:
    """A count to three significant figures, with thousands separators.

    >>> count(2.0416), count(10.0), count(1560.0), count(8333.3)
    ('2.04', '10', '1,560', '8,330')
    """
    return f"{float(f'{value:.3g}'):,.0f}" if value >= 100 else f"{value:.3g}"


def cpu_name() -> str:
    """The processor's model name (Linux), else the architecture."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.machine()


def report(
    tables: list[tuple[Table, list[tuple[list[RowCost], Measured]]]],
    reduced: bool,
    loads: tuple,
    skipped: list[tuple[Path, str]],
) -> str:
    gpu = "not measured (no GPU)"
    lines = [
        "Cost of the paper tables, measured on this machine: "
        f"{cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__} with "
        f"{torch.get_num_threads()} threads; load average {loads[0]} before, {loads[1]} after; peak resident "
        f"memory {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.1f} GiB.",
        "Method: k training steps and one evaluation batch of each family's representative row at full size on "
        "random tensors (after a warm-up), extrapolated to a round with the row's own work (clients, local steps or "
        "epochs of the clients' training splits, evaluations) and to a table: rounds × seeds × rows. "
        "CPU-day: a day of this machine.",
    ]
    if reduced:
        lines.append("REDUCED RUN: one step of a batch of at most 2, dense inputs shrunk 4×: a smoke test, not a cost.")
    if float(loads[0].split()[0]) > 1.5:  # before the run: the load after it counts the run's own threads
        lines.append(
            "The machine was busy with other work (1-minute load above 1.5): its threads wait for the cores, which "
            "slows the small models' steps most (each of their many short operations waits), up to 100×."
        )
    lines += [
        "",
        "| paper table | family | rows | seeds | rounds | clients × steps per round | s per step | "
        "s per eval batch | one-off h per run | h per round | CPU-days |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    summary = [
        "| paper table | rows | runs | h per round | CPU-days | GPU-hours |",
        "|---|---|---|---|---|---|",
    ]
    for table, families in tables:
        all_costs = [c for costs, _ in families for c in costs]
        for costs, measured in families:
            row = costs[0].row
            seeds = sorted({c.row.seeds for c in costs})
            eval_batch = measured.eval_sample * row.cfg.data.eval_batch_size
            lines.append(
                f"| {table.title} | {family_label(row)} | {len(costs)} | "
                f"{'/'.join(map(str, seeds))} | {row.rounds} | "
                f"{count(statistics.fmean(c.clients for c in costs))} × "
                f"{count(statistics.fmean(c.steps / max(c.clients, 1e-9) for c in costs))} | "
                f"{measured.step:.3g} | {eval_batch:.3g} | {one_off(costs)} | "
                f"{statistics.fmean(c.per_round for c in costs) / 3600:.2g} | {days(sum(c.total for c in costs))} |"
            )
        if not all_costs:
            summary.append(f"| {table.title} | 0 | 0 | – | not costed | {gpu} |")
            continue
        per_round = [c.per_round / 3600 for c in all_costs]
        span = (
            f"{min(per_round):.2g}"
            if min(per_round) == max(per_round)
            else f"{min(per_round):.2g}–{max(per_round):.2g}"
        )
        summary.append(
            f"| {table.title} | {len(all_costs)} | {sum(c.row.seeds for c in all_costs)} | {span} | "
            f"about {days(sum(c.total for c in all_costs))} | {gpu} |"
        )
    everything = [c for _, families in tables for costs, _ in families for c in costs]
    summary.append(
        f"| all of the above | {len(everything)} | {sum(c.row.seeds for c in everything)} | – | "
        f"about {days(sum(c.total for c in everything))} | {gpu} |"
    )
    notes = [f"- `{path.relative_to(REPO)}`: {reason}" for path, reason in skipped]
    if notes:
        notes.insert(0, "Rows not costed (left out of the tables above):")
    return "\n".join([*lines, "", *summary, *(["", *notes] if notes else [])])


def run(parser: Any, tables: list[Table], reduced: bool = False) -> str:
    """Costs ``tables`` with the command line's ``parser``; returns the report (also printed)."""
    loads = [" ".join(f"{x:.2f}" for x in os.getloadavg())]
    started = time.perf_counter()
    cache: dict = {}
    results = []
    skipped: list[tuple[Path, str]] = []  # rows not costed, and why
    for table in tables:
        print(f"{table.title} ({time.perf_counter() - started:.0f} s)", flush=True)
        groups: dict[tuple, list[Row]] = {}
        for path in row_paths(table):
            try:
                row = read_row(parser, path, table.seeds_of.get(path.stem, table.seeds))
            except Exception as err:
                skipped.append((path, first_line(err)))
                continue
            groups.setdefault(family_key(row), []).append(row)
        families = []
        for members in groups.values():
            try:
                measured = measure(parser, members, reduced, cache)
            except Exception as err:
                skipped += [(r.path, f"timing its family failed ({first_line(err)})") for r in members]
                continue
            families.append(([row_cost(r, measured) for r in members], measured))
        results.append((table, families))
    loads.append(" ".join(f"{x:.2f}" for x in os.getloadavg()))
    text = report(results, reduced, tuple(loads), skipped)
    print(f"\n{text}\n\nmeasured in {time.perf_counter() - started:.0f} s")
    return text


def main(argv: list[str] | None = None) -> str:
    options = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    options.add_argument("--tables", nargs="*", default=None, help="tables whose title contains any of these")
    options.add_argument("--rows", nargs="*", default=None, help="cost these row configs instead, as one table")
    options.add_argument("--reduced", action="store_true", help="one step per family at shrunk sizes (smoke)")
    args = options.parse_args(argv)
    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    from fedlight.cli import build_parser

    tables = [t for t in TABLES if args.tables is None or any(s.lower() in t.title.lower() for s in args.tables)]
    if args.rows:
        tables = [Table("the rows given", tuple(str(Path(p).resolve()) for p in args.rows))]
    return run(build_parser(), tables, args.reduced)


if __name__ == "__main__":
    main()
