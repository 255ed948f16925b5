"""On a real cluster: install the chart, apply the example, get a completion through the router.

Needs KUBECONFIG (or ~/.kube/config) pointing at a reachable cluster (kind works), `helm` and `kubectl` on
PATH, and the two images where the cluster can pull them (for kind: `kind load docker-image ...`):

    TANDEM_WORKER_IMAGE (default tandem/worker:0.1.0)   docker/worker.Dockerfile
    TANDEM_SLIM_IMAGE   (default tandem/slim:0.1.0)     docker/slim.Dockerfile

It applies examples/llmdeployment-cpu.yaml (no GPU limits or tolerations, float32, KV over TCP), so any
cluster with 2 CPUs and 8 GiB to spare can run it. Skipped, saying why, when something is missing.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
WORKER_IMAGE = os.environ.get("TANDEM_WORKER_IMAGE", "tandem/worker:0.1.0")
SLIM_IMAGE = os.environ.get("TANDEM_SLIM_IMAGE", "tandem/slim:0.1.0")
READY_TIMEOUT = float(os.environ.get("TANDEM_E2E_READY_TIMEOUT", "900"))  # pulling images, loading models


def _cluster_problem() -> str | None:
    for tool in ("kubectl", "helm"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not on PATH"
    config = os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
    if not all(os.path.exists(p) for p in config.split(os.pathsep)):
        return f"no kubeconfig at {config} (set KUBECONFIG to a reachable cluster, e.g. kind)"
    probe = subprocess.run(["kubectl", "version", "--request-timeout=5s", "-o", "json"], capture_output=True,
                           text=True, timeout=20)
    if probe.returncode != 0 or "serverVersion" not in probe.stdout:
        return f"the cluster in {config} is not reachable: {probe.stderr.strip()[:200]}"
    return None


PROBLEM = _cluster_problem()
pytestmark = pytest.mark.skipif(PROBLEM is not None, reason=f"cluster e2e skipped: {PROBLEM}")


def kubectl(*args: str, stdin: str | None = None, timeout: float = 120) -> str:
    done = subprocess.run(["kubectl", *args], input=stdin, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr}"
    return done.stdout


def cpu_example(namespace: str) -> dict:
    """examples/llmdeployment-cpu.yaml (what docs/kubernetes.md gives kind users) with this run's images."""
    body = yaml.safe_load((ROOT / "examples" / "llmdeployment-cpu.yaml").read_text())
    body["metadata"]["namespace"] = namespace
    body["spec"]["image"] = WORKER_IMAGE
    body["spec"]["router"]["image"] = SLIM_IMAGE
    return body


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def namespace():
    name = f"tandem-e2e-{uuid.uuid4().hex[:6]}"
    kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        # LLMDeployments first, while the operator runs to take kopf's finalizer off (docs/kubernetes.md);
        # afterwards they would keep the namespace in Terminating.
        subprocess.run(["kubectl", "delete", "llmdep", "--all", "-n", name, "--timeout=120s"], capture_output=True,
                       timeout=150)
        subprocess.run(["helm", "uninstall", "tandem", "--namespace", name], capture_output=True, timeout=120)
        kubectl("delete", "namespace", name, "--wait=false")


def test_chart_example_and_a_completion_through_the_router(namespace):
    repository, _, tag = SLIM_IMAGE.rpartition(":")
    subprocess.run(["helm", "install", "tandem", str(ROOT / "charts" / "tandem"), "--namespace", namespace,
                    "--set", f"operator.watchNamespace={namespace}", "--set", f"operator.image.repository={repository}",
                    "--set", f"operator.image.tag={tag}", "--set", "networkPolicy.enabled=true",
                    "--wait", "--timeout", "5m"], check=True, timeout=400)

    kubectl("apply", "-f", "-", stdin=json.dumps(cpu_example(namespace)))
    deadline = time.monotonic() + READY_TIMEOUT
    status: dict = {}
    while time.monotonic() < deadline:
        status = json.loads(kubectl("get", "llmdep", "smollm2", "-n", namespace, "-o", "json")).get("status") or {}
        if status.get("phase") == "Ready":
            break
        time.sleep(5)
    assert status.get("phase") == "Ready", f"not Ready after {READY_TIMEOUT}s: {status}\n" + kubectl(
        "get", "pods,events", "-n", namespace)
    assert (status["ready"], status["ratio"]) == ("3/3", "1:1")
    table = kubectl("get", "llmdep", "-n", namespace)
    assert "smollm2" in table and "1:1" in table

    port = _free_port()
    forward = subprocess.Popen(["kubectl", "port-forward", "-n", namespace, "svc/smollm2-router", f"{port}:8000"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        answer = None
        for _ in range(60):  # the port-forward needs a moment; bounded to about a minute
            with contextlib.suppress(httpx.HTTPError):
                answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60, json={
                    "model": "smollm2-135m-instruct", "prompt": "The capital of France is", "max_tokens": 8,
                    "temperature": 0})
                break
            time.sleep(1)
        assert answer is not None and answer.status_code == 200, answer.text if answer else "no answer"
        assert answer.json()["choices"][0]["text"].strip()
    finally:
        forward.terminate()
        forward.wait(10)
