"""What the router's admission refuses on real workers: `tandem serve` (one prefill and one decode SmolLM2 worker,
on this machine's CPU) under closed-loop load in the default `interactive` class (TTFT target 1 s).

For each concurrency: how many requests were admitted, the TTFT of those (p50, p99, from the first streamed
token), and for the refused ones (429) the TTFT the router predicted. A request admitted is a request the
router expected to serve within 1 s; the admitted TTFTs say how right it was, the refusals what it cost.

    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/admission.py [--requests 32] [--concurrency 1 2 4 8]
        [--server-pythonpath DIR] [--burst 16 --shared-prefix 300 --bursts 3]

--burst N sends bursts instead: N requests at once, each a new prefix of --shared-prefix tokens that all N share (a
system prompt) followed by 16 tokens of its own; a new prefix for each of --bursts bursts.

--server-pythonpath runs the stack from another checkout (a folder holding a `tandem` package laid out as the
installed one), for a before/after comparison on one machine; the load and the figures are this checkout's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import statistics
import time

import aiohttp
import numpy as np

from tandem.launcher import ServiceProcess

PROMPT_TOKENS, OUTPUT_TOKENS = 128, 64
PREDICTED = re.compile(r"predicted time to first token ([\d.]+) s")


async def one(session: aiohttp.ClientSession, url: str, prompt: list[int]) -> tuple[str, float | None]:
    """("ok", TTFT s) or ("refused", predicted TTFT s or None) or ("error: ...", None)."""
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": OUTPUT_TOKENS, "temperature": 0, "stream": True,
            "ignore_eos": True}
    start = time.perf_counter()
    async with session.post(f"{url}/v1/completions", json=body, headers={"x-tandem-slo-class": "interactive"}) as r:
        if r.status == 429:
            found = PREDICTED.search(await r.text())
            return "refused", float(found.group(1)) if found else None
        if r.status != 200:
            return f"error: HTTP {r.status}", None
        first = None
        async for line in r.content:  # read to the end: the request holds its worker until then
            if first is None and line.startswith(b"data: {") and json.loads(line[6:])["choices"]:
                first = time.perf_counter() - start
        return "ok", first


async def point(url: str, concurrency: int, requests: int, rng: random.Random) -> dict:
    prompts = [[rng.randrange(1000, 30000) for _ in range(PROMPT_TOKENS)] for _ in range(requests)]
    results: list[tuple[str, float | None]] = []
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        queue = list(prompts)

        async def client():
            while queue:
                results.append(await one(session, url, queue.pop()))

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return summary(results)


async def burst(url: str, size: int, prefix_len: int, rng: random.Random) -> dict:
    """`size` requests sent together behind one new prefix of `prefix_len` tokens, 16 tokens of their own each."""
    prefix = [rng.randrange(1000, 30000) for _ in range(prefix_len)]
    prompts = [prefix + [rng.randrange(1000, 30000) for _ in range(16)] for _ in range(size)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        results = await asyncio.gather(*(one(session, url, p) for p in prompts))
    return summary(results)


def summary(results: list[tuple[str, float | None]]) -> dict:
    ttft = [v for kind, v in results if kind == "ok" and v is not None]
    predicted = [v for kind, v in results if kind == "refused" and v is not None]
    return {"admitted": sum(kind == "ok" for kind, _ in results), "refused": sum(kind == "refused" for kind, _ in results),
            "errors": sorted({kind for kind, _ in results if kind.startswith("error")}),
            "ttft_p50": float(np.percentile(ttft, 50)) if ttft else None,
            "ttft_p99": float(np.percentile(ttft, 99)) if ttft else None,
            "ttft_max": max(ttft) if ttft else None,
            "predicted": statistics.median(predicted) if predicted else None}


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=32, help="measured requests per concurrency")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--server-pythonpath", help="run the stack from this folder's tandem package (before/after)")
    ap.add_argument("--burst", type=int, help="send bursts of this many requests behind one new shared prefix")
    ap.add_argument("--shared-prefix", type=int, default=300, help="the bursts' shared prefix, in tokens")
    ap.add_argument("--bursts", type=int, default=3)
    args = ap.parse_args()
    env = {"PYTHONPATH": args.server_pythonpath} if args.server_pythonpath else None
    stack = ServiceProcess(["serve", "--model", "smollm2", "--kv-transfer", "tcp"], name="admission-serve", env=env)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.machine())
    print(f"CPU: {cpu}, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.2f}; tandem serve (1 prefill + 1 decode SmolLM2 worker) from "
          f"{args.server_pythonpath or 'this checkout'}; {PROMPT_TOKENS}-token prompts of random ids, "
          f"{OUTPUT_TOKENS} output tokens, greedy, ignore_eos, streamed; class interactive (TTFT target 1 s); "
          f"closed loop, {args.requests} requests per concurrency after 2 warm-up")
    try:
        stack.start().wait_ready(300)
        rng = random.Random(0)
        await point(stack.url, 1, 2, rng)  # warm-up: the first requests' compile and cache effects
        if args.burst:
            print(f"bursts of {args.burst} requests at once, each burst behind a new {args.shared_prefix}-token prefix"
                  f" + 16 tokens of each request's own")
            print(f"{'burst':>5} {'admitted':>9} {'TTFT p50':>9} {'TTFT max':>9} {'refused':>8} "
                  f"{'predicted TTFT of the refused (median)':>40}")
            for i in range(args.bursts):
                r = await burst(stack.url, args.burst, args.shared_prefix, rng)
                print(f"{i + 1:>5} {r['admitted']:>5}/{args.burst:<3} {ms(r['ttft_p50']):>9} {ms(r['ttft_max']):>9} "
                      f"{r['refused']:>8} {ms(r['predicted']):>40}" + (f"  {r['errors']}" if r["errors"] else ""))
            return
        print(f"{'concurrency':>11} {'admitted':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'refused':>8} "
              f"{'predicted TTFT of the refused (median)':>40}")
        for c in args.concurrency:
            r = await point(stack.url, c, args.requests, rng)
            print(f"{c:>11} {r['admitted']:>5}/{args.requests:<3} {ms(r['ttft_p50']):>9} {ms(r['ttft_p99']):>9} "
                  f"{r['refused']:>8} {ms(r['predicted']):>40}" + (f"  {r['errors']}" if r["errors"] else ""))
    finally:
        stack.stop()


if __name__ == "__main__":
    asyncio.run(main())
