import os
import tempfile
from pathlib import Path

import pytest
import torch

# Tests never talk to W&B; the runs that check W&B logging opt back in explicitly.
os.environ.setdefault("WANDB_MODE", "disabled")
# Help pages that a test's `fedlight … --help` keeps go to a folder of the test run, not the user's cache.
os.environ.setdefault("FEDLIGHT_CACHE_DIR", tempfile.mkdtemp(prefix="fedlight-help-"))
# The test models are tiny: one intra-op thread per test process is fastest and avoids oversubscribing
# the cores when pytest-xdist runs several processes.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _isolated_seed():
    """``seed_everything`` exports PL_GLOBAL_SEED; keep one test's seed from leaking into the next."""
    os.environ.pop("PL_GLOBAL_SEED", None)
    yield
    os.environ.pop("PL_GLOBAL_SEED", None)


#: the checkout's own run folder, where ``fedlight fit`` writes by default: tests write under their tmp_path
CHECKOUT_RUNS = Path(__file__).resolve().parents[1] / "runs"


@pytest.fixture(autouse=True)
def _leaves_the_checkout_s_runs_alone(monkeypatch):
    """A test whose run starts in the checkout's ``runs/`` fails: a user's ``--ckpt_path last`` would pick it up.

    The run folders this process creates are watched (not the folder's listing, which a user's run or another test
    process may change meanwhile).
    """
    from fedlight.engine import rundir

    created = []

    def watched(parent, *args, **kwargs):
        run_dir = new_version_dir(parent, *args, **kwargs)
        created.append(run_dir)
        return run_dir

    new_version_dir = rundir.new_version_dir
    monkeypatch.setattr(rundir, "new_version_dir", watched)
    yield
    inside = [str(p) for p in created if Path(p).resolve().is_relative_to(CHECKOUT_RUNS)]
    assert not inside, f"the test started runs in {inside}: give its trainer a default_root_dir under tmp_path"


@pytest.fixture
def runs_in_tmp(tmp_path, monkeypatch):
    """For modules whose trainers are built without a ``default_root_dir``: ``runs/`` is the test's own."""
    monkeypatch.chdir(tmp_path)
