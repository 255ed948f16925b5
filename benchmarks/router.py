"""What the router adds: latency, throughput and prefix locality against zero-think-time mock backends,
side by side with sglang-router (PyPI) in the same run; and, with real workers, the engine prefix-cache
hit rate through the router vs round-robin.

Mock section (default). Backends are `benchmarks/mock_worker.py` processes on loopback: b0-b3 serve the
OpenAI API (what sglang-router proxies) and the internal protocol (what our router speaks) as decode/colocated
workers; p0-p3 are the mock prefill workers of the disaggregated configuration. Each answer is a fixed
completion cut to the request's max_tokens (4 unless said) whose text names the backend, so the client sees
where each request landed.
  targets: direct (client -> b0), ours colocated (tandem router -> b0-b3, one multiplexed WebSocket per
  backend), ours disaggregated (--disagg-min-tokens 1: every request prefills on p0-p3, decodes on b0-b3),
  ours colocated, HTTP (--worker-transport http: an HTTP request per worker call), ours colocated, gc 700
  (--gc-young-threshold 700: garbage collected at CPython's default threshold), the python floor
  (benchmarks/proxy_floor.py: uvicorn + aiohttp passing each request through to b0-b3 in turn, with none of
  a router's work: what this stack alone adds), the python floor, channel (the same, calling b0-b3 on our
  router's worker channel as ours does: the gap between it and ours colocated is our own per-request work),
  the python floor, essential (the channel floor doing, with tandem's code, only the work the issue requires
  per request: validate, tokenize, sampling parameters, block hashes, sticky placement, format; the gap between
  it and ours colocated is what the rest of our per-request path costs: admission, metrics, failure handling,
  accounting, disconnect handling and the layers between them),
  sglang-router cache_aware and round_robin (-> b0-b3); for locality only, ours colocated with the baseline
  routing policies (--routing-policy round_robin, least_loaded).
  latency: concurrency 1, 16, 64, non-streaming (end-to-end) and streaming (TTFT); "added" is the router's
  quantile minus direct's at the same concurrency; req/s is the best throughput over the three concurrencies.
  Cell by cell, every target in turn (direct first), so that a drift of the shared host weighs on all alike.
  Requests to our router carry `x-tandem-slo-class: batch` (TTFT target 30 s) so that these cells measure
  routing, not admission; one extra cell shows what the default `interactive` class refuses.
  garbage collection: our routers' own tandem_router_gc_pause_seconds over each latency cell, per request.
  locality: 32 prefix groups (shared prefix >= 80 tokens, so the 64-token routing key is the group's),
  4 backends, concurrency 16 and 1. Locality = fraction of requests on their group's most-used backend;
  load = requests per backend counted at the mocks, max/mean.
  long streams: 64-token streamed completions at c=16 for direct, ours colocated (channel and HTTP), the
  floors and sglang-router cache_aware: end-to-end latency and the router's CPU per relayed token.
  long prompts: ~460-token prompts (450 words, each different), non-streaming, c=1 and c=16, for direct, ours
  colocated (long prompts tokenized on a thread), the same router with --tokenize-in-thread-chars 10^9 (every
  prompt tokenized on its event loop), ours disaggregated, the floors and sglang-router cache_aware (which
  routes on text and does not tokenize).
Targets (issue 5): p99 added <= 1 ms at c=16; non-streaming p50 added <= 1.5x sglang-router's; streaming TTFT
added <= 1 ms; locality >= 0.95 with max/mean <= 1.25. Prints met / not met; never asserts.

Real-worker section (--real-workers): a pool of `tandem worker --model smollm2` processes (default 4), each
with a KV cache that holds two or three prompt families' prefixes, serves the same shuffled requests (default
8 families x 4) twice, started fresh each time: once from a round-robin client, once through our router
(colocated). Hit rate = tandem_prefix_cache_hit_tokens_total / tandem_prefix_cache_queried_tokens_total over
the run, summed over the pool. Target >= 3x round-robin's.

    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/router.py [--quick] [--no-sglang] [--only-locality]
        [--real-workers | --only-real]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import platform
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import aiohttp
import numpy as np

from tandem.runtimes.launcher import ServiceProcess, free_port

MODEL = "smollm2"
MOCK_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mock_worker.py")
FLOOR_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "proxy_floor.py")
BACKEND_TAG = re.compile(r"([bp]\d+):\d+")
CONCURRENCY = (1, 16, 64)
LONG_CONCURRENCY = (1, 16)
FLOOR_NAME = "python floor"  # benchmarks/proxy_floor.py: uvicorn + an HTTP request per call (aiohttp)
FLOOR_CHANNEL_NAME = "python floor, channel"  # the same with --transport channel: our router's worker channel
FLOOR_ESSENTIAL_NAME = "python floor, essential"  # channel + the work issue 5 requires per request (--work essential)
FLOORS = (FLOOR_NAME, FLOOR_CHANNEL_NAME, FLOOR_ESSENTIAL_NAME)
FLOOR_ARGS = {FLOOR_NAME: ("http", "none"), FLOOR_CHANNEL_NAME: ("channel", "none"),
              FLOOR_ESSENTIAL_NAME: ("channel", "essential")}
HTTP_NAME = "ours colocated, HTTP"  # --worker-transport http
GC_700_NAME = "ours colocated, gc 700"  # --gc-young-threshold 700 (CPython's default)
VARIANTS = (HTTP_NAME, GC_700_NAME)  # our colocated router with one setting changed: latency cells only
BASELINE_POLICIES = ("round_robin", "least_loaded")  # --routing-policy baselines: locality cells only
LONG_STREAM_TOKENS = 64
WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact river mountain garden window market letter story "
         "question answer paper music table light water money history power city family morning evening "
         "science engine cloud server router stream token cache prefix block worker decode prefill").split()


# -- processes ------------------------------------------------------------------------------------------
class ScriptProcess:
    """A script of benchmarks/ (a mock backend, the python floor) as its own process on a free loopback port."""

    def __init__(self, script: str, *args: str):
        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, script, "--port", str(self.port), *args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONSAFEPATH": "1"}, start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class Mock(ScriptProcess):
    def __init__(self, name: str):
        self.name = name
        super().__init__(MOCK_SCRIPT, "--name", name, "--tokens", str(LONG_STREAM_TOKENS))


class ProxyFloor(ScriptProcess):
    """benchmarks/proxy_floor.py: uvicorn passing requests through round robin over `transport`, nothing else; or
    (work "essential") doing the work issue 5 requires per request and nothing else."""

    def __init__(self, backend_urls: list[str], transport: str = "http", work: str = "none"):
        super().__init__(FLOOR_SCRIPT, "--transport", transport, "--work", work, "--model", MODEL,
                         *(a for url in backend_urls for a in ("--backend", url)))


class SglangRouter:
    """sglang-router's Rust router, launched as its docs say: python -m sglang_router.launch_router."""

    def __init__(self, worker_urls: list[str], policy: str):
        self.port = free_port()
        self.policy = policy
        self.log = open(f"/tmp/tandem-bench-sglang-{policy}.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(self.port),
             "--worker-urls", *worker_urls, "--policy", policy, "--log-level", "warn",
             "--prometheus-port", str(free_port())],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


