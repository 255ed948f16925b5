"""`tandem serve`: the whole stack on one machine — a router in front of prefill and decode workers.

Each part is its own process, started as the `tandem` command, exactly as on Kubernetes; this
module only launches, waits for readiness, prints where to connect, starts a process that exits
again, and stops everything on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
import time

from tandem.cli.args import options_to_args
from tandem.config import API_KEY_ENV, EngineConfig, RouterConfig
from tandem.model_source import default_served_name
from tandem.runtimes.launcher import ServiceProcess, port_in_use
from tandem.server.internal_auth import INTERNAL_TOKEN_ENV

RESTART_GRACE_S = 30.0  # a process that exits again this soon after its start is crash-looping
MAX_BACKOFF_S = 30.0


class Supervisor:
    """Keeps the stack up as Kubernetes keeps a deployment up: a process (worker or router) that exits is started
    again on its port; the router serves a worker's requests on the pool's other workers meanwhile (none: 503)
    and takes it back once it is ready. One that keeps exiting soon after its start is restarted after a
    doubling delay, up to MAX_BACKOFF_S (Kubernetes' CrashLoopBackOff): the rest of the stack goes on. A restarted
    process is said to be back once it answers its readiness probe."""

    def __init__(self, processes: list[ServiceProcess], now: float):
        self.processes = processes
        self.started_at = {p.name: now for p in processes}
        self.quick_exits = dict.fromkeys(self.started_at, 0)
        self.due: dict[str, float] = {}  # name -> when its restart is due
        self.restarted: set[str] = set()  # started again, not ready yet: its being back is said once it is

    def check(self, now: float) -> None:
        for process in self.processes:
            if process.name in self.due:
                if now >= self.due[process.name]:
                    del self.due[process.name]
                    print(f"restarting {process.name} on {process.url}", file=sys.stderr, flush=True)
                    process.start()
                    self.started_at[process.name] = now
                    self.restarted.add(process.name)
                continue
            if process.proc.poll() is None:
                # A short wait: the loop also watches the other processes, and a restarted one may hang.
                if process.name in self.restarted and process.is_ready(timeout_s=0.5):
                    self.restarted.discard(process.name)
                    print(f"{process.name} is serving again on {process.url}", file=sys.stderr, flush=True)
                continue
            self.restarted.discard(process.name)
            self._schedule_restart(process, now)

    def _schedule_restart(self, process: ServiceProcess, now: float) -> None:
        """Says how it ended (the end of its log the first time) and when it is started again."""
        quick = now - self.started_at[process.name] < RESTART_GRACE_S
        self.quick_exits[process.name] = self.quick_exits[process.name] + 1 if quick else 0
        quick_exits = self.quick_exits[process.name]
        delay = min(MAX_BACKOFF_S, 2.0 ** min(quick_exits, 10) - 1)
        tail = process.log_tail(1500) if quick_exits <= 1 else "(as before)"
        print(f"{process.name} {how_it_ended(process.proc.returncode)}:\n{tail}", file=sys.stderr)
        # One exit soon after a start is a crash, not yet a loop: "keeps exiting" waits for a second one.
        if quick_exits > 1:
            print(f"{process.name} keeps exiting; next try in {delay:.0f} s (its log: {process.log.name})",
                  file=sys.stderr, flush=True)
        elif delay:
            print(f"{process.name} will be restarted in {delay:.0f} s (its log: {process.log.name})",
                  file=sys.stderr, flush=True)
        self.due[process.name] = now + delay


def supervise(processes: list[ServiceProcess]) -> int:
    """Supervisor.check twice a second; returns only through Ctrl-C or SIGTERM (KeyboardInterrupt)."""
    supervisor = Supervisor(processes, time.monotonic())
    while True:
        supervisor.check(time.monotonic())
        time.sleep(0.5)


def how_it_ended(returncode: int) -> str:
    """"exited with 1", or "was killed by SIGKILL" for a process a signal ended (Popen's returncode -9)."""
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            pass
    return f"exited with {returncode}"


def start_failure(exc: Exception, process: ServiceProcess) -> str:
    """What a newcomer needs of a process that did not start: its last lines, and where the rest is."""
    lines = [line for line in process.log_tail().splitlines() if line.strip()]
    how = "was not ready in time" if isinstance(exc, TimeoutError) else how_it_ended(process.proc.returncode)
    return f"{process.name} did not start: it {how}; the end of its log, {process.log.name}:\n  " + \
        "\n  ".join(lines[-6:])


def slow_start_notice(workers: list[ServiceProcess], everything: list[ServiceProcess]) -> str:
    """What `tandem serve` says when the stack takes long to start (once, at 15 s): why, as the workers' logs tell
    it so far. The compile line stays in a log's tail after the build: at 15 s, a build just done still explains
    the wait."""
    # The workers' own line, imported here: the core imports no component at module level.
    from tandem.workers.kernels.cpu_extension import COMPILING

    logs = ", ".join(p.log.name for p in everything)
    if any(COMPILING in w.log_tail() for w in workers):
        return f"  still starting: the workers are {COMPILING}; logs: {logs}"
    return f"  still starting: the workers are loading the model; logs: {logs}"


ROUTER_GRACE_S = RouterConfig.model_fields["graceful_shutdown_s"].default


def stop_all(router: ServiceProcess, workers: list[ServiceProcess]) -> None:
    """The router first, while the workers still serve the requests it lets finish (its graceful shutdown), then
    the workers. Ctrl-C meanwhile stops everything at once."""
    try:
        router.stop(timeout=ROUTER_GRACE_S + 5)
        for worker in workers:
            worker.stop()
    except KeyboardInterrupt:
        for process in (router, *workers):
            process.kill()
        print("stopped at once: requests still in flight were cut off", flush=True)


def run_local_stack(engine: EngineConfig, *, prefill: int, decode: int, colocated: bool, disagg_min_tokens: int,
                    host: str, port: int, api_key: str | None = None, worker_return_wait_s: float | None = None,
                    admission: str = "slo", tensor_parallel: dict[str, int | None] | None = None) -> int:
    try:  # a model that is not there is said now, not in a worker's traceback after the others have loaded it
        default_name = default_served_name(engine.model)
    except ValueError as exc:
        print(f"tandem serve: {exc}", file=sys.stderr)
        return 2
    # Said now, not after the workers have loaded their models; and before any process (and its log file) exists.
    if port_in_use(host, port):
        print(f"tandem serve: port {port} on {host} is in use (another tandem serve?); stop it, or choose another "
              "port, e.g. --port 9000 (with make: make serve ARGS=\"--port 9000\")", file=sys.stderr)
        return 2
    roles = ["both"] * decode if colocated else ["prefill"] * prefill + ["decode"] * decode
    # The internal endpoints' shared secret (tandem.server.internal_auth), one per stack unless the caller set one.
    internal = {INTERNAL_TOKEN_ENV: os.environ.get(INTERNAL_TOKEN_ENV) or secrets.token_urlsafe(32)}
    sizes = tensor_parallel or {}
    workers = [ServiceProcess(["worker", "--role", role, *options_to_args(engine.model_copy(update={
        "tensor_parallel_size": sizes.get("decode" if role == "both" else role) or engine.tensor_parallel_size}))],
        name=f"{role}-{i}", env=internal) for i, role in enumerate(roles)]
    prefill_urls = [w.url for w, r in zip(workers, roles) if r == "prefill"]
    decode_urls = [w.url for w, r in zip(workers, roles) if r != "prefill"]
    router_args = ["router", "--model", engine.model, "--host", host, "--disagg-min-tokens", str(disagg_min_tokens),
                   "--block-size", str(engine.block_size), "--decode", *decode_urls]
    if prefill_urls:
        router_args += ["--prefill", *prefill_urls]
    if engine.served_model_name:
        router_args += ["--served-model-name", engine.served_model_name]
    if engine.tool_call_parser:  # the router forms the answers, so it is the one that reads their calls
        router_args += ["--tool-call-parser", engine.tool_call_parser]
    if worker_return_wait_s is not None:
        router_args += ["--worker-return-wait-s", str(worker_return_wait_s)]
    if admission != "slo":
        router_args += ["--admission", admission]
    # The key travels in the environment, not on the router's command line where `ps` would show it.
    router = ServiceProcess(router_args, port=port, name="router",
                            env={**internal, **({API_KEY_ENV: api_key} if api_key else {})})
    auth = " -H 'authorization: Bearer <your key>'" if api_key or os.environ.get(API_KEY_ENV) else ""
    everything = [*workers, router]

    def stop(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    slow = (15.0, lambda: slow_start_notice(workers, everything))
    try:
        print(f"starting {len(workers)} worker(s): {', '.join(roles)}", flush=True)
        for w in workers:
            w.start()
        for process in everything:
            try:
                if process is router:
                    router.start()
                process.wait_ready(notice=slow)
                slow = None  # said once
            except (RuntimeError, TimeoutError) as exc:
                print(start_failure(exc, process), file=sys.stderr)
                return 1
        url = f"http://{host}:{port}"
        shape = f"{len(decode_urls)} colocated worker(s)" if colocated else \
            f"{len(prefill_urls)} prefill + {len(decode_urls)} decode worker(s)"
        print(f"\ntandem serve: {shape}, router on {url}")
        print(f"  curl -s {url}/v1/chat/completions -H 'content-type: application/json'{auth} \\\n"
              f"    -d '{{\"model\": \"{engine.served_model_name or default_name}\", \"messages\": "
              f"[{{\"role\": \"user\", \"content\": \"Hello!\"}}], \"max_tokens\": 32}}'")
        print("Ctrl-C stops everything.", flush=True)
        return supervise(everything)
    except KeyboardInterrupt:
        print(f"\nstopping: requests in flight get up to {ROUTER_GRACE_S:g} s to finish (Ctrl-C again stops at once) "
              "...", flush=True)
        return 0
    finally:
        stop_all(router, workers)
