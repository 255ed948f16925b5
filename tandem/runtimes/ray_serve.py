"""Ray Serve, the second runtime beside Kubernetes: the same router and workers, placed and kept up by Ray.

    serve run tandem.ray_serve:build model=smollm2 prefill=1 decode=1

Three deployments make one Serve application:
  TandemWorker    one replica per prefill or decode worker (a deployment per role). A replica runs `tandem worker`
                  as its child process, on the replica's node and GPU, exactly as a Kubernetes pod runs it: the
                  workers' data path (the router's WebSocket, KV transfers over NIXL or TCP) is the same on both
                  runtimes. Serve's health check watches the child as a pod's liveness probe does: a replica whose worker
                  exited or hangs is replaced.
  WorkerRegistry  where the workers are. Serve routes a handle call to any one replica of a deployment and has no
                  way to list them, so each worker replica says its URL here at every health check, and a URL not
                  heard from for REGISTRATION_TTL_S is forgotten. The registry is state that rebuilds itself: a
                  restarted registry knows every live worker again after one health-check period.
  TandemRouter    the ingress: the router's own app (tandem.router), in the replica, behind Serve's HTTP proxy. It
                  finds its workers in the registry at each probe round, as on Kubernetes it lists EndpointSlices.
Router replicas share nothing: as on Kubernetes, any number of them map prefixes to the same workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import time

import httpx
from pydantic import BaseModel, Field, field_validator

from tandem.cli.args import options_to_args
from tandem.config import EngineConfig, RouterConfig
from tandem.runtimes.launcher import ServiceProcess
from tandem.server.internal_auth import INTERNAL_TOKEN_ENV

try:
    import ray
    from ray import serve
except ImportError as exc:  # the `ray` extra
    raise ImportError("tandem.runtimes.ray_serve needs Ray Serve: pip install 'tandem[ray]'") from exc

log = logging.getLogger("tandem.runtimes.ray_serve")

HEALTH_CHECK_PERIOD_S = 2.0  # also how often a worker replica registers its URL
REGISTRATION_TTL_S = 3 * HEALTH_CHECK_PERIOD_S + 4  # a few missed health checks, then the URL is forgotten
REGISTRY_CALL_TIMEOUT_S = 2.0  # a registry that takes longer is restarting or stalled: asked again next round
WORKER_HEALTH_TIMEOUT_S = 5.0  # as the pods' liveness probe (tandem.operator.builders)
WORKER_START_TIMEOUT_S = 900.0  # loading a large model from a network volume takes minutes
# Ray's CPU reservations, a scheduling matter: the worker's engine and the router use what cores there are. Kept
# small, so that a router and a prefill and a decode worker fit a two-core laptop.
ROUTER_CPUS = 0.5


class TandemRayArgs(BaseModel):
    """What `serve run tandem.ray_serve:build key=value ...` (or a Serve config file's `args`) takes."""

    model: str = Field("smollm2", description="model source, as `tandem worker --model`")
    prefill: int = Field(1, ge=0, description="prefill worker replicas (0: every worker serves both phases)")
    decode: int = Field(1, ge=1, description="decode worker replicas (colocated workers when prefill is 0)")
    disagg_min_tokens: int = Field(512, ge=0, description="shorter prompts are served by a decode worker alone")
    router_replicas: int = Field(1, ge=1, description="router replicas behind Serve's HTTP proxy")
    num_gpus_per_worker: float | None = Field(None, ge=0, description="GPUs each worker replica reserves; default: "
                                              "1 where there are GPUs, else 0 (_gpus_per_worker)")
    num_cpus_per_worker: float = Field(0.5, ge=0, description="CPUs each worker replica reserves (a scheduling "
                                       "matter: the engine uses the cores there are)")
    engine: dict = Field(default_factory=dict, description="worker engine settings: EngineConfig's fields, e.g. "
                         '{"max_model_len": 4096, "kv_transfer": "nixl"}')
    router: dict = Field(default_factory=dict, description="router settings: RouterConfig's fields, e.g. "
                         '{"max_input_tokens": 4096}')

    @field_validator("engine", "router", mode="before")
    @classmethod
    def _json_from_command_line(cls, value):
        """`serve run ... engine='{"max_model_len": 4096}'` passes a string; a Serve config file a mapping."""
        return json.loads(value) if isinstance(value, str) else value


def _pool(role: str) -> str:
    """The router's pool a worker of `role` is in: a colocated ("both") worker serves whole requests, as decode
    workers do."""
    return "prefill" if role == "prefill" else "decode"


# Its calls, one per worker and per router every few seconds, are left out of the access log.
@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0}, logging_config={"enable_access_log": False})
class WorkerRegistry:
    """role -> {url: when it was last heard of}. Called by worker replicas (register, forget) and routers (members)."""

    def __init__(self):
        self._heard: dict[str, dict[str, float]] = {"prefill": {}, "decode": {}}
        self._started = time.monotonic()

    def register(self, role: str, url: str) -> None:
        self._heard[_pool(role)][url] = time.monotonic()

    def forget(self, role: str, url: str) -> None:
        self._heard[_pool(role)].pop(url, None)

    def members(self) -> tuple[list[str], list[str], float]:
        """The prefill and the decode URLs heard from within REGISTRATION_TTL_S, and how long this registry has been
        up: one younger than REGISTRATION_TTL_S may not have heard from every worker yet."""
        now = time.monotonic()
        for heard in self._heard.values():
            for url in [u for u, t in heard.items() if t < now - REGISTRATION_TTL_S]:
                del heard[url]
        return sorted(self._heard["prefill"]), sorted(self._heard["decode"]), now - self._started


