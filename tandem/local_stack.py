"""`tandem serve`: the whole stack on one machine — a router in front of prefill and decode workers.

Each part is its own process, started as the `tandem` command, exactly as on Kubernetes; this
module only launches, waits for readiness, prints where to connect, and stops everything on
Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from tandem.cli_args import options_to_args
from tandem.config import API_KEY_ENV, EngineConfig
from tandem.launcher import ServiceProcess


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
        while True:
            for proc in everything:
                if proc.proc.poll() is not None:
                    print(f"{proc.name} exited with {proc.proc.returncode}:\n{proc.log_tail()}", file=sys.stderr)
                    return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("\nstopping ...", flush=True)
        return 0
    finally:
        for proc in reversed(everything):
            proc.stop()
