"""Disaggregated prefill/decode across real worker processes on 127.0.0.1, NIXL and TCP.

This test plays the router's part over the internal protocol: prefill on one process, decode on
another, and compares the tokens with a colocated worker's, token for token.
"""

from __future__ import annotations

import random
import re
import time

import httpx
import pytest

from tandem.runtimes.launcher import ServiceProcess
from tandem.server.internal_auth import internal_headers
from tandem.server.sse import parse_sse_line
from tandem.workers.kv_transfer import nixl_available

BACKENDS = ["tcp", pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(), reason="nixl missing"))]
PROMPT_LENGTHS = [1, 7, 16, 17, 100, 255, 256, 600, 1200, 2000]  # partial last blocks included
SAMPLING = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}


def worker(role: str, backend: str = "tcp", *extra: str) -> ServiceProcess:
    return ServiceProcess(["worker", "--role", role, "--model", "smollm2", "--kv-transfer", backend,
                           "--num-kv-blocks", "512", "--max-num-batched-tokens", "1024", *extra], name=f"{role}-{backend}")


def metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(url + "/metrics").text
    return sum(float(m.group(2)) for m in re.finditer(rf"^{name}(\{{[^}}]*\}})? (\S+)$", text, re.M)
               if labels in (m.group(1) or ""))


def prompt_of(length: int) -> list[int]:
    rng = random.Random(length)
    return [rng.randrange(100, 40000) for _ in range(length)]


def prefill(url: str, rid: str, prompt: list[int]) -> dict:
    r = httpx.post(url + "/internal/prefill", json={"request_id": rid, "prompt_token_ids": prompt,
                                                    "sampling": SAMPLING}, timeout=120, headers=internal_headers())
    assert r.status_code == 200, r.text
    return r.json()


def decode(url: str, rid: str, prompt: list[int], first: int | None = None, handle: dict | None = None):
    """(token ids, kv_source of the first chunk) from /internal/decode."""
    body = {"request_id": rid, "prompt_token_ids": prompt, "first_token_id": first, "kv_handle": handle,
            "sampling": SAMPLING}
    tokens, source = [], None
    with httpx.stream("POST", url + "/internal/decode", json=body, timeout=120, headers=internal_headers()) as r:
        if r.status_code != 200:
            r.read()
            return r, None
        for line in r.iter_lines():
            chunk = parse_sse_line(line)
            if chunk is None:
                continue
            assert "error" not in chunk, chunk
            source = source or chunk.get("kv_source")
            tokens += chunk["token_ids"]
    return tokens, source


@pytest.fixture(scope="module")
def colocated():
    with worker("both") as proc:
        yield proc


@pytest.fixture(scope="module")
def reference(colocated):
    """Colocated greedy tokens per prompt length, computed once."""
    cache: dict[int, list[int]] = {}

    def get(length: int) -> list[int]:
        if length not in cache:
            cache[length], source = decode(colocated.url, f"ref-{length}", prompt_of(length))
            assert source == "local"
        return cache[length]
    return get


@pytest.fixture(scope="module", params=BACKENDS)
def pd(request):
    backend = request.param
    p, d = worker("prefill", backend), worker("decode", backend)
    p.start(), d.start()
    try:
        p.wait_ready(), d.wait_ready()
        yield backend, p, d
    finally:
        p.stop(), d.stop()