@ray.remote(num_cpus=0)
class _TokenKeeper:
    """The application's internal token (tandem.server.internal_auth), made once: a detached actor outlives redeploys, so
    that old and new replicas, side by side during a rolling update, accept each other's calls."""

    def __init__(self):
        self.value = secrets.token_urlsafe(32)

    def token(self) -> str:
        return self.value


async def _internal_token() -> str:
    """$TANDEM_INTERNAL_TOKEN where the replica runs (a Serve config's runtime_env may set it), else the
    application's own. Either way it never travels in the application's arguments, which Serve shows."""
    if os.environ.get(INTERNAL_TOKEN_ENV):
        return os.environ[INTERNAL_TOKEN_ENV]
    keeper = _TokenKeeper.options(name=f"internal-token-{serve.get_replica_context().app_name}", namespace="tandem",
                                  lifetime="detached", get_if_exists=True).remote()
    return await keeper.token.remote()


@serve.deployment(health_check_period_s=HEALTH_CHECK_PERIOD_S, health_check_timeout_s=10,
                  graceful_shutdown_timeout_s=40)
class TandemWorker:
    """One `tandem worker` process on this replica's node, reachable by the other nodes at the node's address."""

    async def __init__(self, registry, role: str, worker_args: list[str]):
        self.registry, self.role = registry, role
        # The worker also serves KV transfers on this address (its NIXL or TCP agent binds it).
        self.process = ServiceProcess(["worker", "--role", role, *worker_args], name=f"{role}-worker",
                                      env={INTERNAL_TOKEN_ENV: await _internal_token()},
                                      host=ray.util.get_node_ip_address())
        # Started on the replica's event loop thread, which lives as long as the replica: the child dies with the
        # thread that started it (PR_SET_PDEATHSIG, tandem.runtimes.launcher), so not on a pool thread that may end first.
        self.process.start()
        log.info("tandem %s worker starting on %s, log %s", role, self.process.url, self.process.log.name)
        await asyncio.to_thread(self.process.wait_ready, WORKER_START_TIMEOUT_S)
        await self._register()

    async def check_health(self) -> None:
        """Serve's health check, as a pod's liveness probe: a worker that exited, or does not answer /health (hung),
        fails it, and Serve replaces this replica after three failures. A live one says its URL again (the registry
        may be new, or have forgotten it during a long pause), without waiting on a registry that is slow itself."""
        if self.process.proc.poll() is not None:
            raise RuntimeError(f"the {self.role} worker on {self.process.url} exited with "
                               f"{self.process.proc.returncode}:\n{self.process.log_tail(1500)}")
        try:
            async with httpx.AsyncClient(timeout=WORKER_HEALTH_TIMEOUT_S) as http:
                (await http.get(self.process.url + "/health")).raise_for_status()
        except httpx.HTTPError as exc:
            raise RuntimeError(f"the {self.role} worker on {self.process.url} does not answer /health: {exc!r}") from None
        await self._register()

    async def _register(self) -> None:
        with contextlib.suppress(Exception):  # a registry restarting or stalled hears of us at the next check
            await asyncio.wait_for(self.registry.register.remote(self.role, self.process.url), REGISTRY_CALL_TIMEOUT_S)

    def __del__(self):
        """Serve's shutdown of this replica (scale-down, redeploy): out of the registry first, so that routers stop
        sending, then SIGTERM, on which the worker drains its requests within its grace. Serve runs it on the
        replica's event loop, where nothing else is left to do; Python also calls it when the object goes, which
        then finds the process stopped. Synchronous: an async one is also a finalizer that is never awaited."""
        process = getattr(self, "process", None)  # None: __init__ failed before the start
        if process is None:
            return
        with contextlib.suppress(Exception):  # sent, not awaited: a registry already gone forgets the URL by its TTL
            self.registry.forget.remote(self.role, process.url)
        process.stop(30.0)


