"""The native CPU kernels (csrc/*.cpp): decode attention over the paged KV cache and the GEMV over GGUF
quantized blocks, compiled together into one extension module.

torch's cpp_extension builds it once per machine (g++ and ninja; about a minute) and caches it under
TORCH_EXTENSIONS_DIR. `available()` says whether that worked; whatever uses a kernel falls back to a torch
path when it did not (no compiler, say), so a worker never fails for want of it.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import platform
import shutil
import threading

log = logging.getLogger(__name__)

_SOURCES = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "csrc", "*.cpp")))
_lock = threading.Lock()
_module = None
_error: str | None = None


def _cpu_tag() -> str:
    """-march=native code runs only on CPUs with the build machine's instruction sets: the build directory
    is keyed by them, so a shared home directory across machines never loads a foreign build."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    return hashlib.sha1(f"{platform.machine()} {flags}".encode()).hexdigest()[:10]


def _put_ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH. The pip package installs it beside the interpreter, which is not
    on PATH when a virtualenv's programs are run by their full path (.venv/bin/tandem)."""
    if shutil.which("ninja") is None:
        try:
            import ninja  # a dependency; without it the build fails and says so
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def load():
    """The compiled extension module, building it on first use; None (and the reason in `build_error()`)
    when it cannot be built here. Kernels call it on every use: once loaded it returns without the lock."""
    global _module, _error
    if _module is not None:
        return _module
    with _lock:
        if _module is None and _error is None:
            try:
                from torch.utils import cpp_extension

                _put_ninja_on_path()
                log.info("loading the native CPU kernels (compiled on their first use on a machine)")
                _module = cpp_extension.load(
                    name=f"tandem_cpu_kernels_{_cpu_tag()}",
                    sources=_SOURCES,
                    extra_cflags=["-O3", "-march=native", "-fopenmp"],
                    extra_ldflags=["-fopenmp"],
                    verbose=False,
                )
            except Exception as exc:  # no compiler, no ninja, a build error: the torch paths still work
                last_line = (str(exc).strip().splitlines() or [""])[-1]  # a compiler error's last line says most
                _error = f"{type(exc).__name__}: {last_line}"
                log.warning("native CPU kernels unavailable, using the torch paths (%s)", _error)
        return _module


def available() -> bool:
    return load() is not None


def build_error() -> str | None:
    return _error
