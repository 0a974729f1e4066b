"""`python -m mshpc` ends without the interpreter's teardown, and loses nothing by it: the exit
code, buffered output and atexit handlers all come through; a running non-daemon thread is
waited for, as a normal exit would, and a daemon thread still inside torch does not abort it."""

import subprocess
import sys

from mshpc.__main__ import exit_code

PRELUDE = "import atexit, sys, threading, time\nfrom mshpc.__main__ import exit_without_teardown\n"


def _run(body: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PRELUDE + body], capture_output=True, text=True, timeout=60)


def test_code_buffered_output_and_atexit_handlers_come_through():
    out = _run("atexit.register(lambda: print('handler ran', file=sys.stderr))\n"
               "sys.stdout.write('no newline, still buffered')\n"
               "exit_without_teardown(3)\n")
    assert out.returncode == 3
    assert out.stdout == "no newline, still buffered"
    assert out.stderr == "handler ran\n"


def test_a_running_non_daemon_thread_is_waited_for():
    out = _run("threading.Thread(target=lambda: (time.sleep(0.5), print('thread done'))).start()\n"
               "exit_without_teardown(0)\n")
    assert out.returncode == 0
    assert out.stdout == "thread done\n"


def test_a_daemon_thread_inside_a_gloo_collective_does_not_abort_the_exit():
    # a checkpoint's background save in a collective while its rank exits on an error: torn down
    # under it, the process aborted ("terminate called without an active exception", code 134)
    # whenever a non-daemon thread (the save's checksum executor) made the exit a full teardown
    out = _run("import torch, torch.distributed as dist\n"
               "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
               "def spin():\n"
               "    t = torch.zeros(1000)\n"
               "    while True:\n"
               "        dist.all_reduce(t)\n"
               "threading.Thread(target=spin, daemon=True).start()\n"
               "threading.Thread(target=lambda: (time.sleep(0.5), print('thread done'))).start()\n"
               "time.sleep(0.2)\n"
               "exit_without_teardown(2)\n")
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stdout == "thread done\n"


def test_an_idle_executor_does_not_hold_the_exit():
    # its worker is non-daemon and waits for work: threading's shutdown stops it, as sys.exit does
    out = _run("from concurrent.futures import ThreadPoolExecutor\n"
               "pool = ThreadPoolExecutor(1)\n"
               "print(pool.submit(lambda: 'worked').result())\n"
               "exit_without_teardown(4)\n")
    assert out.returncode == 4, out.stderr[-2000:]
    assert out.stdout == "worked\n"


def test_the_cli_exits_with_its_code_through_it():
    out = subprocess.run([sys.executable, "-m", "mshpc", "ckpt", "verify", "/nonexistent/ckpt"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert out.stderr.startswith("mshpc: error:"), out.stderr


def test_a_system_exit_from_the_cli_keeps_its_code_and_skips_the_teardown():
    # a rank stopped on request ends with JobStopped, a SystemExit: the teardown cost its stop a
    # second. A module-level object's __del__ runs in the teardown only; argparse's exit is real
    keep = "class Torn:\n    def __del__(self):\n        print('torn down')\nkept = Torn()\n"
    out = _run(keep + "from mshpc.__main__ import run_cli\nrun_cli(['no-such-command'])\n")
    assert out.returncode == 2 and "invalid choice: 'no-such-command'" in out.stderr
    assert "torn down" not in out.stdout
    out = _run(keep + "from mshpc.__main__ import run_cli\nrun_cli(['--help'])\n")
    assert out.returncode == 0 and out.stdout.startswith("usage:") and "torn down" not in out.stdout
    assert "torn down" in _run(keep + "sys.exit(0)\n").stdout  # what the teardown would have done


def test_the_exit_status_follows_pythons_rule():
    assert [exit_code(SystemExit(c)) for c in (None, 0, 3, 143)] == [0, 0, 3, 143]
    assert exit_code(SystemExit("a message")) == 1  # printed to stderr, as Python does


def test_dalis_teardown_handler_is_skipped():
    # its full gc.collect() (0.1-0.2 s a rank) only prepares an unloading that os._exit never does
    watch = ("import gc, nvidia.dali.backend\ngc.disable()\n"
             "gc.callbacks.append(lambda phase, info: phase == 'start' and print('collected', flush=True))\n")
    out = _run(watch + "exit_without_teardown(0)\n")
    assert out.returncode == 0 and out.stdout == "", out.stderr[-2000:]
    assert _run(watch + "atexit._run_exitfuncs()\n").stdout == "collected\n"  # DALI's handler, run
