"""Another user of the node, for the tests of what a hostile but fair neighbour can do (issue
#43): the tests run as root and drop to `nobody` with setpriv; they skip, saying why, when not
root (or when setpriv is missing)."""

import os
import shutil
import subprocess
import sys

import pytest

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                reason="acting as another user (nobody) needs root and setpriv")


def as_nobody(*argv: str) -> list[str]:
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv]


def nobody_python(code: str, **kwargs) -> subprocess.Popen:
    """`code` run by this interpreter as `nobody`, started now; its stdout a pipe (text)."""
    return subprocess.Popen(as_nobody(sys.executable, "-c", code), stdout=subprocess.PIPE, text=True, **kwargs)