def test_pd_equals_colocated_token_for_token(pd, reference):
    backend, p, d = pd
    computed_before = metric(d.url, "tandem_computed_prompt_tokens_total")
    for length in PROMPT_LENGTHS:
        prompt = prompt_of(length)
        pre = prefill(p.url, f"pd-{backend}-{length}", prompt)
        assert pre["kv_handle"]["num_tokens"] == length
        rest, source = decode(d.url, f"pd-{backend}-{length}", prompt, pre["first_token_id"], pre["kv_handle"])
        assert source == "pulled", (length, source)
        assert [pre["first_token_id"], *rest] == reference(length), length
    # Every prompt token came over the wire: the decode worker computed none of them.
    assert metric(d.url, "tandem_computed_prompt_tokens_total") == computed_before
    assert metric(d.url, "tandem_kv_transfer_blocks_total") >= sum(-(-n // 16) for n in PROMPT_LENGTHS)
    # Releases are asynchronous: give them a moment, then nothing may stay pinned or used.
    wait_unpinned(p.url)
    for url in (p.url, d.url):
        assert metric(url, "tandem_kv_pinned_blocks") == 0
        assert metric(url, "tandem_kv_blocks_used") == 0


def wait_unpinned(url: str, timeout_s: float = 10) -> None:
    """Until the worker pins no KV blocks, or `timeout_s`: lease releases are asynchronous."""
    deadline = time.monotonic() + timeout_s
    while metric(url, "tandem_kv_pinned_blocks") and time.monotonic() < deadline:
        time.sleep(0.1)


def test_wrong_fingerprint_is_refused_with_the_mismatch_named(pd):
    backend, p, d = pd
    prompt = prompt_of(40)
    pre = prefill(p.url, f"fp-{backend}", prompt)
    handle = pre["kv_handle"]
    handle["layout"]["block_size"] = 32
    r, _ = decode(d.url, f"fp-{backend}", prompt, pre["first_token_id"], handle)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "kv_layout_mismatch" and "block_size: handle 32, this worker 16" in err["message"]
    # Nobody will read the refused handle's blocks: the decode worker released its lease (asynchronously).
    wait_unpinned(p.url)
    assert metric(p.url, "tandem_kv_pinned_blocks") == 0
    assert httpx.post(p.url + "/internal/kv/release", json={"lease_id": handle["lease_id"]}, headers=internal_headers()).status_code == 404


def test_a_prefill_whose_caller_left_over_http_frees_its_blocks(pd):
    """A router that gives up on a prefill over HTTP closes its connection; its abort, on another connection, can
    reach the worker before the prefill does and find nothing to abort. The worker frees the prompt's blocks
    itself once it sees nobody is left to take the handle, instead of holding them to the lease's end."""
    backend, p, d = pd
    # A prompt no other test sends: no prefix-cache hit makes it quick enough to answer before the caller leaves.
    body = {"request_id": f"left-{backend}", "prompt_token_ids": prompt_of(1500), "sampling": SAMPLING}
    finished, expired = metric(p.url, "tandem_requests_finished_total"), metric(p.url, "tandem_kv_lease_expirations_total")
    with pytest.raises(httpx.TimeoutException):
        httpx.post(p.url + "/internal/prefill", json=body, timeout=0.05, headers=internal_headers())  # gone before the prefill is done
    deadline = time.monotonic() + 20
    while metric(p.url, "tandem_requests_finished_total") == finished and time.monotonic() < deadline:
        time.sleep(0.1)  # the prefill runs to its end meanwhile
    wait_unpinned(p.url)
    assert metric(p.url, "tandem_kv_pinned_blocks") == 0
    assert metric(p.url, "tandem_kv_lease_expirations_total") == expired  # freed, not expired


@pytest.mark.parametrize("backend", BACKENDS)
def test_expired_lease_and_dead_prefill_fall_back_with_identical_tokens(backend, reference):
    p = worker("prefill", backend, "--kv-lease-ttl-s", "1")
    d = worker("decode", backend)
    p.start(), d.start()
    try:
        p.wait_ready(), d.wait_ready()
        # 1. The lease runs out before the decode worker pulls.
        prompt = prompt_of(100)
        pre = prefill(p.url, f"exp-{backend}", prompt)
        time.sleep(1.5)
        rest, source = decode(d.url, f"exp-{backend}", prompt, pre["first_token_id"], pre["kv_handle"])
        assert source == "lease_expired"
        assert [pre["first_token_id"], *rest] == reference(100)
        r = httpx.post(p.url + "/internal/kv/release", json={"lease_id": pre["kv_handle"]["lease_id"]}, headers=internal_headers())
        assert r.status_code == 404 and r.json()["error"]["code"] == "lease_not_found"
        assert metric(p.url, "tandem_kv_lease_expirations_total") == 1
        assert metric(p.url, "tandem_kv_pinned_blocks") == 0

        # 2. The prefill worker dies after answering.
        prompt = prompt_of(255)
        pre = prefill(p.url, f"dead-{backend}", prompt)
        p.kill()
        rest, source = decode(d.url, f"dead-{backend}", prompt, pre["first_token_id"], pre["kv_handle"])
        assert source in ("agent_unreachable", "transfer_failed")
        assert [pre["first_token_id"], *rest] == reference(255)
        assert metric(d.url, "tandem_kv_transfer_fallbacks_total", f'reason="{source}"') == 1
        assert metric(d.url, "tandem_kv_blocks_used") == 0
    finally:
        p.stop(), d.stop()
