"""What a run prints: the metrics its round lines and summary show."""

import io

from fedlight.engine.console import RunConsole

# The last round of a LADD row with clusters: the routed scores are the ones the paper reports.
LADD_ROUND = {
    "train/loss": 0.75,
    "test/acc": 0.8,
    "test/miou": 0.3125,
    "test/routed/acc": 0.85,
    "test/routed/miou": 0.4375,
    "clients/miou": 0.25,
    "clients/routed/miou": 0.375,
    "test/iou_road": 0.5,
    "round/time_s": 2.0,
}


def test_round_lines_and_summary_show_the_routed_miou_of_a_clustered_run():
    out = io.StringIO()
    console = RunConsole(enabled=True, progress_bar=False, out=out)
    console.round_end(0, 1, LADD_ROUND)
    console.end(LADD_ROUND, run_dir=None, rounds_run=1)
    round_line, _, summary = out.getvalue().splitlines()
    for line in (round_line, summary):
        assert "test/routed/miou 0.4375" in line and "clients/routed/miou 0.375" in line
        assert "test/miou 0.3125" in line  # the global model's score stays beside the routed one
        assert "iou_road" not in line  # per-class scores go to the loggers, not the console


def test_a_run_without_routing_shows_no_routed_metrics():
    out = io.StringIO()
    plain = {key: value for key, value in LADD_ROUND.items() if "/routed/" not in key}
    RunConsole(enabled=True, progress_bar=False, out=out).round_end(0, 1, plain)
    assert "routed" not in out.getvalue() and "test/miou 0.3125" in out.getvalue()


def test_a_pseudo_terminal_without_a_size_gets_plain_lines_and_one_with_a_size_gets_bars():
    import fcntl
    import os
    import struct
    import termios

    from fedlight.engine.console import drawable

    leader, follower = os.openpty()  # a new pseudo-terminal reports 0 rows and 0 columns, as `script` gives one
    try:
        with open(follower, "w", closefd=False) as stream:
            assert stream.isatty() and os.get_terminal_size(follower).columns == 0
            assert not drawable(stream)
            fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
            assert drawable(stream)
    finally:
        os.close(leader)
        os.close(follower)
    assert not drawable(io.StringIO())


def test_a_private_run_s_round_line_ends_with_its_epsilon_so_far():
    out = io.StringIO()
    metrics = {"train/loss": 0.5, "test/acc": 0.75, "dp/epsilon": 1.234, "dp/noise_multiplier": 1.1}
    RunConsole(enabled=True, progress_bar=False, out=out).round_end(0, 1, metrics)
    assert out.getvalue().split("  ")[:3] == ["round 1/1", "train/loss 0.5", "test/acc 0.75"]
    assert "dp/epsilon 1.234" in out.getvalue() and "noise_multiplier" not in out.getvalue()
