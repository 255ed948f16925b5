"""KV pulls over a plain TCP socket, for hosts without NIXL.

A small threaded server on the prefill side sends the raw bytes of the blocks a live lease holds. The wire
format and its bounds: docs/pd-and-kv-transfer.md.
"""

from __future__ import annotations

import json
import logging
import socket
import socketserver
import threading
from collections.abc import Callable

import torch

from tandem.workers.kv_transfer.base import KVTransfer, KVTransferError, coalesce

log = logging.getLogger(__name__)

# A request line names at most every block once; each id takes at most this many bytes in JSON ("123456, ").
_BYTES_PER_ID = 12
_LINE_OVERHEAD = 256  # the braces, keys and a lease id
_SOCKET_TIMEOUT_S = 30.0  # a peer that stops sending or reading
_MAX_CONNECTIONS = 64  # served at once; more are closed at once (a decode worker opens one per pull)
# Written this much at a time: a socket timeout bounds one sendall whole, and a run of blocks can take far longer
# than _SOCKET_TIMEOUT_S to send to a reader taking it steadily (gigabytes over a slow link).
_WRITE_SLICE = 4 << 20


class _Refused(ValueError):
    """A request this server does not answer (malformed, out of range, not under the named lease)."""


class _Handler(socketserver.StreamRequestHandler):
    timeout = _SOCKET_TIMEOUT_S

    def handle(self) -> None:
        transfer: TcpTransfer = self.server.transfer  # type: ignore[attr-defined]
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        num_blocks = transfer.kv_cache.shape[0]
        try:
            while True:  # one connection may carry several pulls
                line = self.rfile.readline(num_blocks * _BYTES_PER_ID + _LINE_OVERHEAD)
                if not line:
                    return
                ids = self._parse(line, transfer, num_blocks)
                for start, _, count in coalesce(ids, ids):
                    view = transfer.block_bytes_view(start, count)
                    for offset in range(0, len(view), _WRITE_SLICE):
                        self.wfile.write(view[offset:offset + _WRITE_SLICE])
                self.wfile.flush()
        except _Refused as exc:  # the client sees a short read
            log.info("KV pull from %s refused: %s", self.client_address[0], exc)
        except OSError as exc:  # the peer went away or stalled (a pull that timed out on its side)
            log.debug("KV pull connection from %s ended: %r", self.client_address[0], exc)

    @staticmethod
    def _parse(line: bytes, transfer: TcpTransfer, num_blocks: int) -> list[int]:
        if not line.endswith(b"\n"):
            raise _Refused("request line too long")
        try:
            request = json.loads(line)
        except (ValueError, RecursionError) as exc:
            raise _Refused(f"not JSON: {type(exc).__name__}") from None
        ids = request.get("block_ids") if isinstance(request, dict) else None
        if not isinstance(ids, list) or not ids or len(ids) > num_blocks:
            raise _Refused("block_ids must be a list of 1 to as many blocks as the cache holds")
        if any(type(b) is not int or not 0 <= b < num_blocks for b in ids):
            raise _Refused("block ids must be integers within the cache")
        lease_id = request.get("lease_id")
        if transfer.authorize is not None and not (isinstance(lease_id, str)
                                                   and transfer.authorize(lease_id, ids)):
            raise _Refused("the blocks are not under the named lease")
        return ids


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(_MAX_CONNECTIONS)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            log.warning("KV transfer server: %d connections already served, one from %s closed",
                        _MAX_CONNECTIONS, client_address[0])
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started (none left, say): its slot is not taken
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class TcpTransfer(KVTransfer):
    backend = "tcp"

    def __init__(self, kv_cache: torch.Tensor, agent_name: str, host: str = "127.0.0.1",
                 authorize: Callable[[str, list[int]], bool] | None = None):
        super().__init__(kv_cache, agent_name)
        # (lease id, block ids) -> whether a live lease of that id holds every one of them; None answers any
        # request (a transfer with no engine behind it: benchmarks and transfer tests).
        self.authorize = authorize
        self._server = _Server((host, 0), _Handler)
        self._server.transfer = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._server.serve_forever, name="kv-tcp", daemon=True)
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        return self._server.server_address[:2]

    def agent_info(self) -> dict:
        host, port = self.address
        return {"backend": self.backend, "agent_name": self.agent_name, "host": host, "port": port,
                "block_bytes": self.block_bytes}

    def block_bytes_view(self, start: int, count: int) -> memoryview:
        """The raw bytes of `count` adjacent blocks (a host copy when the cache lives on a GPU)."""
        span = self.kv_cache[start:start + count]
        if span.is_cuda:
            span = span.cpu()
        return memoryview(span.view(torch.uint8).numpy()).cast("B")

    def read_blocks(self, remote: dict, remote_block_ids: list[int], local_block_ids: list[int],
                    timeout_s: float, lease_id: str | None = None) -> int:
        if remote.get("block_bytes") != self.block_bytes:
            raise KVTransferError(f"block size mismatch: remote {remote.get('block_bytes')} B, local {self.block_bytes} B")
        total = 0
        try:
            with socket.create_connection((remote["host"], remote["port"]), timeout=timeout_s) as sock:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.sendall(json.dumps({"lease_id": lease_id, "block_ids": remote_block_ids}).encode() + b"\n")
                for _, local_start, count in coalesce(remote_block_ids, local_block_ids):
                    total += self._receive_into(sock, local_start, count)
        except OSError as exc:
            raise KVTransferError(f"tcp: pull from {remote.get('host')}:{remote.get('port')} failed: {exc}") from exc
        return total

    def _receive_into(self, sock: socket.socket, start: int, count: int) -> int:
        dest = self.kv_cache[start:start + count]
        staging = torch.empty(dest.shape, dtype=dest.dtype, pin_memory=True) if dest.is_cuda else dest
        buf = memoryview(staging.view(torch.uint8).numpy()).cast("B")
        got = 0
        while got < len(buf):
            n = sock.recv_into(buf[got:], len(buf) - got)
            if n == 0:
                raise KVTransferError(f"tcp: connection closed after {got} of {len(buf)} bytes")
            got += n
        if dest.is_cuda:
            dest.copy_(staging)
        return got

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
