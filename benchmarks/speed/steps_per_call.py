"""Where a compiled step's time goes as more steps run per compiled call: workload (a)'s MLP, one client, one thread.

One client's fit of the (a) MLP (60→128→256→10, batch 10, SGD lr 0.01 with momentum 0 as in (a)) over the same
batches, timed per step:

- ``eager``: the plain PyTorch loop (``zero_grad``, ``backward``, ``step``), the floor's step;
- ``k = 1, 2, 4, …``: fedlight's compiled whole step (:class:`fedlight.engine.whole_step.WholeStep`) with
  ``steps_per_call`` k, compiled once before timing (its compilation time is printed beside it).

Fits alternate between the variants (eager, k = 1, k = 2, …, eager, …) so drifting load hits all of them; each
figure is the median over repeats. A call of k steps costs about ``a·k + b``: ``a`` the steps' own work inside
the graph and ``b`` what entering the compiled code costs once per call (guards, argument handling, the launch),
so the time per step is ``a + b/k``. That line through the smallest and the largest k measured says how much of a
step is per-call overhead and what the time per step tends to as k grows.

    python benchmarks/speed/steps_per_call.py                   # k = 1 2 4 8 16, 160 steps, 5 repeats
    python benchmarks/speed/steps_per_call.py --ks 1 8 --steps 80 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2])]

import torch  # noqa: E402
from torch import nn  # noqa: E402

from fedlight.engine.whole_step import WholeStep  # noqa: E402
from fedlight.testing import PlainPrecision  # noqa: E402


class MLP(nn.Module):
    """Workload (a)'s network and loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(60, 128), nn.ReLU(), nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 10))

    def training_step(self, batch, batch_idx):
        return {"loss": nn.functional.cross_entropy(self.net(batch[0]), batch[1])}


def make_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        (torch.randn(10, 60, generator=generator), torch.randint(0, 10, (10,), generator=generator))
        for _ in range(steps)
    ]


def eager_fit(module: MLP, batches) -> float:
    optimizer = torch.optim.SGD(module.parameters(), lr=0.01)
    started = time.perf_counter()
    for batch_idx, batch in enumerate(batches):
        loss = module.training_step(batch, batch_idx)["loss"]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return time.perf_counter() - started


def compiled_fit(module: MLP, step: WholeStep, batches) -> float:
    optimizer = torch.optim.SGD(module.parameters(), lr=0.01)
    started = time.perf_counter()
    step.run(optimizer, iter(batches))
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="steps per call to time")
    parser.add_argument("--steps", type=int, default=160, help="batches of one fit (a multiple of every k)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    batches = make_batches(args.steps)
    modules = {"eager": MLP()}
    steps: dict[int, WholeStep] = {}
    compile_s: dict[int, float] = {}
    for k in args.ks:
        modules[k] = MLP()
        steps[k] = WholeStep(
            modules[k], lambda module, batch, outputs: outputs["loss"], PlainPrecision(), steps_per_call=k
        )
        started = time.perf_counter()
        compiled_fit(modules[k], steps[k], batches[: 2 * k] + batches[: 2 * k])  # compiles the call(s) it times
        compile_s[k] = time.perf_counter() - started
    eager_fit(modules["eager"], batches[:8])  # warm
    times: dict[object, list[float]] = {key: [] for key in modules}
    for _ in range(args.repeats):
        times["eager"].append(eager_fit(modules["eager"], batches))
        for k in args.ks:
            times[k].append(compiled_fit(modules[k], steps[k], batches))
    per_step = {key: statistics.median(value) / args.steps * 1e6 for key, value in times.items()}
    print(f"torch {torch.__version__}, 1 thread, fp32; one fit of {args.steps} steps, median of {args.repeats} repeats")
    print(f"{'variant':<8}  {'µs/step':>8}  {'× eager':>8}  {'spread µs/step':>16}  {'compile s':>9}")
    for key, value in per_step.items():
        spread = [t / args.steps * 1e6 for t in times[key]]
        label = "eager" if key == "eager" else f"k = {key}"
        compiled = "" if key == "eager" else f"{compile_s[key]:9.1f}"
        print(
            f"{label:<8}  {value:8.1f}  {per_step['eager'] / value:8.2f}  "
            f"{min(spread):7.1f}–{max(spread):<7.1f}  {compiled}"
        )
    if len(args.ks) >= 2:  # µs/step = a + b/k through the smallest and the largest k
        lo, hi = min(args.ks), max(args.ks)
        b = (per_step[lo] - per_step[hi]) / (1 / lo - 1 / hi)
        a = per_step[hi] - b / hi
        print(
            f"through k = {lo} and k = {hi}, µs/step = a + b/k: a = {a:.1f} µs (the step inside the graph), "
            f"b = {b:.1f} µs (per call); at k = 1 the call costs {b / (a + b):.0%} of a step; as k grows the "
            f"step tends to {per_step['eager'] / a:.2f}× eager"
        )


if __name__ == "__main__":
    main()
