"""What Ray Serve adds in front of the router (tandem.runtimes.ray_serve): latency through Serve's HTTP proxy to the router
ingress, against the same router as its own process (`tandem router`) and against a backend reached directly, in
one run.

Backends are benchmarks/mock_worker.py processes (b0-b3, zero think time, as in benchmarks/router.py). The
router process is told their URLs; the Serve application is the registry and the router ingress alone
(tandem.runtimes.ray_serve.router_app, no worker deployments), and the mocks' URLs are registered in its registry as worker
replicas register theirs. Cells as in benchmarks/router.py's latency suite: concurrency 1, 16, 64, non-streaming
end-to-end and streaming time to first token, 4-token completions, every target in turn per cell; "added" is a
target's quantile minus direct's. No target: a figure for users choosing the runtime. Prints, never asserts.

    PYTHONSAFEPATH=1 RAY_USAGE_STATS_ENABLED=0 .venv/bin/python benchmarks/ray_serve.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import sys
import tempfile
import threading

import ray
from ray import serve

from tandem.config import RouterConfig
from tandem.runtimes.launcher import ServiceProcess, free_port
from tandem.runtimes.ray_serve import HEALTH_CHECK_PERIOD_S, WorkerRegistry, router_app

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from router import CONCURRENCY, MODEL, Mock, Target, latency_suite, print_latency_table, wait_serving  # noqa: E402

APP = "bench"
SERVE_NAME = "ours under Ray Serve"


def keep_registered(urls: list[str], stop: threading.Event) -> None:
    """What each worker replica's health check does: say its URL to the registry, every HEALTH_CHECK_PERIOD_S."""
    registry = serve.get_deployment_handle("WorkerRegistry", APP)
    while not stop.is_set():
        for url in urls:
            registry.register.remote("both", url).result()
        stop.wait(HEALTH_CHECK_PERIOD_S)


async def main(args) -> None:
    scale = 0.25 if args.quick else 1.0
    counts = {1: int(400 * scale), 16: int(2000 * scale), 64: int(3000 * scale)}
    warmup = int(200 * scale)
    mocks = [Mock(f"b{i}") for i in range(4)]
    urls = [m.url for m in mocks]
    ray_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    stop = threading.Event()
    router = None
    try:
        for m in mocks:
            await wait_serving(m.url, 20, m.proc)
        router = ServiceProcess(["router", "--model", MODEL, "--log-level", "warning", "--decode", *urls],
                                name="router-process").start()
        router.wait_ready(120)
        ray.init(address="local", include_dashboard=False, _temp_dir=ray_dir, logging_level="warning",
                 log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(router_app(WorkerRegistry.bind(), RouterConfig(model=MODEL)), name=APP)
        threading.Thread(target=keep_registered, args=(urls, stop), daemon=True).start()
        serve_url = f"http://127.0.0.1:{port}"
        await wait_serving(serve_url, 60)
        targets = [Target("direct", urls[0]), Target("ours, router process", router.url, pid=router.proc.pid,
                                                         ours=True),
                   Target(SERVE_NAME, serve_url, ours=True)]
        print(f"conditions: {platform.node()}, {os.cpu_count()} CPUs, load average "
              f"{os.getloadavg()[0]:.2f} at the start; Ray {ray.__version__}; 4 mock backends; requests per cell "
              f"{counts}, {warmup} warm-up per target; the router's x-tandem-slo-class batch")
        results = await latency_suite(targets, counts, warmup)
        print_latency_table(results, "Non-streaming end-to-end latency (ms), 4-token completions; +p50/+p99 = added "
                                     "over direct", False)
        print_latency_table(results, "Streaming time to first token (ms); +p50/+p99 = added over direct", True)
        print("\nWhat Ray Serve adds to the router process (ms, p50 / p99)")
        for stream in (False, True):
            cells = []
            for c in CONCURRENCY:
                ours, served = results["ours, router process"][(stream, c)], results[SERVE_NAME][(stream, c)]
                cells.append(f"c={c}: +{served.pct(50) - ours.pct(50):.2f} / +{served.pct(99) - ours.pct(99):.2f}")
            print(f"  {'streaming TTFT' if stream else 'non-streaming':<15} " + "   ".join(cells))
    finally:
        stop.set()
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
        shutil.rmtree(ray_dir, ignore_errors=True)
        if router is not None:
            router.stop()
        for m in mocks:
            m.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a quarter of the requests per cell")
    asyncio.run(main(parser.parse_args()))
