"""Starts a worker process: load the model, start the engine thread, serve HTTP until SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import uuid

import torch
import uvicorn

from tandem.config import WorkerConfig
from tandem.metrics import EngineMetrics
from tandem.runtimes.launcher import free_port, port_in_use
from tandem.server.graceful import AnswerOnShutdown, GracefulServer
from tandem.server.heap import settle_heap
from tandem.workers.async_engine import AsyncEngine
from tandem.workers.engine.calibration import calibrate
from tandem.workers.engine.llm_engine import LLMEngine, load_engine_model, resolve_device
from tandem.workers.internal_api import start_draining
from tandem.workers.kv_transfer import create_kv_transfer
from tandem.workers.models.loader import load_engine_config
from tandem.workers.server import ServingContext, build_app
from tandem.workers.tensor_parallel import (
    TPGroup,
    check_sizes,
    device_for,
    exit_on_loss,
    init_process_group,
    start_followers,
    watch,
)

log = logging.getLogger("tandem.worker")


class _Server(GracefulServer):
    """uvicorn, plus the one line saying where we listen once the socket is really bound, and a drain before
    uvicorn's shutdown."""

    def __init__(self, config: uvicorn.Config, banner: str, ctx: ServingContext):
        super().__init__(config)
        self.banner = banner
        self.ctx = ctx

    async def shutdown(self, sockets=None):
        """uvicorn's shutdown closes every WebSocket at once (code 1012) and only then gives HTTP requests their
        grace; a router's requests to this worker all travel on its one WebSocket, so they were cut at once. So the
        worker drains first: it leaves rotation (/ready 503, as `tandem drain` makes it) and, within the grace, waits
        for its requests and for the leases decode workers are pulling. What is left then gets uvicorn's shutdown."""
        await start_draining(self.ctx)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.timeout_graceful_shutdown
        leases = self.ctx.engine.engine.leases  # read from this thread: a length, read whole under the GIL
        # The engine lets go of a request before its last event is written out; the channel's own count ends after.
        while (self.ctx.engine.num_in_flight or self.ctx.channel_answering or len(leases)) \
                and loop.time() < deadline and not self.force_exit:
            await asyncio.sleep(0.05)
        self.config.timeout_graceful_shutdown = max(deadline - loop.time(), 0.1)  # one grace in all
        await super().shutdown(sockets)

    async def startup(self, sockets=None):
        await super().startup(sockets)
        if self.started:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            print(f"{self.banner} listening on http://{host}:{port}", flush=True)


def build_worker(config: WorkerConfig) -> tuple[ServingContext, AsyncEngine]:
    ec = config.engine
    try:
        loaded = load_engine_model(ec, start_tensor_parallel(ec))
    except ValueError as exc:  # settings this checkpoint cannot serve: one line, not a traceback
        raise SystemExit(f"tandem worker: {exc}") from None
    if loaded.tokenizer is None:
        raise SystemExit(f"{ec.model} has no tokenizer (tokenizer.json or GGUF metadata); cannot serve it")
    served = ec.served_model_name or loaded.config.name
    metrics = EngineMetrics(model=served, pool=config.role)
    try:
        engine = LLMEngine(loaded, ec, metrics)
    except ValueError as exc:  # settings that cannot serve this model (a context past it or past the KV cache)
        raise SystemExit(f"tandem worker: {exc}") from None
    # Every role gets a transfer agent: prefill workers are read from, decode workers read, and a
    # "both" worker can be either. Its name is unique per process, so a restarted peer is noticed.
    engine.kv_transfer = create_kv_transfer(ec.kv_transfer, engine.runner.kv_cache,
                                            f"tandem-{config.role}-{uuid.uuid4().hex[:8]}", host=config.host,
                                            lanes=ec.kv_transfer_lanes, authorize=engine.leases.covers)
    cost = calibrate(engine)  # before it is ready: routers predict its latencies from the first request
    log.info("step cost model: %s", ", ".join(f"{k} {v:.3g}" for k, v in cost.to_dict().items()))
    async_engine = AsyncEngine(engine)
    ctx = ServingContext(async_engine, loaded.tokenizer, served, engine.max_model_len, config, metrics,
                         engine.layout, engine.kv_transfer)
    return ctx, async_engine


def start_tensor_parallel(ec) -> TPGroup | None:
    """With --tensor-parallel-size N > 1: starts ranks 1..N-1 and joins them as rank 0, after checking the sizes
    against the model and the devices (SystemExit naming both numbers otherwise); None for N = 1."""
    size = ec.tensor_parallel_size
    if size == 1:
        return None
    try:
        config = load_engine_config(ec.model)
        check_sizes(size, config.num_heads, config.num_kv_heads, config.intermediate_size)
    except ValueError as exc:
        raise SystemExit(f"tandem worker: {exc}") from None
    device, _ = resolve_device(ec)
    if device == "cuda" and torch.cuda.device_count() < size:
        raise SystemExit(f"tandem worker: --tensor-parallel-size {size} needs {size} GPUs, this machine has "
                         f"{torch.cuda.device_count()}")
    port = free_port()
    followers = start_followers(size, port, ec.model_dump_json())
    group = init_process_group(0, size, port, device_for(0, torch.device(device)))
    watch(followers, exit_on_loss)
    log.info("tensor-parallel group of %d ranks ready", size)
    return group


def _engine_summary(async_engine: AsyncEngine) -> str:
    """Device, dtype, attention backend and GEMV weights as resolved from "auto": what a user needs to know
    is serving."""
    runner = async_engine.engine.runner
    summary = f"{runner.device.type} {str(runner.dtype).removeprefix('torch.')}, attention {runner.model.ops.backend}"
    if runner.kv_cache.dtype != runner.dtype:
        summary += f", KV cache {str(runner.kv_cache.dtype).removeprefix('torch.')}"
    if runner.tp is not None:
        summary += f", tensor parallel {runner.tp.size}"
    if runner.model.gguf_block_gemms:
        summary += f", {runner.model.gguf_block_gemms} GEMMs from GGUF blocks at small batches"
    return summary


def run_worker(config: WorkerConfig, log_level: str = "info") -> int:
    if config.port and port_in_use(config.host, config.port):  # said now, not after loading the model
        raise SystemExit(f"tandem worker: port {config.port} on {config.host} is in use; choose another with --port")
    ctx, async_engine = build_worker(config)
    log.info(settle_heap(ctx.metrics.gc_pauses))  # the model's code and data, frozen out of collections (tandem.server.heap)
    async_engine.start()
    app = build_app(ctx)
    server = _Server(uvicorn.Config(AnswerOnShutdown(app), host=config.host, port=config.port, log_level=log_level,
                                    access_log=False, timeout_graceful_shutdown=5),
                     banner=f"tandem worker (role {config.role}, model {ctx.served_name}, {_engine_summary(async_engine)})",
                     ctx=ctx)
    try:
        server.run()  # handles SIGINT/SIGTERM: stops accepting, finishes responses, returns
    finally:
        async_engine.stop()
        tp = async_engine.engine.runner.tp
        if tp is not None and async_engine.error is None:
            tp.broadcast(None)  # the followers' loops end
        if ctx.kv_transfer is not None:
            ctx.kv_transfer.close()
    return 0