class RegistryDiscovery:
    """tandem.router.discovery's interface over the registry, called at every probe round. What a registry up for
    REGISTRATION_TTL_S lists is the membership. A younger one (restarted: it hears from each worker at its next
    health check) only adds to the workers known, and one that does not answer (restarting, stalled) changes
    nothing: neither empties the router's pools. A worker that went meanwhile is out of rotation all the same, as
    the router's own probes of it fail."""

    def __init__(self, registry):
        self.registry = registry
        self._known: tuple[list[str], list[str]] = ([], [])

    async def members(self) -> tuple[list[str], list[str]]:
        try:
            prefill, decode, age = await asyncio.wait_for(self.registry.members.remote(), REGISTRY_CALL_TIMEOUT_S)
        except Exception as exc:  # whatever the registry's trouble (restarting, stalled, gone), the pools known are kept
            log.warning("the worker registry did not answer (%r); keeping the workers known", exc)
            return self._known
        if age < REGISTRATION_TTL_S:
            prefill, decode = (sorted({*known, *listed}) for known, listed in zip(self._known, (prefill, decode)))
        self._known = (list(prefill), list(decode))
        return self._known


class _Lifespan:
    """ASGI: the router started and closed by the ASGI lifespan, which Serve runs on a replica's start and shutdown
    (as uvicorn's startup and shutdown do in `tandem router`)."""

    def __init__(self, app, router):
        self.app, self.router = app, router

    async def __call__(self, scope, receive, send):
        if scope["type"] != "lifespan":
            return await self.app(scope, receive, send)
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self.router.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.router.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


@serve.deployment(ray_actor_options={"num_cpus": ROUTER_CPUS})
@serve.ingress()
class TandemRouter:
    """The OpenAI front door: tandem.router's app, its workers from the registry."""

    async def __init__(self, registry, router_options: dict, *workers):
        """`workers`: the worker deployments' handles, bound here so that the application deploys them; the router
        reaches the workers at their URLs, as on Kubernetes."""
        from tandem.router.main import Router

        os.environ[INTERNAL_TOKEN_ENV] = await _internal_token()  # the router's calls to workers present it
        self.router = Router(RouterConfig(**router_options), discovery=RegistryDiscovery(registry))

    def __serve_build_asgi_app__(self):
        from tandem.router.app import build_app

        return _Lifespan(build_app(self.router), self.router)


def _gpus_per_worker(args: TandemRayArgs) -> float:
    """As asked; else 1 where there are GPUs: in the Ray cluster when the builder runs in one (`serve deploy`), else
    on this machine (`serve run` builds the application before it connects; with `--address` of a remote cluster,
    say num_gpus_per_worker)."""
    if args.num_gpus_per_worker is not None:
        return args.num_gpus_per_worker
    if ray.is_initialized():
        return 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
    import torch

    return 1.0 if torch.cuda.is_available() else 0.0


def build(args: TandemRayArgs) -> serve.Application:
    """The Serve application (Serve's application builder: `serve run tandem.ray_serve:build key=value ...`)."""
    if isinstance(args, dict):  # called from Python with a plain dict
        args = TandemRayArgs(**args)
    engine = EngineConfig(**{"model": args.model, **args.engine})
    router_config = RouterConfig(**{"model": args.model, "disagg_min_tokens": args.disagg_min_tokens,
                                    "block_size": engine.block_size, "served_model_name": engine.served_model_name,
                                    # the router forms the answers, so it reads their tool calls (as tandem serve)
                                    "tool_call_parser": engine.tool_call_parser,
                                    **args.router})
    registry = WorkerRegistry.bind()
    worker_args = options_to_args(engine)
    resources = {"num_gpus": _gpus_per_worker(args), "num_cpus": args.num_cpus_per_worker}
    roles = [("decode", args.decode)] if args.prefill == 0 else [("prefill", args.prefill), ("decode", args.decode)]
    # Colocated workers ("both") register as decode: the router serves whole requests on its decode pool.
    workers = [TandemWorker.options(name=f"{role.capitalize()}Worker", num_replicas=n, ray_actor_options=resources)
               .bind(registry, role if args.prefill else "both", worker_args) for role, n in roles]
    return router_app(registry, router_config, args.router_replicas, workers)


def router_app(registry, config: RouterConfig, replicas: int = 1, workers=()) -> serve.Application:
    """The ingress, finding its workers in `registry`; `workers`, the worker deployments, deploy with it.

    Serve hands a replica at most max_ongoing_requests at once (5 by default); the router admits and queues its
    own (429 early rather than an SLO missed late), so Serve gives it as many as it may hold. Its shutdown waits as
    long as the router lets requests in flight finish."""
    return TandemRouter.options(num_replicas=replicas, max_ongoing_requests=config.max_in_flight + config.max_queue,
                                graceful_shutdown_timeout_s=config.graceful_shutdown_s + 5).bind(
        registry, config.model_dump(exclude_defaults=True), *workers)
