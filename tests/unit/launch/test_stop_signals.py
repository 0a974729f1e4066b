"""SIGTERM and SIGHUP to a supervisor reach its stop request while the block runs, and only then."""

import os
import signal
import time

import pytest

from mshpc.launch.stop_signals import stop_signals_to


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_becomes_a_request_and_the_old_handler_comes_back(signum):
    got = []
    before = signal.getsignal(signum)
    with stop_signals_to(got.append):
        os.kill(os.getpid(), signum)
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)  # Python runs the handler in the main thread, between bytecodes
    assert got == [signum]
    assert signal.getsignal(signum) is before
