"""What a vectorised client step costs on this machine: workload (a)'s MLP, stacks of K clients, one thread.

The vectorised path (``--trainer.client_batching`` with ``compile_batched``) trains a stack of K clients with one
``vmap``'d step; with the optimizer's update in the graph and ``steps_per_call`` k it runs k such steps per call
(``fedlight/engine/stacked.py``). Here :class:`fedlight.engine.batched.BatchedLocalFit` trains K clients of the (a)
MLP (60→128→256→10, batch 10, SGD lr 0.01) on ``--steps`` full batches each, so the stack stays whole, and the time
is given per client step (a stacked step's time / K), beside the plain eager step of one client (the floor's) and
fedlight's compiled whole step of one client at the same k. Variants alternate over the repeats; figures are
medians. Where the time per client step of a stack does not fall below one client's compiled step, stacking
clients buys nothing more than compiling already did: the stacked step's own work grows with K.

    python benchmarks/speed/stacked_steps.py                     # K = 1 2 10, k = 1 8, 80 steps, 3 repeats
    python benchmarks/speed/stacked_steps.py --stacks 2 --ks 1 8 --steps 40 --repeats 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402
from steps_per_call import MLP, eager_fit, make_batches  # noqa: E402

from fedlight.engine.batched import BatchedLocalFit  # noqa: E402
from fedlight.engine.stacked import optimizer_factory  # noqa: E402
from fedlight.engine.whole_step import WholeStep  # noqa: E402
from fedlight.state import FlatState  # noqa: E402
from fedlight.testing import PlainPrecision  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stacks", type=int, nargs="+", default=[1, 2, 10], help="clients per stack, K")
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 8], help="steps per compiled call, k")
    parser.add_argument("--steps", type=int, default=80, help="full batches per client")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    module = MLP()
    layout = FlatState(module)
    make_optimizer = optimizer_factory(torch.optim.SGD(module.parameters(), lr=0.01))
    batches = make_batches(args.steps)
    start = layout.flatten(module).clone()

    variants, compile_s = {"eager, one client": None}, {}
    for k in args.ks:
        variants[f"whole step, one client, k = {k}"] = ("whole", k)
        for stack in args.stacks:
            variants[f"stack of {stack}, k = {k}"] = ("stack", stack, k)
    runners = {}
    for name, spec in variants.items():
        if spec is None:
            runners[name] = lambda: eager_fit(module, batches) / len(batches)
            continue
        started = time.perf_counter()
        if spec[0] == "whole":
            loss_fn = lambda m, batch, outputs: outputs["loss"]  # noqa: E731
            step = WholeStep(module, loss_fn, PlainPrecision(), steps_per_call=spec[1])

            def whole(step=step):
                layout.load(module, start)
                began = time.perf_counter()
                step.run(torch.optim.SGD(module.parameters(), lr=0.01), batches)
                return (time.perf_counter() - began) / len(batches)

            whole()
            runners[name] = whole
        else:
            _, stack, k = spec
            fit = BatchedLocalFit(module, layout, PlainPrecision(), compile=True, whole_step=True, steps_per_call=k)

            def stacked(fit=fit, stack=stack):
                began = time.perf_counter()
                fit.run([start] * stack, [batches] * stack, make_optimizer)
                return (time.perf_counter() - began) / (len(batches) * stack)

            stacked()
            runners[name] = stacked
        compile_s[name] = time.perf_counter() - started
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(args.repeats):
        for name, runner in runners.items():
            times[name].append(runner())
    eager = statistics.median(times["eager, one client"])
    setting = f"{args.steps} steps per client, {args.repeats} repeats, 1 thread, torch {torch.__version__}"
    print(f"(a) MLP, batch 10, {setting}")
    print(f"{'variant':34s} {'µs per client step':>19s} {'spread':>17s} {'× eager':>8s} {'first call s':>13s}")
    for name, values in times.items():
        median = statistics.median(values)
        spread = f"{min(values) * 1e6:.1f}–{max(values) * 1e6:.1f}"
        first = f"{compile_s[name]:.1f}" if name in compile_s else "–"
        print(f"{name:34s} {median * 1e6:19.1f} {spread:>17s} {eager / median:8.2f} {first:>13s}")


if __name__ == "__main__":
    main()
