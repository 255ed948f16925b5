"""Tandem on Ray Serve (tandem.runtimes.ray_serve): a real local Ray cluster, the application's router, registry and SmolLM2
prefill and decode workers, reached through Serve's HTTP proxy with the OpenAI SDK."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest
import ray
import yaml
from ray import serve
from test_pd_workers import metric  # e2e's own scrape of a process's /metrics

from tandem.runtimes.launcher import free_port
from tandem.runtimes.ray_serve import (
    REGISTRATION_TTL_S,
    RegistryDiscovery,
    TandemRayArgs,
    WorkerRegistry,
    build,
)

APP = "tandem"
PROMPT = "Here is a list of the planets of the solar system, from the closest to the sun to the farthest: " * 3


def test_the_registry_forgets_a_worker_it_has_not_heard_from(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    registry = WorkerRegistry.func_or_class()
    registry.register("prefill", "http://10.0.0.1:9000")
    registry.register("both", "http://10.0.0.2:9000")  # colocated workers are the router's decode pool
    registry.register("decode", "http://10.0.0.3:9000")
    assert registry.members() == (["http://10.0.0.1:9000"], ["http://10.0.0.2:9000", "http://10.0.0.3:9000"], 0)
    now[0] += REGISTRATION_TTL_S - 1
    registry.register("decode", "http://10.0.0.3:9000")  # a health check's renewal
    registry.forget("both", "http://10.0.0.2:9000")  # a replica shut down by Serve
    now[0] += 2
    assert registry.members() == ([], ["http://10.0.0.3:9000"], REGISTRATION_TTL_S + 1)


class _Registry:
    """A registry handle's `members.remote()`: what `answer` says, or its exception raised."""

    def __init__(self):
        self.answer: tuple | Exception = ([], [], 0.0)
        self.members = self

    async def remote(self):
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


async def test_the_router_keeps_its_workers_while_the_registry_restarts_or_stalls():
    """What a registry up for the TTL lists is the membership; a younger (restarted) one only adds to the workers
    known, and one that does not answer changes nothing: neither empties the router's pools."""
    registry = _Registry()
    discovery = RegistryDiscovery(registry)
    registry.answer = (["http://p:1"], ["http://d:1", "http://d:2"], REGISTRATION_TTL_S + 60)
    assert await discovery.members() == (["http://p:1"], ["http://d:1", "http://d:2"])
    registry.answer = TimeoutError()  # stalled, or restarting, for however long
    assert await discovery.members() == (["http://p:1"], ["http://d:1", "http://d:2"])
    registry.answer = ([], ["http://d:3"], 1.0)  # restarted: it has heard from one worker so far
    assert await discovery.members() == (["http://p:1"], ["http://d:1", "http://d:2", "http://d:3"])
    registry.answer = (["http://p:1"], ["http://d:2", "http://d:3"], REGISTRATION_TTL_S + 1)  # d:1 went
    assert await discovery.members() == (["http://p:1"], ["http://d:2", "http://d:3"])


def test_settings_come_from_the_command_line_as_json():
    """`serve run tandem.ray_serve:build engine='{...}'` passes strings; a Serve config file passes mappings."""
    args = TandemRayArgs(**{"prefill": "2", "engine": '{"max_model_len": 2048}', "router": {"max_input_tokens": 99}})
    assert (args.prefill, args.engine, args.router) == (2, {"max_model_len": 2048}, {"max_input_tokens": 99})
    with pytest.raises(ValueError):
        TandemRayArgs(engine="{not json")


def test_the_example_serve_config_is_valid_and_builds():
    """examples/ray-serve.yaml as `serve deploy` reads it: Serve's schema, our args, and its deployment override
    naming one of the application's deployments."""
    from ray.serve.schema import ServeDeploySchema

    with open(Path(__file__).parent.parent / "examples" / "ray-serve.yaml") as f:
        (app,) = ServeDeploySchema.model_validate(yaml.safe_load(f)).applications
    built = build(app.args)
    from ray.serve._private.build_app import build_app  # what serve.run does with it: the deployments by name

    names = {d.name for d in build_app(built, name=app.name).deployments}
    assert {d.name for d in app.deployments} <= names == {"WorkerRegistry", "PrefillWorker", "DecodeWorker",
                                                          "TandemRouter"}


@pytest.fixture(scope="module")
def serve_url():
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # nothing leaves this machine
    # Ray's own directory, short: its Unix sockets' paths must fit in 107 bytes (pytest's tmp paths do not).
    ray_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    ray.init(address="local", num_cpus=8, object_store_memory=100 << 20, include_dashboard=False, _temp_dir=ray_dir)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build({"prefill": 1, "decode": 1, "disagg_min_tokens": 0,
                         "engine": {"num_kv_blocks": 512, "max_num_batched_tokens": 1024,
                                    "tool_call_parser": "hermes"}}), name=APP)
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(ray_dir, ignore_errors=True)


def workers() -> tuple[list[str], list[str]]:
    prefill, decode, _ = serve.get_deployment_handle("WorkerRegistry", APP).members.remote().result()
    return prefill, decode


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
    assert metric(serve_url, "tandem_router_routing_decisions_total", 'path="disagg"') == 4
    assert metric(decode_url, "tandem_kv_transfer_blocks_total") > 0
    assert httpx.get(serve_url + "/ready").json() == {"status": "ready", "prefill": 1, "decode": 1}


def test_the_engines_tool_call_parser_reaches_the_router(serve_url):
    """The router forms the answers: the application gives it the workers' parser. The model's output is forced
    (a regex) into a call in its own format, which the parser reads."""
    client = openai.OpenAI(base_url=serve_url + "/v1", api_key="none")
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    answer = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "The weather in Paris?"}], tools=[weather],
        max_tokens=40, extra_body={"structured_outputs": {"regex": re.escape(call)}}).choices[0]
    assert answer.finish_reason == "tool_calls" and answer.message.content is None
    assert [(c.function.name, c.function.arguments) for c in answer.message.tool_calls] == [
        ("get_weather", '{"city": "Paris"}')]


def _pid_listening_on(url: str) -> int:
    """The worker process started with `--port <its port>` (tandem.runtimes.launcher passes it on the command line)."""
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


def test_a_worker_that_hangs_is_replaced_and_the_router_finds_its_successor(serve_url):
    """A worker that stops answering (SIGSTOP: alive, but hung) fails its replica's health checks, as it would a
    pod's liveness probe; Serve replaces the replica, and the router takes the new worker from the registry."""
    (_,), (decode_url,) = workers()
    hung = _pid_listening_on(decode_url)
    os.kill(hung, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:  # three failed checks; then a new replica loads the model
            _, decode = workers()
            ready = httpx.get(serve_url + "/ready").json()
            if decode and decode_url not in decode and ready.get("decode") == 1:
                break
            time.sleep(1)
        else:
            raise AssertionError(f"no new decode worker: registry {workers()}, router {ready}")
        client = openai.OpenAI(base_url=serve_url + "/v1", api_key="none")
        answer = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=4, temperature=0)
        assert answer.choices[0].finish_reason == "length"
    finally:
        with contextlib.suppress(ProcessLookupError):  # the old replica's shutdown kills it within its grace
            os.kill(hung, signal.SIGKILL)
