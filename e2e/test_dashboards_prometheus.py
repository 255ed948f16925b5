"""Every Grafana dashboard expression, evaluated by a real Prometheus scraping a running `tandem serve`.

Needs the `prometheus` binary (Debian package `prometheus`); skipped, saying so, without it. Prometheus
listens on loopback only and keeps its data in a temporary folder.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tandem.runtimes.launcher import ServiceProcess, free_port

ROOT = Path(__file__).resolve().parents[1]
DASHBOARDS = sorted((ROOT / "charts" / "tandem" / "dashboards").glob("*.json"))
PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="no `prometheus` binary (apt-get install prometheus)")
VARIABLES = {"$__rate_interval": "30s", "$model": ".*", "$slo_class": "interactive", "$namespace": ".*", "$ttft_slo": "0.5", "$itl_slo": "0.05"}
# Panels that must return data from a lone `tandem serve` (engine metrics); router, KV-transfer and
# kube-state-metrics panels need a router, a P/D pair or a cluster, so for them "no error" is the bar.
CORE_PANELS = {("tandem-pools.json", t) for t in ("KV cache usage", "Running requests", "Waiting requests",
                                                  "Prefix cache hit rate", "Tokens per second",
                                                  "Engine time to first token", "Queue time")}


def _expressions():
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel["targets"]:
                expr = target["expr"]
                for variable, value in VARIABLES.items():
                    expr = expr.replace(variable, value)
                yield path.name, panel["title"], expr


def _wait(what: str, check, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture(scope="module")
def serve():
    """The stack `tandem serve` runs, started part by part so Prometheus can scrape every process:
    the router (router metrics) and a prefill and a decode worker (engine and KV-transfer metrics)."""
    common = ["--model", "smollm2", "--kv-transfer", "tcp"]
    prefill = ServiceProcess(["worker", "--role", "prefill", *common], name="dash-prefill")
    decode = ServiceProcess(["worker", "--role", "decode", *common], name="dash-decode")
    for proc in (prefill, decode):
        proc.start()
    for proc in (prefill, decode):
        proc.wait_ready()
    router = ServiceProcess(["router", "--model", "smollm2", "--prefill", prefill.url, "--decode", decode.url,
                             "--disagg-min-tokens", "32"], name="dash-router")
    with router:
        router.targets = [f"127.0.0.1:{p.port}" for p in (router, prefill, decode)]
        yield router
    for proc in (prefill, decode):
        proc.stop()


@pytest.fixture(scope="module")
def prometheus(serve):
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="tandem-prometheus-") as tmp:
        config = Path(tmp) / "prometheus.yml"
        config.write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "tandem", "static_configs": [{"targets": serve.targets}]}],
        }))
        proc = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp}/data",
                                 f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            def ready():
                try:
                    return httpx.get(url + "/-/ready", timeout=2).status_code == 200
                except httpx.HTTPError:
                    return proc.poll() is not None and pytest.fail(f"prometheus exited with {proc.returncode}")
            _wait("prometheus to be ready", ready, 60)
            # Service discovery hands targets over after a few seconds; traffic sent before the first
            # scrape would show up as a starting value, not as a rate.
            _wait("the first scrape of tandem serve", lambda: _query(url, 'up{job="tandem"} == 1')["data"]["result"], 60)
            yield url
        finally:
            proc.terminate()
            proc.wait(20)


def _query(prometheus: str, expr: str) -> dict:
    answer = httpx.get(prometheus + "/api/v1/query", params={"query": expr}, timeout=30)
    return answer.json()


def test_every_dashboard_expression_evaluates_and_core_panels_have_data(serve, prometheus):
    system = "You are terse."
    for i in range(3):  # the same prefix each time: the prefix cache has something to hit
        answer = httpx.post(serve.url + "/v1/chat/completions", timeout=120, json={
            "model": "smollm2", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "system", "content": system * 8}, {"role": "user", "content": f"Count to {i + 3}."}]})
        assert answer.status_code == 200, answer.text
    # rate() needs two samples of the counters after the traffic.
    _wait("generation rate data", lambda: _query(prometheus, "rate(tandem_generation_tokens_total[30s]) > 0")
          ["data"]["result"], 60)

    empty = []
    for dashboard, title, expr in _expressions():
        result = _query(prometheus, expr)
        assert result["status"] == "success", f"{dashboard} / {title}: {expr}: {result.get('error')}"
        if not result["data"]["result"]:
            empty.append((dashboard, title))
    print(f"{len(list(_expressions()))} expressions; without data here: {sorted(set(empty))}")
    assert not CORE_PANELS & set(empty), f"core panels without data: {sorted(CORE_PANELS & set(empty))}"
