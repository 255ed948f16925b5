"""The native CPU kernels (csrc/*.cpp): decode attention over the paged KV cache and the GEMV over GGUF
quantized blocks, compiled together into one extension module.

torch's cpp_extension builds it once per machine and checkout (g++ and ninja; about a minute) and caches it under
TORCH_EXTENSIONS_DIR. `available()` says whether that worked; whatever uses a kernel falls back to a torch
path when it did not (no compiler, say), so a worker never fails for want of it.

A build interrupted (Ctrl-C in the first minute of the first `tandem serve`) leaves cpp_extension's `lock` file
behind, and every later load waits on it forever. So builders queue on a lock of our own instead, an flock that
the kernel releases with its holder whatever way it ends: whoever holds it is the only one building, and a `lock`
file found then is an interrupted build's, removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import logging
import os
import platform
import shutil
import threading

log = logging.getLogger(__name__)

# Logged when the build starts; `tandem serve` looks for it in a slow worker's log to say why it is slow.
COMPILING = "compiling the native CPU kernels (once per machine and checkout: about a minute)"
_SOURCES = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "csrc", "*.cpp")))
_lock = threading.Lock()
_module = None
_error: str | None = None


def _build_tag() -> str:
    """-march=native code runs only on CPUs with the build machine's instruction sets: the build directory
    is keyed by them, so a shared home directory across machines never loads a foreign build. It is keyed by
    the sources' folder too: the build files name it, and two checkouts sharing one directory rebuilt it in
    turn, each time the other had started last."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    key = f"{platform.machine()} {flags} {os.path.dirname(os.path.abspath(__file__))}"
    return hashlib.sha1(key.encode()).hexdigest()[:10]


@contextlib.contextmanager
def _building_alone(build_directory: str):
    """Holds the build directory's tandem lock (see the module docstring); removes an interrupted build's
    `lock` file once held."""
    os.makedirs(build_directory, exist_ok=True)
    with open(os.path.join(build_directory, "tandem-build.lock"), "w") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another process is building the native CPU kernels; waiting for it")
            fcntl.flock(held, fcntl.LOCK_EX)
        stale = os.path.join(build_directory, "lock")
        if os.path.exists(stale):
            log.warning("removing %s, left by an interrupted build", stale)
            os.remove(stale)
        yield


def _put_ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH. The pip package installs it beside the interpreter, which is not
    on PATH when a virtualenv's programs are run by their full path (.venv/bin/tandem)."""
    if shutil.which("ninja") is None:
        try:
            import ninja  # a dependency; without it the build fails and says so
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _name() -> str:
    return f"tandem_cpu_kernels_{_build_tag()}"


def build_directory_path() -> str:
    """Where cpp_extension builds (and caches) the extension for this machine and checkout."""
    from torch.utils import cpp_extension

    return cpp_extension._get_build_directory(_name(), verbose=False)


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
                name, build_directory = _name(), build_directory_path()
                built = os.path.exists(os.path.join(build_directory, f"{name}.so"))
                log.info("loading the native CPU kernels" if built else COMPILING)
                with _building_alone(build_directory):
                    _module = cpp_extension.load(
                        name=name,
                        sources=_SOURCES,
                        extra_cflags=["-O3", "-march=native", "-fopenmp"],
                        # libstdc++ named as a shared library: a compiler that links it statically by default
                        # (the GPU image's CXX, /opt/gcc/bin/g++) put a second C++ runtime beside torch's, and
                        # an error message with a number in it then crashed the process.
                        extra_ldflags=["-fopenmp", "-Wl,--no-as-needed", "-l:libstdc++.so.6"],
                        build_directory=build_directory,
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