async def wait_serving(url: str, timeout_s: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    """Until one real completion goes through (a router may listen before its workers are in rotation)."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{url}: process exited with {proc.returncode}")
            try:
                async with s.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "ping", "max_tokens": 2},
                                  timeout=aiohttp.ClientTimeout(total=5)) as r:
                    if r.status == 200:
                        await r.read()
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.2)
    raise TimeoutError(f"{url} did not serve a completion within {timeout_s}s")


# -- load generation -------------------------------------------------------------------------------------
@dataclass
class RunResult:
    latencies_ms: list[float] = field(default_factory=list)  # end-to-end, or TTFT when streaming
    e2e_ms: list[float] = field(default_factory=list)  # end-to-end (to the last byte), streaming or not
    backends: list[str] = field(default_factory=list)  # where each request landed (first tag in the text)
    errors: Counter = field(default_factory=Counter)
    elapsed_s: float = 0.0
    router_cpu_ms: float = float("nan")  # the router process's CPU time per request, when there is a router
    router_gc_us: float = float("nan")  # of which garbage collection, from our router's own metric

    def pct(self, q: float) -> float:
        return float(np.percentile(self.latencies_ms, q)) if self.latencies_ms else float("nan")

    @property
    def rps(self) -> float:
        return len(self.latencies_ms) / self.elapsed_s if self.elapsed_s else 0.0


async def run_load(url: str, bodies: list[bytes], concurrency: int, stream: bool, slo_class: str = "batch") -> RunResult:
    """Sends `bodies` in order with `concurrency` closed-loop clients (zero think time). Our router gets the
    `batch` SLO class by default (TTFT target 30 s) so that these cells measure routing, not admission."""
    result = RunResult()
    landed: list[str | None] = [None] * len(bodies)
    lat: list[float | None] = [None] * len(bodies)
    e2e: list[float | None] = [None] * len(bodies)
    next_index = 0
    endpoint = f"{url}/v1/completions"
    headers = {"Content-Type": "application/json", "x-tandem-slo-class": slo_class}
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal next_index
        while next_index < len(bodies):
            i = next_index
            next_index += 1
            start = time.perf_counter()
            try:
                async with session.post(endpoint, data=bodies[i], headers=headers) as r:
                    if r.status != 200:
                        result.errors[f"http {r.status}"] += 1
                        await r.read()
                        continue
                    if stream:
                        first = None
                        text = []
                        async for line in r.content:
                            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                                continue
                            chunk = json.loads(line[6:])
                            piece = chunk["choices"][0]["text"] if chunk.get("choices") else ""
                            if piece and first is None:
                                first = time.perf_counter()
                            text.append(piece)
                        if first is None:
                            result.errors["stream without text"] += 1
                            continue
                        lat[i] = (first - start) * 1000
                        e2e[i] = (time.perf_counter() - start) * 1000
                        landed[i] = "".join(text)
                    else:
                        body = json.loads(await r.read())
                        lat[i] = e2e[i] = (time.perf_counter() - start) * 1000
                        landed[i] = body["choices"][0]["text"]
            except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, ValueError) as exc:
                result.errors[type(exc).__name__] += 1

    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
        result.elapsed_s = time.perf_counter() - t0
    result.latencies_ms = [v for v in lat if v is not None]
    result.e2e_ms = [v for v in e2e if v is not None]
    result.backends = [tags[0] if (tags := BACKEND_TAG.findall(t or "")) else "?" for t in landed]
    return result


def short_bodies(n: int, stream: bool, seed: int, max_tokens: int = 4) -> list[bytes]:
    rng = random.Random(seed)
    return [json.dumps({"model": MODEL, "prompt": f"Request {i}: " + " ".join(rng.choices(WORDS, k=12)),
                        "max_tokens": max_tokens, "temperature": 0, "stream": stream}).encode() for i in range(n)]


def long_bodies(n: int, seed: int, words: int = 450) -> list[bytes]:
    """Non-streaming requests with long prompts (450 words: ~460 tokens, the script prints the count), each
    different."""
    rng = random.Random(seed)
    return [json.dumps({"model": MODEL, "prompt": f"Document {i}: " + " ".join(rng.choices(WORDS, k=words)),
                        "max_tokens": 4, "temperature": 0}).encode() for i in range(n)]


def group_prompts(groups: int, per_group: int, seed: int, prefix_words: int = 90, tokenizer=None,
                  key_tokens: int = 64) -> list[tuple[int, str]]:
    """(group, prompt) pairs, shuffled: each group's prompts share a long prefix and differ after it."""
    rng = random.Random(seed)
    prefixes = [f"Document {g}. " + " ".join(rng.choices(WORDS, k=prefix_words)) for g in range(groups)]
    work = [(g, f"{prefixes[g]} Question {i}: " + " ".join(rng.choices(WORDS, k=rng.randint(5, 20))))
            for g in range(groups) for i in range(per_group)]
    rng.shuffle(work)
    if tokenizer is not None:  # the premise of the locality test: a group's prompts share the routing key
        firsts = defaultdict(set)
        for g, prompt in work:
            ids = tokenizer.encode(prompt)
            if len(ids) < key_tokens + 8:
                raise ValueError(f"group {g}: prompt has only {len(ids)} tokens, shorter than the routing key")
            firsts[g].add(tuple(ids[:key_tokens]))
        bad = [g for g, keys in firsts.items() if len(keys) != 1]
        if bad:
            raise ValueError(f"groups {bad} do not share their first {key_tokens} tokens")
    return work


# -- mock section ------------------------------------------------------------------------------------------
@dataclass
class Target:
    name: str
    url: str
    locality_pool: str = "b"  # which backends the locality counts: b (colocated/decode) or p (prefill)
    pid: int | None = None  # the router process, for its CPU time
    ours: bool = False  # a tandem router: it reports its garbage-collection pauses (tandem_router_gc_pause_seconds)


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU of a process (all its threads), from /proc; nan without one."""
    if pid is None:
        return float("nan")
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def mock_stats(mocks: list[Mock]) -> dict[str, Counter]:
    async with aiohttp.ClientSession() as s:
        out = {}
        for m in mocks:
            async with s.get(f"{m.url}/stats") as r:
                out[m.name] = Counter((await r.json())["served"])
        return out


async def reset_stats(mocks: list[Mock]) -> None:
    async with aiohttp.ClientSession() as s:
        for m in mocks:
            async with s.post(f"{m.url}/stats/reset") as r:
                await r.read()


async def gc_pause_seconds(url: str) -> float:
    """The total of a tandem router's tandem_router_gc_pause_seconds, all generations."""
    async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as r:
        text = await r.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("tandem_router_gc_pause_seconds_sum"))


