"""Where one batch-10 step of the Synthetic MLP (60→128→256→10) goes, eager and with its forward pass and loss
compiled (what ``--trainer.compile_steps`` compiles), one thread: forward + loss, then + zero_grad + backward,
then + the SGD step, each the median over 5 × 2,000 calls.

    python benchmarks/speed/step_parts.py
"""

import statistics
import time

import torch


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(60, 128), torch.nn.ReLU(), torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)
    )
    x, y = torch.randn(10, 60), torch.randint(0, 10, (10,))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)

    def forward(inputs, targets):
        return torch.nn.functional.cross_entropy(net(inputs), targets)

    for name, loss_of in (("eager", forward), ("compiled", torch.compile(forward))):

        def forward_only(loss_of=loss_of):
            return loss_of(x, y)

        def with_backward(loss_of=loss_of):
            loss = loss_of(x, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()

        def whole_step(with_backward=with_backward):
            with_backward()
            optimizer.step()

        parts = [microseconds(fn) for fn in (forward_only, with_backward, whole_step)]
        print(f"{name:9s} forward+loss {parts[0]:6.1f} µs | +zero_grad+backward {parts[1]:6.1f} µs | "
              f"+SGD step {parts[2]:6.1f} µs")  # fmt: skip


def microseconds(fn, calls: int = 2000) -> float:
    """The median time of one call over 5 runs of ``calls`` calls, after 50 warm-up calls."""
    for _ in range(50):
        fn()
    runs = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - started) / calls * 1e6)
    return statistics.median(runs)


if __name__ == "__main__":
    main()
