"""The ``fedlight`` command imports the heavy optional libraries only where a run uses them.

W&B, scikit-learn, timm, segmentation-models-pytorch, dp-accounting, Optuna, MLflow and TensorBoard each cost up
to seconds per process; ``fedlight fit --help`` needs none of them, yet must still list every registered network,
client and strategy. Timings live in ``benchmarks/speed/startup.py``; this test checks which modules are loaded.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Imported by fedlight only inside the functions, models and loggers that use them.
NEVER_AT_START = (
    "wandb", "sklearn", "timm", "segmentation_models_pytorch", "dp_accounting", "pandas", "optuna", "mlflow",
    "tensorboard", "mlxtend",
)  # fmt: skip
# Lightning's own import already loads parts of these (through torchmetrics); fedlight must add none.
NOTHING_BEYOND_LIGHTNING = ("matplotlib", "scipy", "torchvision", "PIL")

CHILD = """
import contextlib, io, json, sys
import lightning
with_lightning = set(sys.modules)
import fedlight.cli
help_text = io.StringIO()
with contextlib.redirect_stdout(help_text):
    try:
        fedlight.cli.main(["fit", "--help"])
    except SystemExit:
        pass
import fedlight.clients, fedlight.models, fedlight.strategies
clients = [name for name in fedlight.clients.__all__
           if isinstance(getattr(fedlight.clients, name), type)
           and issubclass(getattr(fedlight.clients, name), fedlight.clients.FederatedClient)]
strategies = [name for name in fedlight.strategies.__all__
              if isinstance(getattr(fedlight.strategies, name), type)
              and issubclass(getattr(fedlight.strategies, name), fedlight.strategies.Strategy)]
print(json.dumps({
    "lightning": sorted(with_lightning),
    "after": sorted(sys.modules),
    "help": help_text.getvalue(),
    "models": fedlight.models.list_models(),
    "clients": clients,
    "strategies": strategies,
}))
"""


def _child() -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def _package(module: str) -> str:
    return module.split(".", 1)[0]


def test_fit_help_loads_no_heavy_optional_library_and_lists_every_registered_name():
    child = _child()
    after, with_lightning = set(child["after"]), set(child["lightning"])

    loaded = sorted(m for m in after if _package(m) in NEVER_AT_START)
    assert loaded == [], f"imported by `import fedlight.cli` or `fedlight fit --help`: {loaded}"
    added = sorted(m for m in after - with_lightning if _package(m) in NOTHING_BEYOND_LIGHTNING)
    assert added == [], f"imported by fedlight beyond what `import lightning` loads: {added}"

    # The lists in the help are wrapped at spaces; compare with single spaces.
    text = " ".join(child["help"].split())
    assert child["models"] and child["clients"] and child["strategies"]
    for name in child["models"]:
        assert f" {name}," in text or f" {name} or" in text, f"network {name!r} missing from --help"
    for name in child["clients"]:
        assert f"fedlight.clients.{name}" in text, f"client {name} missing from --help"
    for name in child["strategies"]:
        assert f"fedlight.strategies.{name}" in text, f"strategy {name} missing from --help"
