"""Runs the engine's step loop in its own thread and streams outputs to asyncio callers.

The HTTP server lives on an asyncio event loop; a forward pass takes milliseconds to seconds.
So the loop never calls the engine directly: it drops commands (add, abort) into a thread-safe
inbox that the engine thread drains before every step, and the engine thread hands each
RequestOutput back with `call_soon_threadsafe`. Torch releases the GIL in its kernels, so
the event loop keeps serving (and streaming) while a step runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from tandem.protocol import SamplingParams
from tandem.workers.engine.llm_engine import LLMEngine, RequestOutput

log = logging.getLogger(__name__)


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    options: dict = field(default_factory=dict)  # P/D: prefill_only, first_token_id, kv_source


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[LLMEngine], object]
    future: concurrent.futures.Future


class EngineDeadError(RuntimeError):
    """The engine thread failed; the worker must be restarted."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.05):
        self.engine = engine
        self._inbox: queue.SimpleQueue[_Add | _Abort | _Call | None] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._streams_lock = threading.Lock()
        self._idle_wait_s = idle_wait_s
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)
        self._stopping = False
        self.error: BaseException | None = None
        # When the engine thread began its current unit of work (a step, or the commands before it); None
        # while it waits for work. A step that never returns (a hung collective, a driver fault, a deadlock)
        # leaves the thread alive, so `alive` alone would keep a wedged worker in rotation for good.
        self._busy_since: float | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._inbox.put(None)
        self._wakeup.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def busy_for(self) -> float:
        """Seconds the engine thread has spent on its current step (0 while it waits for work)."""
        started = self._busy_since
        return 0.0 if started is None else time.monotonic() - started

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # -- requests ----------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       arrival_time: float, **options) -> AsyncIterator[RequestOutput]:
        """Yields the request's outputs until it finishes. Leaving early (client gone, task
        cancelled) aborts the request, which frees its KV blocks at the next step."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        if params.structured is not None:  # compiled here, not on the engine thread while every sequence waits
            await self.engine.grammars.prepare(params.structured)
        stream: asyncio.Queue = asyncio.Queue()
        with self._streams_lock:
            # Checked again, under the lock the dying engine thread lists the streams to fail under (after it sets
            # `error`): the compile above may have taken seconds, and a stream registered after that list was made
            # would wait for good.
            if self.error is not None or self._stopping:
                raise EngineDeadError("the engine is not running")
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in flight")
            self._streams[request_id] = (asyncio.get_running_loop(), stream)
        self._inbox.put(_Add(request_id, prompt_token_ids, params, arrival_time, options))
        self._wakeup.set()
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    async def call(self, fn: Callable[[LLMEngine], object]):
        """Run `fn(engine)` on the engine thread between steps and return its result."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(_Call(fn, future))
        self._wakeup.set()
        return await asyncio.wrap_future(future)

    def abort(self, request_id: str) -> None:
        """Abort a request; a caller still reading its stream gets the final "abort" output."""
        self._inbox.put(_Abort(request_id))
        self._wakeup.set()

    # -- engine thread -----------------------------------------------------------------------
    def _deliver(self, request_id: str, item: RequestOutput | BaseException, final: bool) -> None:
        with self._streams_lock:
            target = self._streams.pop(request_id, None) if final else self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, item)

    def _queued_commands(self):
        """What the inbox holds now, taken out one by one."""
        while True:
            try:
                yield self._inbox.get_nowait()
            except queue.Empty:
                return

    def _drain_inbox(self) -> None:
        for cmd in self._queued_commands():
            if cmd is None:
                continue
            if isinstance(cmd, _Abort):
                if not self.engine.abort_request(cmd.request_id):
                    with self._streams_lock:  # already finished or never added: nothing will end it
                        self._streams.pop(cmd.request_id, None)
                continue
            if isinstance(cmd, _Call):
                try:
                    cmd.future.set_result(cmd.fn(self.engine))
                except Exception as exc:  # the caller gets the error; the engine goes on
                    cmd.future.set_exception(exc)
                continue
            try:
                self.engine.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params, cmd.arrival_time,
                                        **cmd.options)
            except ValueError as exc:
                self._deliver(cmd.request_id, exc, final=True)

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._busy_since = time.monotonic()
                self._drain_inbox()
                if not self.engine.has_unfinished_requests():
                    self.engine.expire_leases()  # leases run out even when no step runs
                    self._busy_since = None
                    self._wakeup.wait(self._idle_wait_s)
                    self._wakeup.clear()
                    continue
                for out in self.engine.step():
                    self._deliver(out.request_id, out, final=out.finished)
        except BaseException as exc:  # a bug in a step: fail every caller loudly, never hang them
            log.exception("engine loop died")
            self.error = exc
            with self._streams_lock:
                ids = list(self._streams)
            dead = EngineDeadError(f"engine failed: {exc!r}")
            for rid in ids:
                self._deliver(rid, dead, final=True)
            self._fail_pending_calls(dead)

    def _fail_pending_calls(self, error: EngineDeadError) -> None:
        """Calls still in the inbox would wait for a thread that is gone."""
        for cmd in self._queued_commands():
            if isinstance(cmd, _Call) and not cmd.future.done():
                cmd.future.set_exception(error)
