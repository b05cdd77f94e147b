"""The limits of the tests' child processes follow their work (``tests/processes.py``)."""

import subprocess
import sys

import pytest
from processes import communicate_within, run_within

BURN = "import time\nend = time.process_time() + {s}\nwhile time.process_time() < end: pass\nprint('done')"


def test_a_process_that_finishes_within_its_budget_gives_its_output():
    done = run_within([sys.executable, "-c", BURN.format(s=0.2)], cpu_budget=60, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout == "done\n"


def test_work_past_the_budget_is_stopped_even_in_a_grandchild():
    # the child only waits; its own child works: the tree's CPU time is what counts
    nested = f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {BURN.format(s=30)!r}])"
    process = subprocess.Popen([sys.executable, "-c", nested], stdout=subprocess.PIPE, text=True)
    with pytest.raises(subprocess.TimeoutExpired) as stopped:
        communicate_within(process, cpu_budget=2.0)
    assert stopped.value.output.startswith("used ") and "CPU s (budget 2)" in stopped.value.output
    assert process.poll() is not None


def test_a_process_that_uses_no_cpu_is_taken_for_hung():
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    with pytest.raises(subprocess.TimeoutExpired) as stopped:
        communicate_within(process, cpu_budget=600, stall=4.0)
    assert stopped.value.output.startswith("used no CPU for 4 s")
