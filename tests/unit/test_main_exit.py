"""`python -m mshpc` ends without the interpreter's teardown, and loses nothing by it: the exit
code, buffered output and atexit handlers all come through; a running non-daemon thread is
waited for, as a normal exit would."""

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


def test_the_cli_exits_with_its_code_through_it():
    out = subprocess.run([sys.executable, "-m", "mshpc", "ckpt", "verify", "/nonexistent/ckpt"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert out.stderr.startswith("mshpc: error:"), out.stderr