async def measured_load(target: Target, bodies: list[bytes], concurrency: int, stream: bool) -> RunResult:
    """run_load, with the router process's CPU time per request sent (and, for ours, its collector's share)."""
    gc0 = await gc_pause_seconds(target.url) if target.ours else float("nan")
    cpu0 = cpu_seconds(target.pid)
    result = await run_load(target.url, bodies, concurrency, stream)
    result.router_cpu_ms = (cpu_seconds(target.pid) - cpu0) * 1000 / len(bodies)
    if target.ours:
        result.router_gc_us = (await gc_pause_seconds(target.url) - gc0) * 1e6 / len(bodies)
    return result


async def latency_suite(targets: list[Target], counts: dict[int, int], warmup: int) -> dict[str, dict]:
    """{target name: {(stream, concurrency): result}}. Cell by cell, every target in turn: what a shared host does
    to one target's cell in the minutes the suite runs (another process, a CPU's clock), it does about as much to
    the others' and to direct's, whose cell comes just before them, rather than to one target alone."""
    for t in targets:
        await run_load(t.url, short_bodies(warmup, False, 99), 16, False)
    results: dict[str, dict] = {t.name: {} for t in targets}
    for stream in (False, True):
        for c in CONCURRENCY:
            bodies = short_bodies(counts[c], stream, c)
            for t in targets:
                results[t.name][(stream, c)] = await measured_load(t, bodies, c, stream)
    return results


