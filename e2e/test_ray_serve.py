"""Tandem on Ray Serve (tandem.ray_serve): a real local Ray cluster, the application's router, registry and SmolLM2
prefill and decode workers, reached through Serve's HTTP proxy with the OpenAI SDK."""

from __future__ import annotations

import os
import signal
import tempfile
import time

import httpx
import openai
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from tandem.launcher import free_port
from tandem.ray_serve import REGISTRATION_TTL_S, TandemRayArgs, WorkerRegistry, build

APP = "tandem"
PROMPT = "Here is a list of the planets of the solar system, from the closest to the sun to the farthest: " * 3


def test_the_registry_forgets_a_worker_it_has_not_heard_from(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    registry = WorkerRegistry.func_or_class()
    registry.register("prefill", "http://10.0.0.1:9000")
    registry.register("both", "http://10.0.0.2:9000")  # colocated workers are the router's decode pool
    registry.register("decode", "http://10.0.0.3:9000")
    assert registry.members() == (["http://10.0.0.1:9000"], ["http://10.0.0.2:9000", "http://10.0.0.3:9000"])
    now[0] += REGISTRATION_TTL_S - 1
    registry.register("decode", "http://10.0.0.3:9000")  # a health check's renewal
    registry.forget("both", "http://10.0.0.2:9000")  # a replica shut down by Serve
    now[0] += 2
    assert registry.members() == ([], ["http://10.0.0.3:9000"])


def test_settings_come_from_the_command_line_as_json():
    """`serve run tandem.ray_serve:build engine='{...}'` passes strings; a Serve config file passes mappings."""
    args = TandemRayArgs(**{"prefill": "2", "engine": '{"max_model_len": 2048}', "router": {"max_input_tokens": 99}})
    assert (args.prefill, args.engine, args.router) == (2, {"max_model_len": 2048}, {"max_input_tokens": 99})
    with pytest.raises(ValueError):
        TandemRayArgs(engine="{not json")


@pytest.fixture(scope="module")
def serve_url():
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # nothing leaves this machine
    # Ray's own directory, short: its Unix sockets' paths must fit in 107 bytes (pytest's tmp paths do not).
    ray.init(num_cpus=8, object_store_memory=100 << 20, include_dashboard=False,
             _temp_dir=tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build({"prefill": 1, "decode": 1, "disagg_min_tokens": 0,
                         "engine": {"num_kv_blocks": 512, "max_num_batched_tokens": 1024}}), name=APP)
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def scraped(url: str, name: str, **labels) -> float:
    """A metric on `url`/metrics, summed over the series whose labels include `labels`."""
    families = text_string_to_metric_families(httpx.get(url + "/metrics").text)
    return sum(s.value for f in families for s in f.samples if s.name == name and labels.items() <= s.labels.items())


def workers() -> tuple[list[str], list[str]]:
    return serve.get_deployment_handle("WorkerRegistry", APP).members.remote().result()


def test_the_openai_sdk_through_serve_gets_prefill_then_decode_answers(serve_url):
    client = openai.OpenAI(base_url=serve_url + "/v1", api_key="none")
    (prefill_url,), (decode_url,) = workers()
    # The same greedy request served whole by the decode worker, without the router: the reference.
    direct = httpx.post(decode_url + "/v1/completions", json={"model": "smollm2", "prompt": PROMPT, "max_tokens": 12,
                                                              "temperature": 0}, timeout=120).json()
    routed = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=12, temperature=0)
    assert routed.choices[0].text == direct["choices"][0]["text"]
    streamed = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == direct["choices"][0]["text"]

    chat = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": PROMPT}],
                                          max_tokens=8, temperature=0)
    stream = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": PROMPT}],
                                            max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == chat.choices[0].message.content

    # Every request went prefill -> decode, and the decode worker pulled the prompts' KV from the prefill worker.
    assert scraped(serve_url, "tandem_router_routing_decisions_total", path="disagg") == 4
    assert scraped(decode_url, "tandem_kv_transfer_blocks_total") > 0
    assert httpx.get(serve_url + "/ready").json() == {"status": "ready", "prefill": 1, "decode": 1}


def _pid_listening_on(url: str) -> int:
    """The worker process started with `--port <its port>` (tandem.launcher passes it on the command line)."""
    port = url.rsplit(":", 1)[1]
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().decode().split("\0")
        except OSError:
            continue
        if "tandem.cli" in args and "--port" in args and args[args.index("--port") + 1] == port:
            return int(pid)
    raise AssertionError(f"no worker process listens on {url}")


def test_a_worker_that_dies_is_replaced_and_the_router_finds_its_successor(serve_url):
    (_,), (decode_url,) = workers()
    os.kill(_pid_listening_on(decode_url), signal.SIGKILL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # Serve's health check fails the replica; a new one loads the model
        _, decode = workers()
        ready = httpx.get(serve_url + "/ready").json()
        if decode and decode != [decode_url] and ready.get("decode") == 1:
            break
        time.sleep(1)
    else:
        raise AssertionError(f"no new decode worker: registry {workers()}, router {ready}")
    assert decode_url not in decode
    client = openai.OpenAI(base_url=serve_url + "/v1", api_key="none")
    answer = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=4, temperature=0)
    assert answer.choices[0].finish_reason == "length"
