import os
import tempfile

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
