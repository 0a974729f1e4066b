"""The supervisor's open-file limit at a large world: raised at the monitor's start when the soft
limit is too low, and a one-line error naming the limit when the hard one is. Each case runs in
its own interpreter: a process cannot raise its hard limit again once lowered."""

import subprocess
import sys

START_MONITOR = """
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard}))
from mshpc.errors import LaunchError
from mshpc.launch.monitor import Monitor
try:
    m = Monitor({world}, "tok")
except LaunchError as exc:
    print("LaunchError:", exc)
    sys.exit(2)
print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
m.close()
"""


def start_monitor(world: int, soft: int, hard: int) -> subprocess.CompletedProcess:
    code = START_MONITOR.format(world=world, soft=soft, hard=hard)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_a_low_soft_limit_is_raised_for_the_world():
    run = start_monitor(world=2000, soft=512, hard=4096)
    assert run.returncode == 0, run.stderr
    assert int(run.stdout) >= 2000


def test_a_hard_limit_below_the_world_is_a_one_line_error_naming_ulimit():
    run = start_monitor(world=2000, soft=512, hard=1024)
    assert run.returncode == 2, run.stderr
    message = run.stdout.strip()
    assert "\n" not in message
    assert "1024" in message and "ulimit -n" in message and "2000" in message
