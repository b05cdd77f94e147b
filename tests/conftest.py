import os

import torch

# Tests never talk to W&B; the runs that check W&B logging opt back in explicitly.
os.environ.setdefault("WANDB_MODE", "disabled")
# The test models are tiny: one intra-op thread per test process is fastest and avoids oversubscribing
# the cores when pytest-xdist runs several processes.
torch.set_num_threads(1)
