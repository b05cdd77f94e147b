"""The machine's limit next to every engine's rounds/s: how much of the arithmetic the hardware can do a round uses.

Two numbers make the limit column of the speed report:

- the FLOPs of a round's local training, counted by PyTorch's own ``torch.utils.flop_counter.FlopCounterMode``
  on one forward and backward pass of a batch (matrix products and convolutions, the only operations it counts)
  and scaled by the samples the round's clients process (F epochs of each sampled client's training data);
- the machine's achieved GFLOP/s on the two kernels such steps spend their time in, a large matrix product and a
  3×3 convolution, timed here in the run's arithmetic (fp32, or bf16 under a bf16 precision) with 1 and N
  intra-op threads, each for at most a few seconds.

An engine's achieved GFLOP/s is the round's FLOPs times its rounds/s; its share of the limit is that over the
faster kernel at the engine's precision and threads. A step of a small MLP at batch 10 cannot approach a 2048²
matmul's rate, so a low share on such workloads says where time goes (per-step overhead), not that an engine is
slow against the floor, which the report's ratios say.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode


def step_flops(net: torch.nn.Module, batch: torch.Tensor, target: torch.Tensor, task: str) -> float:
    """FLOPs of one training step (forward, loss, backward) of ``net`` on ``batch``, as PyTorch counts them."""
    net = net.train()
    with FlopCounterMode(display=False) as counter:
        logits = net(batch)
        if task == "segmentation":
            loss = torch.nn.functional.cross_entropy(logits, target, ignore_index=255)
        else:
            loss = torch.nn.functional.cross_entropy(logits, target)
        loss.backward()
    net.zero_grad(set_to_none=True)
    return float(counter.get_total_flops())


def round_flops(data: Any, clients: list[int], local_epochs: int, flops_per_sample: float) -> float:
    """FLOPs of one round's local training: F epochs over each of ``clients``' training samples."""
    samples = sum(int(data.num_samples[k]) for k in clients) * local_epochs
    return samples * flops_per_sample


#: seconds after which a kernel's timing stops repeating: a CPU without bf16 units emulates a bf16 convolution at a
#: few GFLOP/s, where ten repeats of each kernel took minutes
BUDGET_S = 2.0


def _rate(flops: float, fn, repeats: int, budget_s: float = BUDGET_S) -> float:
    """GFLOP/s of ``fn`` over up to ``repeats`` calls after a warm-up, stopping once ``budget_s`` has passed."""
    fn()  # warm-up: allocation, kernel selection
    started = time.perf_counter()
    done = 0
    while done < repeats and (done == 0 or time.perf_counter() - started < budget_s):
        fn()
        done += 1
    return flops * done / (time.perf_counter() - started) / 1e9


def machine_gflops(dtype: torch.dtype, threads: int, device: str = "cpu") -> dict[str, float]:
    """Achieved GFLOP/s of a 2048² matrix product and of a 64→64 3×3 convolution on 32 images of 32×32."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.randn(2048, 2048, device=device, dtype=dtype)
        images = torch.randn(32, 64, 32, 32, device=device, dtype=dtype)
        weight = torch.randn(64, 64, 3, 3, device=device, dtype=dtype)

        def synchronise():
            if device != "cpu":
                torch.cuda.synchronize()

        matmul = _rate(2 * 2048**3, lambda: (a @ a, synchronise()), repeats=5)
        conv_flops = 2 * 32 * 64 * 64 * 9 * 32 * 32
        conv = _rate(conv_flops, lambda: (torch.nn.functional.conv2d(images, weight, padding=1), synchronise()), 10)
    finally:
        torch.set_num_threads(previous)
    return {"matmul": matmul, "conv": conv}


def limit_table(precision: str, threads: int, device: str = "cpu") -> dict[str, dict[str, float]]:
    """The machine's GFLOP/s in the run's arithmetic (bf16 under a bf16 precision, else fp32), at 1 and ``threads``."""
    table = {}
    for dtype in (torch.bfloat16,) if precision.startswith("bf16") else (torch.float32,):
        for n in sorted({1, threads}):
            table[f"{str(dtype).removeprefix('torch.')}, {n} thread(s)"] = machine_gflops(dtype, n, device)
    return table


def share_of_limit(flops_per_round: float, rounds_per_s: float, limit: dict[str, float]) -> tuple[float, float]:
    """An engine's achieved GFLOP/s and its share of the faster kernel's rate.

    >>> share_of_limit(2e9, 5.0, {"matmul": 100.0, "conv": 40.0})
    (10.0, 0.1)
    """
    achieved = flops_per_round * rounds_per_s / 1e9
    return achieved, achieved / max(limit.values())


def first_batch(data: Any, client: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One training batch of ``client`` (the batch size every step of the workload uses)."""
    generator = torch.Generator().manual_seed(0)
    x, y = next(iter(data.train_batches(client, generator)))[:2]
    return x, y


def mean_flops_per_sample(net: torch.nn.Module, data: Any, task: str) -> float:
    """FLOPs of a training step per sample, on the largest client's first batch."""
    client = int(np.argmax(data.num_samples))
    x, y = first_batch(data, client)
    return step_flops(net, x, y, task) / len(y)
