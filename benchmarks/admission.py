"""What the router's SLO admission admits and refuses on real workers: `tandem serve` (one prefill and one decode
SmolLM2 worker on this machine's CPU), and whether the requests it admits meet their targets.

Scenarios (--scenario):
  closed    closed-loop load in the `interactive` class (TTFT target 1 s) at each --concurrency: admitted, their
            TTFT, and the TTFT the router predicted for the refused
  burst     --burst N requests at once behind a new --shared-prefix, --bursts times
  cold      a stack just started, then prompts of growing length one at a time (interactive): which are refused,
            and the admitted ones' TTFT against the 1 s target
  overload  mixed interactive and batch streams arriving at --overload x the stack's capacity (open loop,
            --duration s), once with admission on and once off (first come, first served) on fresh stacks with
            the same arrivals: SLO attainment of the admitted (TTFT, worst inter-token gap, both), goodput,
            refusals. Capacity: the request rate a closed loop of --max-num-seqs streams of the same mix sustains
            with admission off.

    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/admission.py --scenario overload [--overload 2] [--duration 60]

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

from tandem.runtimes.launcher import ServiceProcess

PROMPT_TOKENS, OUTPUT_TOKENS = 128, 64
PREDICTED = re.compile(r"predicted time to first token ([\d.]+) s")
TARGETS = {"interactive": (1.0, 0.1), "batch": (30.0, 1.0)}  # the default classes' (TTFT, ITL) targets
# The overload mix: (class, prompt tokens, max_tokens), drawn with equal odds.
MIX = [("interactive", 64, 32), ("batch", 64, 128)]


async def one(session: aiohttp.ClientSession, url: str, prompt: list[int], slo: str = "interactive",
              max_tokens: int = OUTPUT_TOKENS) -> dict:
    """{"kind": "ok", "ttft", "worst_gap"} or {"kind": "refused", "reason", "predicted"} or {"kind": "error: ..."}."""
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    start = time.perf_counter()
    async with session.post(f"{url}/v1/completions", json=body, headers={"x-tandem-slo-class": slo}) as r:
        if r.status == 429:
            error = (await r.json())["error"]
            found = PREDICTED.search(error["message"])
            return {"kind": "refused", "reason": error.get("code"), "predicted": float(found.group(1)) if found else None}
        if r.status != 200:
            return {"kind": f"error: HTTP {r.status}"}
        first = last = None
        worst = 0.0
        async for line in r.content:  # read to the end: the request holds its worker until then
            if line.startswith(b"data: {") and json.loads(line[6:])["choices"]:
                now = time.perf_counter()
                if first is None:
                    first = now - start
                else:
                    worst = max(worst, now - last)
                last = now
        return {"kind": "ok", "ttft": first, "worst_gap": worst, "slo": slo}


def session() -> aiohttp.ClientSession:
    # No connection limit: aiohttp's default of 100 would hold requests back in this client, unseen by the router.
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900), connector=aiohttp.TCPConnector(limit=0))


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(1000, 30000) for _ in range(length)]


def summary(results: list[dict]) -> dict:
    ttft = [r["ttft"] for r in results if r["kind"] == "ok" and r["ttft"] is not None]
    predicted = [r["predicted"] for r in results if r["kind"] == "refused" and r["predicted"] is not None]
    return {"admitted": sum(r["kind"] == "ok" for r in results),
            "refused": sum(r["kind"] == "refused" for r in results),
            "errors": sorted({r["kind"] for r in results if r["kind"].startswith("error")}),
            "ttft_p50": float(np.percentile(ttft, 50)) if ttft else None,
            "ttft_p99": float(np.percentile(ttft, 99)) if ttft else None,
            "ttft_max": max(ttft) if ttft else None,
            "predicted": statistics.median(predicted) if predicted else None}


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def start_stack(args, *extra: str) -> ServiceProcess:
    env = {"PYTHONPATH": args.server_pythonpath} if args.server_pythonpath else None
    stack = ServiceProcess(["serve", "--model", "smollm2", "--kv-transfer", "tcp", *extra], name="admission-serve",
                           env=env)
    stack.start().wait_ready(300)
    return stack


async def closed(args, url: str, rng: random.Random) -> None:
    print(f"closed loop, {PROMPT_TOKENS}-token prompts, {OUTPUT_TOKENS} output tokens, class interactive, "
          f"{args.requests} requests per concurrency")
    print(f"{'concurrency':>11} {'admitted':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'refused':>8} "
          f"{'predicted TTFT of the refused (median)':>40}")
    for c in args.concurrency:
        r = summary(await closed_point(url, c, [random_prompt(rng, PROMPT_TOKENS) for _ in range(args.requests)]))
        print(f"{c:>11} {r['admitted']:>5}/{args.requests:<3} {ms(r['ttft_p50']):>9} {ms(r['ttft_p99']):>9} "
              f"{r['refused']:>8} {ms(r['predicted']):>40}" + (f"  {r['errors']}" if r["errors"] else ""))


async def closed_point(url: str, concurrency: int, prompts: list[list[int]]) -> list[dict]:
    """`prompts` sent by `concurrency` clients, each sending its next once its last is answered."""
    results: list[dict] = []
    async with session() as s:
        async def client():
            while prompts:
                results.append(await one(s, url, prompts.pop()))
        await asyncio.gather(*(client() for _ in range(concurrency)))
    return results


async def bursts(args, url: str, rng: random.Random) -> None:
    print(f"bursts of {args.burst} requests at once, each burst behind a new {args.shared_prefix}-token prefix"
          f" + 16 tokens of each request's own")
    print(f"{'burst':>5} {'admitted':>9} {'TTFT p50':>9} {'TTFT max':>9} {'refused':>8} "
          f"{'predicted TTFT of the refused (median)':>40}")
    for i in range(args.bursts):
        prefix = random_prompt(rng, args.shared_prefix)
        async with session() as s:
            results = await asyncio.gather(*(one(s, url, prefix + random_prompt(rng, 16))
                                             for _ in range(args.burst)))
        r = summary(results)
        print(f"{i + 1:>5} {r['admitted']:>5}/{args.burst:<3} {ms(r['ttft_p50']):>9} {ms(r['ttft_max']):>9} "
              f"{r['refused']:>8} {ms(r['predicted']):>40}" + (f"  {r['errors']}" if r["errors"] else ""))


async def cold(url: str, rng: random.Random) -> None:
    print("a stack just started: prompts one at a time, class interactive (TTFT target 1 s), 4 output tokens")
    print(f"{'prompt':>7} {'answer':>9} {'TTFT':>8} {'predicted TTFT (refused)':>25}")
    within = admitted = 0
    async with session() as s:
        for length in (16, 64, 256, 512, 1024, 2000, 4000, 128):
            r = await one(s, url, random_prompt(rng, length), max_tokens=4)
            if r["kind"] == "ok":
                admitted += 1
                within += r["ttft"] <= 1.0
            print(f"{length:>7} {r['kind'] if r['kind'] != 'refused' else r['reason']:>9} "
                  f"{ms(r.get('ttft')):>8} {ms(r.get('predicted')):>25}")
    print(f"admitted within the 1 s target: {within} of {admitted}")


def arrivals(rate: float, duration: float, seed: int) -> list[tuple[float, str, int, int]]:
    """An open-loop schedule: (send at s, class, prompt tokens, max_tokens), Poisson arrivals of the mix."""
    rng = random.Random(seed)
    t, out = 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return out
        out.append((t, *rng.choice(MIX)))


async def run_schedule(url: str, schedule, seed: int) -> list[dict]:
    rng = random.Random(seed + 1)
    prompts = [random_prompt(rng, n) for _, _, n, _ in schedule]
    async with session() as s:
        t0 = time.perf_counter()

        async def fire(at, slo, prompt, max_tokens):
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            return await one(s, url, prompt, slo, max_tokens)

        return await asyncio.gather(*(fire(at, slo, p, m) for (at, slo, _, m), p in zip(schedule, prompts)))


async def capacity(url: str, streams: int, seconds: float, seed: int) -> float:
    """Requests per second a closed loop of `streams` clients of the mix sustains."""
    rng = random.Random(seed)
    done = 0
    deadline = time.perf_counter() + seconds
    async with session() as s:
        async def client():
            nonlocal done
            while time.perf_counter() < deadline:
                slo, n, m = rng.choice(MIX)
                if (await one(s, url, random_prompt(rng, n), slo, m))["kind"] == "ok":
                    done += 1
        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(streams)))
        return done / (time.perf_counter() - start)


def attainment(results: list[dict], duration: float) -> dict:
    ok = [r for r in results if r["kind"] == "ok"]
    ttft_ok = [r["ttft"] <= TARGETS[r["slo"]][0] for r in ok]
    itl_ok = [r["worst_gap"] <= TARGETS[r["slo"]][1] for r in ok]
    both = sum(a and b for a, b in zip(ttft_ok, itl_ok, strict=True))
    reasons: dict[str, int] = {}
    for r in results:
        if r["kind"] == "refused":
            reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
    share = (lambda n: f"{100 * n / len(ok):.1f}%") if ok else (lambda n: "-")
    by_class = {slo: (sum(r["slo"] == slo for r in ok),
                      sum(a and b for r, a, b in zip(ok, ttft_ok, itl_ok, strict=True) if r["slo"] == slo))
                for slo in TARGETS}
    return {"offered": len(results), "admitted": len(ok), "refused": reasons, "by_class": by_class,
            "errors": sorted({r["kind"] for r in results if r["kind"].startswith("error")}),
            "ttft_ok": share(sum(ttft_ok)), "itl_ok": share(sum(itl_ok)), "both_ok": share(both),
            "goodput": both, "goodput_rps": both / duration}


async def overload(args) -> None:
    extra = ["--disagg-min-tokens", "16", "--max-num-seqs", str(args.max_num_seqs)]
    print(f"overload: {'/'.join(f'{c} {n}+{m}' for c, n, m in MIX)} (class prompt+max_tokens, equal odds), "
          f"greedy, ignore_eos, streamed; P/D from 16 tokens, decode worker max_num_seqs {args.max_num_seqs}")
    stack = start_stack(args, *extra, "--admission", "off")  # what the stack serves, nothing refused
    try:
        rate = await capacity(stack.url, args.max_num_seqs, args.capacity_s, args.seed)
    finally:
        stack.stop()
    offered = args.overload * rate
    schedule = arrivals(offered, args.duration, args.seed)
    print(f"capacity (closed loop of {args.max_num_seqs} streams, {args.capacity_s:g} s): {rate:.2f} requests/s; "
          f"offered {args.overload:g}x = {offered:.2f} requests/s for {args.duration:g} s ({len(schedule)} requests)")
    rows = {}
    for mode in ("slo", "off"):
        stack = start_stack(args, *extra, "--admission", mode)
        try:
            results = await run_schedule(stack.url, schedule, args.seed)
        finally:
            stack.stop()
        rows[mode] = attainment(results, args.duration)
    print(f"{'admission':>9} {'offered':>8} {'admitted':>9} {'TTFT ok':>8} {'ITL ok':>7} {'both ok':>8} "
          f"{'goodput':>8} {'goodput/s':>10}  refused")
    for mode, r in rows.items():
        print(f"{mode:>9} {r['offered']:>8} {r['admitted']:>9} {r['ttft_ok']:>8} {r['itl_ok']:>7} {r['both_ok']:>8} "
              f"{r['goodput']:>8} {r['goodput_rps']:>10.2f}  {r['refused'] or '-'}"
              + (f"  {r['errors']}" if r["errors"] else ""))
    for mode, r in rows.items():
        print(f"{mode:>9} by class (admitted, within both): "
              + ", ".join(f"{slo} {n}, {both}" for slo, (n, both) in r["by_class"].items()))
    fcfs = rows["off"]["goodput"]
    print(f"goodput, admission on vs off: {rows['slo']['goodput'] / fcfs:.2f}x" if fcfs else
          "goodput with admission off: none")


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", choices=["closed", "burst", "cold", "overload"], default="closed")
    ap.add_argument("--requests", type=int, default=32, help="closed: measured requests per concurrency")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--server-pythonpath", help="run the stack from this folder's tandem package (before/after)")
    ap.add_argument("--burst", type=int, default=16, help="burst: requests per burst, behind one new shared prefix")
    ap.add_argument("--shared-prefix", type=int, default=300, help="burst: the shared prefix, in tokens")
    ap.add_argument("--bursts", type=int, default=3)
    ap.add_argument("--overload", type=float, default=2.0, help="overload: offered load as a multiple of capacity")
    ap.add_argument("--duration", type=float, default=60.0, help="overload: seconds of arrivals")
    ap.add_argument("--capacity-s", type=float, default=30.0, help="overload: seconds the capacity is measured")
    ap.add_argument("--max-num-seqs", type=int, default=16, help="overload: the workers' max_num_seqs")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.machine())
    print(f"CPU: {cpu}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; tandem serve (1 prefill + "
          f"1 decode SmolLM2 worker) from {args.server_pythonpath or 'this checkout'}; targets: interactive TTFT 1 s "
          "ITL 0.1 s, batch 30 s / 1 s")
    if args.scenario == "overload":
        await overload(args)
        return
    stack = start_stack(args)
    try:
        rng = random.Random(args.seed)
        if args.scenario == "cold":
            await cold(stack.url, rng)
            return
        async with session() as s:  # warm-up: the first requests' compile and cache effects
            await one(s, stack.url, random_prompt(rng, PROMPT_TOKENS))
        await (bursts(args, stack.url, rng) if args.scenario == "burst" else closed(args, stack.url, rng))
    finally:
        stack.stop()


if __name__ == "__main__":
    asyncio.run(main())
