"""What P/D adds to a request's latency, against colocated serving, on real worker processes.

Three SmolLM2 workers on 127.0.0.1: prefill, decode, and a colocated one (role both). For a
long prompt (default 4,096 tokens), each run measures from the client:
  colocated : time to first token, and to the second token, from one worker doing everything;
  P/D       : time to first token (the prefill worker's answer), and to the second token (decode
              worker: pulls the prompt's KV, then computes one step).
TTFT added by P/D = P/D TTFT - colocated TTFT; the KV transfer shows in the second token.
Best of --repeats; a fresh prompt each repeat, so neither side hits its prefix cache.

    PYTHONSAFEPATH=1 .venv/bin/python benchmarks/pd_ttft.py [--tokens 4096] [--backend nixl|tcp]
"""

from __future__ import annotations

import argparse
import os
import random
import time

import httpx

from tandem.runtimes.launcher import ServiceProcess
from tandem.server.internal_auth import internal_headers
from tandem.server.sse import parse_sse_line

SAMPLING = {"temperature": 0, "max_tokens": 2, "ignore_eos": True}


def stream_times(url: str, body: dict, start: float) -> list[float]:
    """Seconds from `start` at which each decode chunk with tokens arrived."""
    times = []
    with httpx.stream("POST", url + "/internal/decode", json=body, timeout=600, headers=internal_headers()) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            chunk = parse_sse_line(line)
            if chunk and chunk.get("token_ids"):
                times += [time.perf_counter() - start] * len(chunk["token_ids"])
    return times


def colocated(url: str, rid: str, prompt: list[int]) -> tuple[float, float]:
    start = time.perf_counter()
    times = stream_times(url, {"request_id": rid, "prompt_token_ids": prompt, "sampling": SAMPLING}, start)
    return times[0], times[1]


def disaggregated(p_url: str, d_url: str, rid: str, prompt: list[int]) -> tuple[float, float, str]:
    start = time.perf_counter()
    pre = httpx.post(p_url + "/internal/prefill", json={"request_id": rid, "prompt_token_ids": prompt,
                                                        "sampling": SAMPLING}, timeout=600, headers=internal_headers()).json()
    ttft = time.perf_counter() - start
    body = {"request_id": rid, "prompt_token_ids": prompt, "first_token_id": pre["first_token_id"],
            "kv_handle": pre["kv_handle"], "sampling": SAMPLING}
    second = None
    with httpx.stream("POST", d_url + "/internal/decode", json=body, timeout=600, headers=internal_headers()) as r:
        for line in r.iter_lines():
            chunk = parse_sse_line(line)
            if chunk and chunk.get("token_ids"):
                second = time.perf_counter() - start
                source = chunk.get("kv_source")
                break
    return ttft, second, source


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backend", default="nixl", choices=["nixl", "tcp"])
    args = ap.parse_args()
    common = ["--model", "smollm2", "--kv-transfer", args.backend, "--num-kv-blocks", str(args.tokens // 16 * 4),
              "--max-num-batched-tokens", "2048"]
    procs = [ServiceProcess(["worker", "--role", role, *common], name=role) for role in ("prefill", "decode", "both")]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.wait_ready()
        p, d, c = procs
        rng = random.Random(0)
        rows = []
        for i in range(args.repeats + 1):  # the first round warms up both paths
            prompt = [rng.randrange(100, 40000) for _ in range(args.tokens)]
            co = colocated(c.url, f"co{i}", prompt)
            pd = disaggregated(p.url, d.url, f"pd{i}", prompt)
            if i:
                rows.append((co, pd))
        best_co = min(r[0][0] for r in rows), min(r[0][1] for r in rows)
        best_pd = min(r[1][0] for r in rows), min(r[1][1] for r in rows)
        sources = {r[1][2] for r in rows}
        print("== conditions ==")
        print(f"SmolLM2-135M float32 on CPU ({os.cpu_count()} cores, shared by all three workers), prompt "
              f"{args.tokens} tokens, KV {args.tokens * 30 * 2 * 3 * 64 * 4 / 2**20:.0f} MiB, backend {args.backend}, "
              f"best of {args.repeats}; kv_source {sources}")
        print(f"colocated : TTFT {best_co[0] * 1000:8.1f} ms   2nd token at {best_co[1] * 1000:8.1f} ms")
        print(f"P/D       : TTFT {best_pd[0] * 1000:8.1f} ms   2nd token at {best_pd[1] * 1000:8.1f} ms")
        print(f"added by P/D: TTFT {1000 * (best_pd[0] - best_co[0]):+.1f} ms, "
              f"2nd token {1000 * (best_pd[1] - best_co[1]):+.1f} ms (includes the KV pull)")
    finally:
        for proc in procs:
            proc.stop()


if __name__ == "__main__":
    main()
