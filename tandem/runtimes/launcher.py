"""Start, watch and stop Tandem processes on this machine (local stack, tests, benchmarks)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import httpx


def _die_with_parent() -> None:
    """Runs in the child before exec: if the launching process dies (a killed test run, a crashed
    `tandem serve`), the kernel sends the child SIGTERM, so no worker outlives its launcher."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except OSError:  # not Linux: nothing to arrange
        pass


def _ephemeral_ports() -> tuple[int, int]:
    """The range the kernel draws outgoing connections' local ports from."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
            return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


_handed_out: set[int] = set()


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now, for a child process to bind a few seconds later.

    It is drawn below the ephemeral range: a port from that range (what binding port 0 returns) can be taken
    in between by any outgoing connection of any process, and a worker that loads a model for seconds before
    it binds lost that race now and then ("address already in use")."""
    low, _ = _ephemeral_ports()
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randint(max(1024, low - 12_000), low - 1)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:  # the range below is crowded: fall back on the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    """Whether a server (uvicorn) could not listen there. With SO_REUSEADDR, as uvicorn binds: a port whose last
    connections are still in TIME_WAIT (a stack just stopped) is free for a listener."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror:
        return False  # the router will say what is wrong with the host
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError:
            return True
    return False


def is_routine(line: str) -> bool:
    """A log line that never explains why a process ended: httpx's INFO line per request made (a worker logs one per
    call to a peer; a crashed one's last dozen lines were all of them), in the format `tandem`'s logging has."""
    return "INFO httpx:" in line and " HTTP Request: " in line  # with or without a request ID between


class ServiceProcess:
    """One `tandem <command>` child process listening on <host>:<port> (127.0.0.1 unless `host` says otherwise), its
    output in a log file."""

    def __init__(self, args: list[str], port: int | None = None, name: str | None = None, env: dict | None = None,
                 host: str | None = None):
        self.port = port or free_port()
        self.host = host or "127.0.0.1"
        self.args = [*args, "--port", str(self.port), *(["--host", host] if host else [])]
        self.name = name or args[0]
        self.env = {**os.environ, "PYTHONSAFEPATH": "1", **(env or {})}
        self.log = self._new_log()
        self.proc: subprocess.Popen | None = None
        self._log_start = 0  # where this start's output begins in the log (a restart appends to it)
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _new_log(self):
        return tempfile.NamedTemporaryFile(prefix=f"tandem-{self.name}-", suffix=".log", delete=False)

    def start(self) -> ServiceProcess:
        if self.log.closed:  # removed after a clean stop: this start gets a new one
            self.log, self.starts = self._new_log(), 0
        self.starts += 1
        self._log_start = os.path.getsize(self.log.name)
        self.proc = subprocess.Popen([sys.executable, "-m", "tandem.cli", *self.args], stdout=self.log,
                                     stderr=subprocess.STDOUT, env=self.env, start_new_session=True,
                                     preexec_fn=_die_with_parent)
        return self

    def log_tail(self, chars: int = 4000) -> str:
        """The end of what the latest start wrote, without its routine lines (`is_routine`): a crash's reason stays
        in view behind a worker's one line per peer call."""
        if self.log.closed:
            return "(its log was removed when it stopped: cleanly, or before it started)"
        size = os.path.getsize(self.log.name)
        # 4: UTF-8's widest; 16: room for the routine lines dropped below.
        start = max(self._log_start, size - 4 * 16 * chars)
        with open(self.log.name, "rb") as f:
            f.seek(start)
            lines = f.read().decode(errors="replace").splitlines(keepends=True)
        if start > self._log_start and len(lines) > 1:  # the window began mid-line
            lines = lines[1:]
        text = "".join(line for line in lines if not is_routine(line))
        if len(text) <= chars:
            return text
        text = text[-chars:]
        newline = text.find("\n")
        if 0 <= newline < len(text) - 1:  # from the first whole line, unless the last line is all there is
            text = text[newline + 1:]
        return text

    def is_ready(self, path: str = "/ready", timeout_s: float = 2.0) -> bool:
        """Whether GET `path` answers 200 within `timeout_s`."""
        try:
            return httpx.get(self.url + path, timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout: float = 180.0, path: str = "/ready",
                   notice: tuple[float, Callable[[], str]] | None = None) -> ServiceProcess:
        """Until GET `path` answers 200. `notice`: (seconds, what to print) once if it takes that long; the text is
        asked for then, so that it can say what the process is doing by that time."""
        started = time.monotonic()
        deadline = started + timeout
        while time.monotonic() < deadline:
            if notice is not None and time.monotonic() - started > notice[0]:
                print(notice[1](), flush=True)
                notice = None
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self.is_ready(path):
                return self
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} not ready after {timeout}s:\n{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL, as a crash would: no drain, no goodbye."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM to the process's group: what it started goes too (a worker's compiler, mid-build, would go on
        writing the build directory the next start builds in). The log of a process that never started, or started once
        and stopped cleanly, goes too: it says nothing anyone needs, and /tmp filled up with them. One that exited
        by itself, was restarted, or had to be killed keeps its log (the paths printed about them stay true)."""
        if self.proc is None:  # never started (a start that failed or was interrupted first): its log is empty
            self._remove_log()
            return None
        if self.proc.poll() is not None:
            return self.proc.returncode
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:  # gone meanwhile
            pass
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None
        if self.starts == 1 and code in (0, -signal.SIGTERM):
            self._remove_log()
        return code

    def _remove_log(self) -> None:
        self.log.close()
        with contextlib.suppress(OSError):
            os.unlink(self.log.name)

    def __enter__(self) -> ServiceProcess:
        return self.start().wait_ready()

    def __exit__(self, *exc) -> None:
        self.stop()