async def long_prompt_suite(target: Target, n: int, warmup: int) -> dict[int, RunResult]:
    """Non-streaming long prompts at concurrency 1 and 16: where tokenizing weighs on the router."""
    await run_load(target.url, long_bodies(warmup, 98), 16, False)
    return {c: await measured_load(target, long_bodies(n // (8 if c == 1 else 1), 100 + c), c, False)
            for c in LONG_CONCURRENCY}


def print_long_prompt_table(results: dict[str, dict[int, RunResult]], n_tokens: int) -> None:
    print(f"\nLong prompts (~{n_tokens} tokens, each different), non-streaming, 4-token completions; +p50/+p99 = "
          "added over direct")
    print(f"{'target':<34}" + "".join(f" | c={c:<3} p50     p99   +p50    +p99   req/s  CPU/req" for c in LONG_CONCURRENCY))
    direct = results["direct"]
    for name, res in results.items():
        row = f"{name:<34}"
        for c in LONG_CONCURRENCY:
            r, d = res[c], direct[c]
            a50, a99 = (r.pct(50) - d.pct(50), r.pct(99) - d.pct(99)) if name != "direct" else (0.0, 0.0)
            row += (f" | {fmt_ms(r.pct(50))} {fmt_ms(r.pct(99))} {fmt_ms(a50)} {fmt_ms(a99)} {r.rps:7.0f} "
                    f"{r.router_cpu_ms:8.3f}")
        errs = sum((res[c].errors for c in LONG_CONCURRENCY), Counter())
        print(row + (f"  errors: {dict(errs)}" if errs else ""))


async def long_stream_suite(target: Target, n: int, warmup: int) -> RunResult:
    """Streamed LONG_STREAM_TOKENS-token completions at concurrency 16: where relaying each token weighs."""
    await run_load(target.url, short_bodies(warmup, True, 97, LONG_STREAM_TOKENS), 16, True)
    return await measured_load(target, short_bodies(n, True, 96, LONG_STREAM_TOKENS), 16, True)


def print_long_stream_table(results: dict[str, RunResult], short: dict[str, dict]) -> None:
    """`short`: the latency suite's results, for the CPU of a 4-token stream at c=16."""
    print(f"\nLong streams: {LONG_STREAM_TOKENS}-token streamed completions, c=16; end-to-end = to the last event; "
          "CPU/token = (CPU/request - a 4-token stream's) / (tokens - 4)")
    print(f"{'target':<26} | e2e p50   e2e p99   +p50     +p99  | TTFT p50 |   req/s | CPU/req  CPU/token")
    direct = results["direct"]
    for name, r in results.items():
        p50, p99 = np.percentile(r.e2e_ms, 50), np.percentile(r.e2e_ms, 99)
        d50, d99 = np.percentile(direct.e2e_ms, 50), np.percentile(direct.e2e_ms, 99)
        a50, a99 = (p50 - d50, p99 - d99) if name != "direct" else (0.0, 0.0)
        base = short.get(name, {}).get((True, 16))
        per_token = ((r.router_cpu_ms - base.router_cpu_ms) / (LONG_STREAM_TOKENS - 4)
                     if base is not None else float("nan"))
        print(f"{name:<26} | {p50:8.2f} {p99:8.2f} {a50:8.2f} {a99:8.2f} | {r.pct(50):8.2f} | {r.rps:7.0f} | "
              f"{r.router_cpu_ms:7.3f} {per_token * 1000:7.1f} us" + (f"  errors: {dict(r.errors)}" if r.errors else ""))


def locality_of(work: list[tuple[int, str]], result: RunResult, pool: str) -> tuple[float, int]:
    by_group: dict[int, Counter] = defaultdict(Counter)
    for (g, _), backend in zip(work, result.backends):
        if backend.startswith(pool):
            by_group[g][backend] += 1
    total = sum(sum(c.values()) for c in by_group.values())
    return (sum(max(c.values()) for c in by_group.values()) / total if total else float("nan")), total


async def locality_suite(target: Target, work_by_c: dict[int, list[tuple[int, str]]], mocks: list[Mock]) -> dict:
    out = {}
    pool_mocks = [m for m in mocks if m.name.startswith(target.locality_pool)]
    kind = "prefill" if target.locality_pool == "p" else None
    for c, work in work_by_c.items():
        await reset_stats(mocks)
        bodies = [json.dumps({"model": MODEL, "prompt": p, "max_tokens": 4, "temperature": 0}).encode()
                  for _, p in work]
        res = await run_load(target.url, bodies, c, False)
        stats = await mock_stats(pool_mocks)
        load = [sum(v for k, v in stats[m.name].items() if kind is None or k == kind) for m in pool_mocks]
        loc, n = locality_of(work, res, target.locality_pool)
        out[c] = {"locality": loc, "load": load, "max_mean": max(load) / (sum(load) / len(load)) if sum(load) else
                  float("nan"), "n": n, "errors": res.errors}
    return out


def ring_luck(groups: int, workers: int, trials: int = 200) -> str:
    """How balanced plain consistent hashing leaves `groups` equal groups: the ring depends on the worker URLs
    (here random loopback ports), so max/mean at c=1 is a draw from this distribution."""
    from tandem.router.policies.ring import HashRing

    rng = random.Random(1)
    ratios = []
    for t in range(trials):
        ring = HashRing([f"http://10.0.{t}.{i}:8000" for i in range(workers)])
        owners = Counter(ring.owner(rng.getrandbits(64)) for _ in range(groups))
        ratios.append(max(owners.values()) / (groups / workers))
    ratios.sort()
    ok = sum(r <= 1.25 for r in ratios) / trials
    return (f"Plain consistent hashing of {groups} groups on {workers} workers over {trials} random rings: max/mean "
            f"median {ratios[trials // 2]:.2f}, 90th percentile {ratios[int(trials * 0.9)]:.2f}; <= 1.25 in "
            f"{ok:.0%} of rings")


def fmt_ms(v: float) -> str:
    return f"{v:7.2f}"


def print_latency_table(results: dict[str, dict], title: str, stream: bool) -> None:
    print(f"\n{title}")
    head = "".join(f" | c={c:<3} p50     p99   +p50    +p99" for c in CONCURRENCY)
    print(f"{'target':<26}{head} |   req/s")
    direct = results["direct"]
    for name, res in results.items():
        row = f"{name:<26}"
        for c in CONCURRENCY:
            r, d = res[(stream, c)], direct[(stream, c)]
            added50 = r.pct(50) - d.pct(50) if name != "direct" else 0.0
            added99 = r.pct(99) - d.pct(99) if name != "direct" else 0.0
            row += f" | {fmt_ms(r.pct(50))} {fmt_ms(r.pct(99))} {fmt_ms(added50)} {fmt_ms(added99)}"
        best = max(res[(stream, c)].rps for c in CONCURRENCY)
        errs = sum((res[(stream, c)].errors for c in CONCURRENCY), Counter())
        print(row + f" | {best:7.0f}" + (f"  errors: {dict(errs)}" if errs else ""))


def verdict(ok: bool) -> str:
    return "MET" if ok else "NOT MET"


async def mock_section(args) -> None:
    from tandem.tokenizer import load_tokenizer

    scale = 0.25 if args.quick else 1.0
    counts = {1: int(400 * scale), 16: int(2000 * scale), 64: int(3000 * scale)}
    warmup = int(200 * scale)
    decode = [Mock(f"b{i}") for i in range(4)]
    prefill = [Mock(f"p{i}") for i in range(4)]
    mocks = decode + prefill
    routers: list = []
    sglang_note = None
    try:
        for m in mocks:
            await wait_serving(m.url, 20, m.proc)
        targets = [Target("direct", decode[0].url)]
        common = ["router", "--model", MODEL, "--log-level", "warning", "--decode", *[m.url for m in decode]]
        ours = ServiceProcess(common, name="router-colocated").start()
        ours_pd = ServiceProcess([*common, "--prefill", *[m.url for m in prefill], "--disagg-min-tokens", "1"],
                                 name="router-disagg").start()
        routers += [ours, ours_pd]
        # The same colocated router tokenizing every prompt on its event loop: what the long-prompt cells compare.
        ours_inline = ServiceProcess([*common, "--tokenize-in-thread-chars", str(10**9)],
                                     name="router-inline-tokenize").start()
        routers.append(ours_inline)
        # The same colocated router with an HTTP request per worker call instead of the multiplexed channel.
        ours_http = ServiceProcess([*common, "--worker-transport", "http"], name="router-http").start()
        routers.append(ours_http)
        # The same colocated router collecting garbage at CPython's default threshold, as it did before the
        # eleventh session: what the garbage-collection line compares.
        ours_gc = ServiceProcess([*common, "--gc-young-threshold", "700"], name="router-gc-700").start()
        routers.append(ours_gc)
        # The same colocated router with the baseline routing policies: what the locality table compares.
        baselines = {p: ServiceProcess([*common, "--routing-policy", p], name=f"router-{p}").start()
                     for p in BASELINE_POLICIES}
        routers += baselines.values()
        for r in (ours, ours_pd, ours_inline, ours_http, ours_gc, *baselines.values()):
            r.wait_ready(120)
        targets += [Target("ours colocated", ours.url, pid=ours.proc.pid, ours=True),
                    Target("ours disagg (P/D)", ours_pd.url, "p", pid=ours_pd.proc.pid, ours=True),
                    Target(HTTP_NAME, ours_http.url, pid=ours_http.proc.pid, ours=True),
                    Target(GC_700_NAME, ours_gc.url, pid=ours_gc.proc.pid, ours=True)]
        for name in FLOORS:
            floor = ProxyFloor([m.url for m in decode], *FLOOR_ARGS[name])
            routers.append(floor)
            await wait_serving(floor.url, 30, floor.proc)
            targets.append(Target(name, floor.url, pid=floor.proc.pid))
        if not args.no_sglang:
            try:
                for policy in ("cache_aware", "round_robin"):
                    sg = SglangRouter([m.url for m in decode], policy)
                    routers.append(sg)
                    await wait_serving(sg.url, 60, sg.proc)
                    targets.append(Target(f"sglang-router {policy}", sg.url, pid=sg.proc.pid))
            except (OSError, RuntimeError, TimeoutError) as exc:
                sglang_note = f"sglang-router could not run here: {exc!r}"
        else:
            sglang_note = "sglang-router skipped (--no-sglang)"

        print_conditions(counts, warmup, len(mocks))
        if sglang_note:
            print(sglang_note)

        latency: dict[str, dict] = {}
        if not args.only_locality:
            latency = await latency_suite(targets, counts, warmup)
            print_latency_table(latency, "Non-streaming end-to-end latency (ms), 4-token completions; +p50/+p99 = "
                                         "added over direct", False)
            print_latency_table(latency, "Streaming time to first token (ms); +p50/+p99 = added over direct", True)
            print("\nRouter CPU per request (ms; process user+system time over the cell / requests sent)")
            print(f"{'target':<26}" + "".join(f" | {'stream' if s else 'non-str'} c={c:<3}" for s in (False, True)
                                               for c in CONCURRENCY))
            for name, res in latency.items():
                if name != "direct":
                    print(f"{name:<26}" + "".join(f" | {res[(s, c)].router_cpu_ms:12.3f}" for s in (False, True)
                                                  for c in CONCURRENCY))
            print("\nOf which garbage collection (us per request; the router's tandem_router_gc_pause_seconds)")
            for t in targets:
                if t.ours:
                    res = latency[t.name]
                    print(f"{t.name:<26}" + "".join(f" | {res[(s, c)].router_gc_us:12.1f}" for s in (False, True)
                                                    for c in CONCURRENCY))


        tokenizer = load_tokenizer(MODEL)
        if not args.only_locality:
            stream_targets = [t for t in targets
                              if t.name in ("direct", "ours colocated", HTTP_NAME, *FLOORS,
                                            "sglang-router cache_aware")]
            long_streams = {t.name: await long_stream_suite(t, int(1000 * scale), warmup) for t in stream_targets}
            print_long_stream_table(long_streams, latency)
            long_targets = [targets[0], targets[1],
                            Target("ours colocated, tokenize in place", ours_inline.url, pid=ours_inline.proc.pid),
                            *(t for t in targets[2:]
                              if "round_robin" not in t.name and t.name not in VARIANTS)]
            long_results = {t.name: await long_prompt_suite(t, int(1200 * scale), warmup) for t in long_targets}
            n_tokens = len(tokenizer.encode(json.loads(long_bodies(1, 0)[0])["prompt"]))
            print_long_prompt_table(long_results, n_tokens)
            texts = [json.loads(b)["prompt"] for b in long_bodies(200, 7)]
            started = time.perf_counter()
            for text in texts:
                tokenizer.encode(text)
            print(f"The tokenizer alone (this process, one thread): "
                  f"{(time.perf_counter() - started) * 1000 / len(texts):.3f} ms per long prompt")
        per_group = {16: max(4, int(16 * scale)), 1: max(2, int(8 * scale))}
        work = {c: group_prompts(32, per_group[c], seed=c, tokenizer=tokenizer) for c in (16, 1)}
        locality: dict[str, dict] = {}
        for t in targets:
            if t.name in ("direct", *FLOORS, *VARIANTS):  # two floors take turns, the essential one places keys
                # as ours does; the variants route as ours does
                continue
            locality[t.name] = await locality_suite(t, work, mocks)
        for policy, r in baselines.items():
            name = f"ours, {policy}"
            locality[name] = await locality_suite(Target(name, r.url, pid=r.proc.pid, ours=True), work, mocks)
        print(f"\nLocality: 32 prefix groups x {per_group[16]} requests at c=16, x {per_group[1]} at c=1; "
              "4 backends (prefill backends for P/D); first 64 tokens shared within a group (checked)")
        print(f"{'target':<26} | c=16 locality  max/mean  load per backend     | c=1 locality  max/mean  load")
        for name, res in locality.items():
            a, b = res[16], res[1]
            errs = a["errors"] + b["errors"]
            print(f"{name:<26} | {a['locality']:12.3f}  {a['max_mean']:8.2f}  {str(a['load']):<20} | "
                  f"{b['locality']:12.3f}  {b['max_mean']:8.2f}  {b['load']}" + (f"  errors {dict(errs)}" if errs else ""))

        if not args.only_locality:
            interactive = await run_load(targets[1].url, short_bodies(counts[64], False, 5), 64, False, "interactive")
            print(f"\nAdmission with the default 'interactive' class (TTFT target 1 s), ours colocated, c=64: "
                  f"{interactive.errors.get('http 429', 0)} of {counts[64]} refused with 429; admitted p50/p99 "
                  f"{interactive.pct(50):.1f}/{interactive.pct(99):.1f} ms")
        print(ring_luck(32, 4))

        print("\nTargets (issue 5), ours colocated unless named")
        if not args.only_locality:
            d, o = latency["direct"], latency["ours colocated"]
            p99_added = o[(False, 16)].pct(99) - d[(False, 16)].pct(99)
            print(f"  p99 added at c=16 (non-streaming) <= 1 ms: {p99_added:.2f} ms -> {verdict(p99_added <= 1)}")
            ttft_added = o[(True, 16)].pct(50) - d[(True, 16)].pct(50)
            ttft_added1 = o[(True, 1)].pct(50) - d[(True, 1)].pct(50)
            print(f"  streaming TTFT added <= 1 ms: p50 {ttft_added1:.2f} ms at c=1, {ttft_added:.2f} ms at c=16 -> "
                  f"{verdict(max(ttft_added, ttft_added1) <= 1)}")
            fl = latency[FLOOR_CHANNEL_NAME]
            print("  (not a target) ours colocated minus the python floor, channel, non-streaming p50 at c=1/16/64, what "
                  "our own per-request work costs (at c=16/64 mostly as queueing on its CPU): "
                  + " / ".join(f"{o[(False, c)].pct(50) - fl[(False, c)].pct(50):+.2f}" for c in CONCURRENCY) + " ms")
            ess = latency[FLOOR_ESSENTIAL_NAME]
            print("  (not a target) ours colocated minus the python floor, essential, non-streaming p50 at c=1/16/64, "
                  "what the rest of our path costs (admission, metrics, failure handling, accounting...): "
                  + " / ".join(f"{o[(False, c)].pct(50) - ess[(False, c)].pct(50):+.2f}" for c in CONCURRENCY) + " ms")
            print(f"  (not a target) the python floor, essential, against the same targets: p99 added at c=16 "
                  f"{ess[(False, 16)].pct(99) - d[(False, 16)].pct(99):.2f} ms; streaming TTFT added "
                  f"{ess[(True, 1)].pct(50) - d[(True, 1)].pct(50):.2f} ms at c=1, "
                  f"{ess[(True, 16)].pct(50) - d[(True, 16)].pct(50):.2f} ms at c=16")
            sg = latency.get("sglang-router cache_aware")
            if sg is not None:
                ratios = []
                for c in CONCURRENCY:
                    sg_add = sg[(False, c)].pct(50) - d[(False, c)].pct(50)
                    ess_add = ess[(False, c)].pct(50) - d[(False, c)].pct(50)
                    ratios.append(f"{ess_add / sg_add if sg_add > 0 else float('inf'):.2f}")
                print("  (not a target) the python floor, essential, non-streaming p50 added over sglang-router's at "
                      "c=1/16/64: " + " / ".join(ratios))
                for c in CONCURRENCY:
                    ours_add = o[(False, c)].pct(50) - d[(False, c)].pct(50)
                    sg_add = sg[(False, c)].pct(50) - d[(False, c)].pct(50)
                    print(f"  non-streaming p50 added within 1.5x sglang-router's, c={c}: ours {ours_add:.2f} ms, "
                          f"sglang {sg_add:.2f} ms, ratio {ours_add / sg_add if sg_add > 0 else float('inf'):.2f} -> "
                          f"{verdict(ours_add <= 1.5 * max(sg_add, 0))}")
            else:
                print("  non-streaming p50 vs sglang-router: not measured (" + (sglang_note or "") + ")")
        for c in (16, 1):
            lo = locality["ours colocated"][c]
            ok = lo["locality"] >= 0.95 and lo["max_mean"] <= 1.25
            print(f"  locality >= 0.95 with max/mean <= 1.25 at c={c}: {lo['locality']:.3f} / {lo['max_mean']:.2f} -> "
                  f"{verdict(ok)}")
    finally:
        for r in routers:
            r.stop()
        for m in mocks:
            m.stop()


def print_conditions(counts: dict[int, int], warmup: int, n_mocks: int) -> None:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    versions = []
    for pkg in ("aiohttp", "fastapi", "uvicorn", "httpx", "starlette", "pydantic", "sglang-router"):
        try:
            versions.append(f"{pkg} {importlib.metadata.version(pkg)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{pkg} (not installed)")
    for mod in ("uvloop", "httptools"):
        try:
            __import__(mod)
            versions.append(f"{mod} yes")
        except ImportError:
            versions.append(f"{mod} no")
    print(f"CPU: {cpu}, {os.cpu_count()} cores (shared with the client, {n_mocks} mock backends and every router), "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"Python {platform.python_version()}; " + ", ".join(versions))
    print(f"Requests per latency cell: c=1 {counts[1]}, c=16 {counts[16]}, c=64 {counts[64]} (after {warmup} warm-up); "
          "closed loop, zero think time, aiohttp client, 4-token completions, keep-alive")


# -- real-worker section ------------------------------------------------------------------------------------
def scrape(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M))


async def prefix_counters(urls: list[str]) -> tuple[float, float]:
    async with aiohttp.ClientSession() as s:
        hit = queried = 0.0
        for u in urls:
            async with s.get(f"{u}/metrics") as r:
                text = await r.text()
            hit += scrape(text, "tandem_prefix_cache_hit_tokens_total")
            queried += scrape(text, "tandem_prefix_cache_queried_tokens_total")
        return hit, queried


async def run_families(urls: list[str], work: list[tuple[int, str]], concurrency: int) -> tuple[float, Counter]:
    """Sends the prompts in order, round-robin over `urls` (one URL: all through it); (seconds, errors)."""
    next_index = 0
    errors: Counter = Counter()

    async def client(session):
        nonlocal next_index
        while next_index < len(work):
            i = next_index
            next_index += 1
            async with session.post(f"{urls[i % len(urls)]}/v1/completions", json={
                    "model": MODEL, "prompt": work[i][1], "max_tokens": 4, "temperature": 0}) as r:
                await r.read()
                if r.status != 200:
                    errors[r.status] += 1

    t0 = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    return time.perf_counter() - t0, errors


async def real_section(args) -> None:
    from tandem.tokenizer import load_tokenizer

    families, per_family, kv_blocks, n = args.families, args.per_family, args.kv_blocks, args.pool_size
    rng = random.Random(7)
    prefixes = [f"Manual {f}. " + " ".join(rng.choices(WORDS, k=220)) for f in range(families)]
    work = [(f, f"{prefixes[f]} Q{i}: " + " ".join(rng.choices(WORDS, k=8))) for f in range(families)
            for i in range(per_family)]
    rng.shuffle(work)
    tokenizer = load_tokenizer(MODEL)
    prompt_len = max(len(tokenizer.encode(p)) for _, p in work)
    prefix_len = min(len(tokenizer.encode(p)) for p in prefixes)
    print(f"\nReal workers: {families} prompt families x {per_family} requests ({len(work)}, shuffled), prompts "
          f"<= {prompt_len} tokens of which >= {prefix_len} shared within a family, max_tokens 4, greedy, "
          f"concurrency {args.real_concurrency}; {n} workers per client, started fresh for each; each worker "
          f"SmolLM2-135M Q4_1 on CPU with {kv_blocks} KV blocks of 16 tokens (one family's prefix: "
          f"{prefix_len // 16} full blocks)")
    # tcp, not NIXL: these workers only serve colocated requests, and NIXL's UCX progress thread spins on an idle
    # CPU worker (about a third of a core each, seen with gdb), which would starve the others.
    worker_args = ["worker", "--model", MODEL, "--num-kv-blocks", str(kv_blocks), "--max-model-len", "512",
                   "--kv-transfer", "tcp", "--log-level", "warning"]
    results = {}
    for client in ("round-robin", "ours colocated"):
        # One thread each: the workers share this machine's cores with the router and the client.
        workers = [ServiceProcess(worker_args, name=f"worker{i}", env={"OMP_NUM_THREADS": "1"}) for i in range(n)]
        router = None
        try:
            for w in workers:
                w.start()
            for w in workers:
                w.wait_ready(300)
            urls = [w.url for w in workers]
            if client != "round-robin":
                router = ServiceProcess(["router", "--model", MODEL, "--log-level", "warning", "--decode", *urls],
                                        name="router-real").start().wait_ready(120)
                urls = [router.url]
            elapsed, errors = await run_families(urls, work, args.real_concurrency)
            hit, queried = await prefix_counters([w.url for w in workers])
            per_worker = []
            async with aiohttp.ClientSession() as s:
                for w in workers:
                    async with s.get(f"{w.url}/metrics") as r:
                        per_worker.append(int(scrape(await r.text(), "tandem_prompt_tokens_total")))
            results[client] = {"hit": hit, "queried": queried, "rate": hit / queried if queried else 0.0,
                               "elapsed": elapsed, "errors": errors, "per_worker": per_worker}
        finally:
            if router is not None:
                router.stop()
            for w in workers:
                w.stop()
    print(f"{'client':<18} {'hit tokens':>10} {'queried':>9} {'hit rate':>9} {'seconds':>8}  prompt tokens per worker")
    for name, r in results.items():
        print(f"{name:<18} {r['hit']:10.0f} {r['queried']:9.0f} {r['rate']:9.3f} {r['elapsed']:8.1f}  {r['per_worker']}"
              + (f"  errors {dict(r['errors'])}" if r["errors"] else ""))
    rr, ours = results["round-robin"]["rate"], results["ours colocated"]["rate"]
    ratio = ours / rr if rr else float("inf")
    print(f"Target: prefix-cache hit rate >= 3x round-robin's: {ratio:.2f}x -> {verdict(ratio >= 3)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a quarter of the requests")
    ap.add_argument("--no-sglang", action="store_true", help="skip sglang-router")
    ap.add_argument("--real-workers", action="store_true", help="also run the real-worker prefix-cache section")
    ap.add_argument("--only-real", action="store_true", help="run only the real-worker section")
    ap.add_argument("--only-locality", action="store_true",
                    help="mock section: only the locality cells (no latency, CPU or admission cells)")
    ap.add_argument("--real-concurrency", type=int, default=1)
    ap.add_argument("--families", type=int, default=8, help="real-worker section: prompt families")
    ap.add_argument("--per-family", type=int, default=4, help="real-worker section: requests per family")
    ap.add_argument("--kv-blocks", type=int, default=48, help="real-worker section: KV blocks per worker")
    ap.add_argument("--pool-size", type=int, default=4, help="real-worker section: workers per client")
    args = ap.parse_args()
    t0 = time.perf_counter()
    if not args.only_real:
        asyncio.run(mock_section(args))
    if args.real_workers or args.only_real:
        asyncio.run(real_section(args))
    print(f"\nbenchmark wall time {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
