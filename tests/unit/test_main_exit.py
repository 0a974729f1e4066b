"""`python -m mshpc` ends without the interpreter's teardown, and loses nothing by it: the exit
code, buffered output and atexit handlers all come through; a running non-daemon thread is
waited for, as a normal exit would, and a daemon thread still inside torch does not abort it."""

import subprocess
import sys

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
