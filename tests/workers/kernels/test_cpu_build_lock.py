"""Building the native CPU kernels (workers/kernels/cpu_extension): an interrupted build does not hang every later
start, and the module shares torch's C++ runtime whatever the compiler's default.

Both are checked on one build of the kernels, in a process of its own with a build directory of its own: in the
shared one, any other process loading the kernels meanwhile (another pytest-xdist worker) would remove the planted
lock first."""

import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tandem.workers.kernels import cpu_extension

BUILD_AND_CALL = """
import torch
from tandem.workers.kernels import cpu_extension as c
module = c.load()
print('build error:', c.build_error())
try:
    module.gguf_linear(torch.randn(1, 48), torch.zeros(16, 30, dtype=torch.uint8), 3)
except RuntimeError as exc:
    print('raised:', exc)
"""


@pytest.fixture(scope="module")
def private_build(tmp_path_factory) -> SimpleNamespace:
    """One build in a fresh TORCH_EXTENSIONS_DIR, by a compiler that links libstdc++ statically by default (as
    the GPU image's CXX, /opt/gcc/bin/g++, does), over the `lock` file that an interrupted build leaves."""
    if shutil.which("g++") is None:
        pytest.skip("no g++ here: the CPU kernels cannot be built")
    tmp = tmp_path_factory.mktemp("cpu-build")
    compiler = tmp / "g++-static-runtime"
    compiler.write_text('#!/bin/sh\nexec g++ -static-libstdc++ "$@"\n')
    compiler.chmod(0o755)
    build_directory = tmp / "extensions" / cpu_extension._name()
    build_directory.mkdir(parents=True)
    (build_directory / "lock").touch()
    done = subprocess.run([sys.executable, "-c", BUILD_AND_CALL], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONSAFEPATH": "1", "CXX": str(compiler),
                               "TORCH_EXTENSIONS_DIR": str(tmp / "extensions")})
    assert "build error: None" in done.stdout, done.stdout + done.stderr[-3000:]
    return SimpleNamespace(stdout=done.stdout, stderr=done.stderr, lock_left=(build_directory / "lock").exists())


def test_a_lock_left_by_an_interrupted_build_is_removed_and_the_kernels_load(private_build):
    """Ctrl-C during the first build leaves cpp_extension's `lock` file; torch waited on it forever."""
    assert not private_build.lock_left
    assert "left by an interrupted build" in private_build.stderr


def test_a_compiler_that_links_the_cxx_runtime_statically_still_builds_a_module_that_shares_torchs(private_build):
    """With its own copy of libstdc++ beside torch's, the module's error messages with a number in them came out
    cut short here ("K (") and crashed the process on the GPU image (a segmentation fault). The build names the
    shared libstdc++ itself. (The arguments are checked before the CPU's AVX-512, so the message is the same on
    every machine.)"""
    assert "raised: K (48) must be a multiple of 32" in private_build.stdout, private_build.stdout


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
