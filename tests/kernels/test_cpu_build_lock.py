"""An interrupted build of the native CPU kernels does not hang every later start (workers/kernels/cpu_extension)."""

import os
import subprocess
import sys

import pytest

from tandem.workers.kernels import cpu_extension

LOAD = "from tandem.workers.kernels import cpu_extension as c; print('loaded', c.available(), c.build_error())"


def test_a_lock_left_by_an_interrupted_build_is_removed_and_the_kernels_load():
    """Ctrl-C during the first build leaves cpp_extension's `lock` file; torch waits on it forever."""
    if not cpu_extension.available():
        pytest.skip(f"the native CPU kernels do not build here: {cpu_extension.build_error()}")
    stale = os.path.join(cpu_extension.build_directory_path(), "lock")
    open(stale, "w").close()
    try:
        done = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONSAFEPATH": "1"})
    finally:
        if os.path.exists(stale):
            os.remove(stale)
            pytest.fail("the stale lock is still there")
    assert "loaded True None" in done.stdout, done.stdout + done.stderr
    assert "left by an interrupted build" in done.stderr


def test_two_checkouts_build_apart():
    """The build files name the sources' folder: a shared build directory was rebuilt by each checkout in turn."""
    tag = cpu_extension._build_tag()
    elsewhere = "/elsewhere/workers/kernels/cpu_extension.py"
    original = cpu_extension.__file__
    try:
        cpu_extension.__file__ = elsewhere
        assert cpu_extension._build_tag() != tag
    finally:
        cpu_extension.__file__ = original
