"""KV pulls over a plain TCP socket, for hosts without NIXL.

The prefill side runs a small threaded server next to the engine; a pull sends one JSON line
{"block_ids": [...]} and reads back the raw bytes of those blocks in order, received straight
into the destination blocks (CPU) or a pinned staging buffer (GPU). Blocks being read are pinned
by a lease on the prefill side, so the engine cannot overwrite them mid-transfer.
"""

from __future__ import annotations

import json
import socket
import socketserver
import threading

import torch

from tandem.workers.kv_transfer.base import KVTransfer, KVTransferError, coalesce


class _Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        transfer: TcpTransfer = self.server.transfer  # type: ignore[attr-defined]
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for line in self.rfile:  # one connection may carry several pulls
            try:
                ids = [int(b) for b in json.loads(line)["block_ids"]]
                if any(not 0 <= b < transfer.kv_cache.shape[0] for b in ids):
                    raise ValueError("block id out of range")
            except (ValueError, KeyError, TypeError):
                return  # a malformed request: drop the connection, the client sees a short read
            for start, _, count in coalesce(ids, ids):
                self.wfile.write(transfer.block_bytes_view(start, count))
            self.wfile.flush()


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class TcpTransfer(KVTransfer):
    backend = "tcp"

    def __init__(self, kv_cache: torch.Tensor, agent_name: str, host: str = "127.0.0.1"):
        super().__init__(kv_cache, agent_name)
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
                    timeout_s: float) -> int:
        if remote.get("block_bytes") != self.block_bytes:
            raise KVTransferError(f"block size mismatch: remote {remote.get('block_bytes')} B, local {self.block_bytes} B")
        total = 0
        try:
            with socket.create_connection((remote["host"], remote["port"]), timeout=timeout_s) as sock:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.sendall(json.dumps({"block_ids": remote_block_ids}).encode() + b"\n")
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
