"""`tandem serve`: the whole stack on one machine — a router in front of prefill and decode workers.

Each part is its own process, started as the `tandem` command, exactly as on Kubernetes; this
module only launches, waits for readiness, prints where to connect, starts a worker that exits
again, and stops everything on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from tandem.cli_args import options_to_args
from tandem.config import API_KEY_ENV, EngineConfig
from tandem.launcher import ServiceProcess

RESTART_GRACE_S = 30.0  # a worker that exits again this soon after a restart is failing, not unlucky


def supervise(router: ServiceProcess, workers: list[ServiceProcess]) -> int:
    """Keeps the stack up as Kubernetes keeps a deployment up: a worker that exits is started again on its
    port (the router serves its requests elsewhere meanwhile and takes it back once it is ready). A router that
    exits, or a worker that exits again within RESTART_GRACE_S of its restart, ends the stack."""
    restarted_at: dict[str, float] = {}
    while True:
        if router.proc.poll() is not None:
            print(f"router exited with {router.proc.returncode}:\n{router.log_tail()}", file=sys.stderr)
            return 1
        for worker in workers:
            if worker.proc.poll() is None:
                continue
            print(f"{worker.name} exited with {worker.proc.returncode}:\n{worker.log_tail(1500)}", file=sys.stderr)
            if time.monotonic() - restarted_at.get(worker.name, -RESTART_GRACE_S) < RESTART_GRACE_S:
                print(f"{worker.name} keeps exiting; stopping", file=sys.stderr)
                return 1
            print(f"restarting {worker.name} on {worker.url}", file=sys.stderr, flush=True)
            worker.start()
            restarted_at[worker.name] = time.monotonic()
        time.sleep(0.5)


def run_local_stack(engine: EngineConfig, *, prefill: int, decode: int, colocated: bool, disagg_min_tokens: int,
                    host: str, port: int, api_key: str | None = None) -> int:
    worker_args = options_to_args(engine)
    roles = ["both"] * decode if colocated else ["prefill"] * prefill + ["decode"] * decode
    workers = [ServiceProcess(["worker", "--role", role, *worker_args], name=f"{role}-{i}")
               for i, role in enumerate(roles)]
    prefill_urls = [w.url for w, r in zip(workers, roles) if r == "prefill"]
    decode_urls = [w.url for w, r in zip(workers, roles) if r != "prefill"]
    router_args = ["router", "--model", engine.model, "--host", host, "--disagg-min-tokens", str(disagg_min_tokens),
                   "--block-size", str(engine.block_size), "--decode", *decode_urls]
    if prefill_urls:
        router_args += ["--prefill", *prefill_urls]
    if engine.served_model_name:
        router_args += ["--served-model-name", engine.served_model_name]
    # The key travels in the environment, not on the router's command line where `ps` would show it.
    router = ServiceProcess(router_args, port=port, name="router", env={API_KEY_ENV: api_key} if api_key else None)
    auth = " -H 'authorization: Bearer <your key>'" if api_key or os.environ.get(API_KEY_ENV) else ""
    everything = [*workers, router]

    def stop(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        print(f"starting {len(workers)} worker(s): {', '.join(roles)} (logs: {workers[0].log.name} ...)", flush=True)
        for w in workers:
            w.start()
        for w in workers:
            w.wait_ready()
        router.start().wait_ready()
        url = f"http://{host}:{port}"
        print(f"\ntandem serve: {len(prefill_urls)} prefill + {len(decode_urls)} decode worker(s), router on {url}")
        print(f"  curl -s {url}/v1/chat/completions -H 'content-type: application/json'{auth} \\\n"
              f"    -d '{{\"model\": \"{engine.served_model_name or engine.model}\", \"messages\": "
              f"[{{\"role\": \"user\", \"content\": \"Hello!\"}}], \"max_tokens\": 32}}'")
        print("Ctrl-C stops everything.", flush=True)
        return supervise(router, workers)
    except KeyboardInterrupt:
        print("\nstopping ...", flush=True)
        return 0
    finally:
        for proc in reversed(everything):
            proc.stop()
