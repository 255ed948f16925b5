"""The load generator: a concurrency or rate sweep against an OpenAI-compatible server.

Each sweep value is one point: `warmup + requests` requests with lengths drawn from the distributions
(a fresh, seeded draw per point), sent either closed-loop (C workers, each sending its next request as soon as
the previous one ends) or open-loop (sent at the arrival process's times, whatever the server's state).
"""

from __future__ import annotations

import asyncio
import os
import platform
import socket
import time
from datetime import datetime, timezone
from typing import TextIO

import httpx
import numpy as np

import tandem
from tandem.bench.client import RequestRecord, request_body, send_streaming
from tandem.bench.config import BenchConfig
from tandem.bench.distributions import arrival_times, parse_distribution
from tandem.bench.progress import ProgressBar
from tandem.bench.prompts import PromptFactory, parse_token_id_range
from tandem.bench.report import analyze
from tandem.bench.summary import summarize_point

# Servers that take vLLM's `ignore_eos` (from /v1/models owned_by).
IGNORE_EOS_SERVERS = ("tandem", "vllm")


async def server_info(client: httpx.AsyncClient, url: str) -> dict:
    """What /v1/models says: the first model's id, owner and context length; {} when it cannot be read (a server
    without that route). ValueError when nothing answers at `url`: a sweep would only record failures."""
    try:
        response = await client.get(url + "/v1/models")
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        raise ValueError(f"nothing answers at {url} ({type(exc).__name__}): is the server up?") from None
    except httpx.HTTPError:
        return {}
    if response.status_code in (401, 403):  # every request of the sweep would be refused too
        said = "refused the API key" if "authorization" in client.headers else "requires an API key"
        raise ValueError(f"{url} {said} (HTTP {response.status_code} on GET /v1/models): give the key with "
                         "--api-key or $OPENAI_API_KEY")
    try:
        response.raise_for_status()
        models = response.json().get("data") or []
    except (httpx.HTTPError, ValueError, AttributeError):
        return {}
    if not models:
        return {}
    first = models[0]
    return {"models": [m.get("id") for m in models], "model": first.get("id"), "owned_by": first.get("owned_by"),
            "max_model_len": first.get("max_model_len")}


def client_info() -> dict:
    return {"host": socket.gethostname(), "platform": platform.platform(), "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "tandem": tandem.__version__}


def _plan_point(cfg: BenchConfig, point: int, max_model_len: int | None) -> tuple[list[RequestRecord], list, np.random.Generator]:
    rng = np.random.default_rng([cfg.seed, point])
    total = cfg.warmup + cfg.requests
    inputs = parse_distribution(cfg.input_dist, "input").sample(rng, total)
    outputs = parse_distribution(cfg.output_dist, "output").sample(rng, total)
    if max_model_len and int((inputs + outputs).max()) > max_model_len:
        raise ValueError(f"a request of {int(inputs.max())} input + {int(outputs.max())} output tokens would "
                         f"exceed the server's max_model_len of {max_model_len}: shorten the distributions")
    factory = PromptFactory(cfg.effective_prompt_style, rng, parse_token_id_range(cfg.token_id_range))
    records = [RequestRecord(point=point, index=i, warmup=i < cfg.warmup, input_tokens=int(inputs[i]),
                             output_tokens=int(outputs[i])) for i in range(total)]
    prompts = [factory.make(r.input_tokens) for r in records]
    return records, prompts, rng


async def _closed_loop(send, records, prompts, concurrency: int) -> None:
    jobs = iter(zip(records, prompts))  # shared by the workers: each takes the next job when it is free

    async def worker():
        for record, prompt in jobs:
            await send(record, prompt)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(records)))))


async def _open_loop(send, records, prompts, times: np.ndarray, t0: float) -> None:
    async def fire(record, prompt, at):
        record.scheduled_s = float(at)
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        await send(record, prompt)

    await asyncio.gather(*(fire(r, p, at) for r, p, at in zip(records, prompts, times)))


async def run_bench(cfg: BenchConfig, progress_stream: TextIO | None = None) -> dict:
    """Run the sweep; return the result document (conditions, per-point summaries, analysis, requests)."""
    headers = {}
    api_key = cfg.api_key or os.environ.get("OPENAI_API_KEY")
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    if cfg.slo_class:
        headers["x-tandem-slo-class"] = cfg.slo_class
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=cfg.timeout, headers=headers, limits=limits) as client:
        info = await server_info(client, cfg.url)
        model = cfg.model or info.get("model")
        if not model:
            raise ValueError(f"cannot list the models of {cfg.url} (GET /v1/models): name one with --model")
        served = info.get("models") or []
        if served and model not in served:  # every request would be a 404, and the files would record only that
            raise ValueError(f"{cfg.url} does not serve --model {model!r}; it serves: {', '.join(map(str, served))}")
        ignore_eos = cfg.ignore_eos == "on" or (cfg.ignore_eos == "auto" and info.get("owned_by") in IGNORE_EOS_SERVERS)
        kind, values = cfg.sweep
        points, all_records = [], []
        for index, value in enumerate(values):
            records, prompts, rng = _plan_point(cfg, index, info.get("max_model_len"))
            label = f"{kind}={value:g}"
            progress = ProgressBar(len(records), label, progress_stream)
            t0 = time.perf_counter()

            async def send(record, prompt, progress=progress, t0=t0):
                body = request_body(cfg.endpoint, model, prompt, record.output_tokens, ignore_eos)
                await send_streaming(client, cfg.url, cfg.endpoint, body, record, t0)
                progress.advance(record.ok)

            if kind == "concurrency":
                await _closed_loop(send, records, prompts, int(value))
            else:
                times = arrival_times(cfg.arrival, value, len(records), rng, cfg.burst_size)
                await _open_loop(send, records, prompts, times, t0)
            progress.close()
            summary = summarize_point(records, int(value) if kind == "concurrency" else None,
                                      value if kind == "rate" else None, cfg.slo_ttft, cfg.slo_itl)
            points.append({"index": index, kind: value, "summary": summary})
            all_records.extend(records)

    input_dist, output_dist = parse_distribution(cfg.input_dist, "input"), parse_distribution(cfg.output_dist, "output")
    conditions = {
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "url": cfg.url,
        "model": model,
        "server": info,
        "endpoint": cfg.endpoint,
        "input_dist": input_dist.spec,
        "input_mean_tokens": input_dist.mean,
        "output_dist": output_dist.spec,
        "output_mean_tokens": output_dist.mean,
        "prompt_style": cfg.effective_prompt_style,
        "ignore_eos": ignore_eos,
        "slo_class": cfg.slo_class,
        "sweep": kind,
        "values": values,
        "arrival": cfg.arrival if kind == "rate" else None,
        "burst_size": cfg.burst_size if kind == "rate" and cfg.arrival == "burst" else None,
        "requests_per_point": cfg.requests,
        "warmup_per_point": cfg.warmup,
        "slo_ttft_s": cfg.slo_ttft,
        "slo_itl_s": cfg.slo_itl,
        "slo_percentile": cfg.slo_percentile,
        "seed": cfg.seed,
        "client": client_info(),
    }
    return {
        "tool": "tandem bench",
        "conditions": conditions,
        "points": points,
        "analysis": analyze([p["summary"] for p in points], cfg.slo_ttft, cfg.slo_itl, cfg.slo_percentile),
        "requests": [r.to_dict() for r in all_records],
    }
