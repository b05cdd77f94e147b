"""What ``import fedlight`` gives a script: the public names, without importing torch until one is used."""

import subprocess
import sys

import fedlight


def fresh(code: str) -> str:
    """Runs ``code`` in a new interpreter (where nothing of fedlight is imported yet) and returns its output."""
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.strip()


def test_the_readmes_one_liner_works_after_a_bare_import():
    code = "import fedlight; print(fedlight.checkpoint.read_weights.__module__, fedlight.read_weights.__name__)"
    assert fresh(code) == "fedlight.checkpoint read_weights"


def test_import_fedlight_alone_does_not_import_torch():
    assert fresh("import sys, fedlight; print('torch' in sys.modules)") == "False"


def test_every_public_name_resolves_to_the_object_its_module_defines():
    from fedlight.checkpoint import read_weights
    from fedlight.data.datamodule import FederatedDataModule
    from fedlight.engine.trainer import FederatedTrainer

    assert (fedlight.FederatedTrainer, fedlight.FederatedDataModule) == (FederatedTrainer, FederatedDataModule)
    assert fedlight.read_weights is read_weights
    for name in fedlight.__all__:
        assert getattr(fedlight, name) is not None, name
    assert set(fedlight.__all__) <= set(dir(fedlight))


def test_all_lists_exactly_the_lazily_imported_names():
    assert set(fedlight.__all__) == {*fedlight._NAMES, *fedlight._MODULES, "__version__"}
