"""Both KV-transfer backends move exactly the requested blocks, and fail cleanly."""

import json
import socket
import time

import pytest
import torch

from tandem.runtimes.launcher import free_port
from tandem.workers.kv_transfer import KVTransferError, create_kv_transfer, nixl_available
from tandem.workers.kv_transfer.base import coalesce
from tandem.workers.kv_transfer.nixl_backend import split_even

BACKENDS = ["tcp", pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(), reason="nixl not installed"))]
SHAPE = (24, 3, 2, 16, 2, 8)  # blocks, layers, k/v, block size, kv heads, head dim


def caches():
    src = torch.randn(SHAPE)
    return src, torch.zeros(SHAPE)


def assert_pulled_exactly(src, dst, remote_ids, local_ids, moved: int, block_bytes: int) -> None:
    """Each named remote block landed in its local block, and no other local block was written."""
    assert moved == len(remote_ids) * block_bytes
    for r, loc in zip(remote_ids, local_ids):
        assert torch.equal(dst[loc], src[r])
    untouched = [b for b in range(SHAPE[0]) if b not in local_ids]
    assert torch.count_nonzero(dst[untouched]) == 0


def test_coalesce_merges_adjacent_runs_only():
    assert coalesce([4, 5, 6, 9], [0, 1, 2, 3]) == [(4, 0, 3), (9, 3, 1)]
    assert coalesce([4, 5], [1, 0]) == [(4, 1, 1), (5, 0, 1)]


def test_split_even_cuts_equal_shares_at_block_boundaries():
    segments = [(1000, 5000, 30), (2000, 9000, 10)]  # (local, remote, bytes), blocks of 10 bytes
    shares = split_even(segments, 3, 10)
    assert [sum(n for _, _, n in share) for share in shares] == [20, 10, 10]
    assert shares == [[(1000, 5000, 20)], [(1020, 5020, 10)], [(2000, 9000, 10)]]
    assert split_even(segments, 8, 10) == [[s] for s in [(1000, 5000, 10), (1010, 5010, 10), (1020, 5020, 10),
                                                          (2000, 9000, 10)]]  # fewer blocks than parts
    assert split_even([], 2, 10) == []


@pytest.mark.skipif(not nixl_available(), reason="nixl not installed")
@pytest.mark.parametrize("lanes", [1, 3])
def test_nixl_pull_split_over_lanes_copies_every_block(lanes):
    src, dst = caches()
    server = create_kv_transfer("nixl", src, f"prefill-lanes{lanes}")
    client = create_kv_transfer("nixl", dst, f"decode-lanes{lanes}", lanes=lanes)
    try:
        remote_ids = [2, 3, 4, 5, 6, 7, 8, 20, 11, 12]  # runs of 7, 1 and 2 blocks -> shares of 4, 3, 3
        local_ids = [0, 1, 2, 3, 4, 5, 6, 15, 9, 10]
        moved = client.read_blocks(server.agent_info(), remote_ids, local_ids, timeout_s=10)
        assert_pulled_exactly(src, dst, remote_ids, local_ids, moved, server.block_bytes)
    finally:
        client.close()
        server.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_pull_copies_exactly_the_named_blocks(backend):
    src, dst = caches()
    server = create_kv_transfer(backend, src, f"prefill-{backend}")
    client = create_kv_transfer(backend, dst, f"decode-{backend}")
    try:
        remote_ids, local_ids = [3, 4, 5, 17, 0], [10, 11, 2, 7, 23]
        moved = client.read_blocks(server.agent_info(), remote_ids, local_ids, timeout_s=10)
        assert_pulled_exactly(src, dst, remote_ids, local_ids, moved, server.block_bytes)
        # A second pull over the same peer (cached connection state) works too.
        client.read_blocks(server.agent_info(), [1], [1], timeout_s=10)
        assert torch.equal(dst[1], src[1])
    finally:
        client.close()
        server.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_layout_mismatch_is_refused(backend):
    src = torch.randn(4, 2, 2, 16, 2, 8)
    server = create_kv_transfer(backend, src, f"p2-{backend}")
    client = create_kv_transfer(backend, torch.zeros(SHAPE), f"d2-{backend}")
    try:
        with pytest.raises(KVTransferError, match="block size mismatch"):
            client.read_blocks(server.agent_info(), [0], [0], timeout_s=5)
    finally:
        client.close()
        server.close()


def test_tcp_dead_peer_fails_fast():
    client = create_kv_transfer("tcp", torch.zeros(SHAPE), "d3")
    info = {"backend": "tcp", "agent_name": "gone", "host": "127.0.0.1", "port": free_port(),
            "block_bytes": client.block_bytes}
    with pytest.raises(KVTransferError):
        client.read_blocks(info, [0], [0], timeout_s=2)
    client.close()


# -- the TCP server's guards ---------------------------------------------------------------------------------


def raw_request(address, payload: bytes, timeout_s: float = 5.0) -> bytes:
    """What the TCP KV server answers one request line with, read until it closes or goes quiet."""
    chunks = []
    with socket.create_connection(address, timeout=timeout_s) as sock:
        # A refused request may be dropped before the server has read all of it (a line past its limit): then
        # the send or the read meets a reset connection, which is the answer too.
        try:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        try:
            while chunk := sock.recv(1 << 16):
                chunks.append(chunk)
        except ConnectionResetError:
            pass
    return b"".join(chunks)


def test_tcp_server_answers_only_blocks_under_the_named_live_lease():
    """Workers give the server their lease table's check: a peer that does not know a live lease holding the
    blocks (any process that can reach the port) reads nothing of another request's KV."""
    src, dst = caches()
    leases = {"lease-a": {3, 4, 5}}
    server = create_kv_transfer("tcp", src, "p-auth", authorize=lambda lease_id, ids: set(ids) <= leases.get(lease_id, set()))
    client = create_kv_transfer("tcp", dst, "d-auth")
    try:
        moved = client.read_blocks(server.agent_info(), [3, 5], [0, 1], timeout_s=5, lease_id="lease-a")
        assert_pulled_exactly(src, dst, [3, 5], [0, 1], moved, server.block_bytes)
        for lease_id, ids in (("lease-a", [3, 6]), ("lease-b", [3]), (None, [3])):
            with pytest.raises(KVTransferError, match="closed after 0"):
                client.read_blocks(server.agent_info(), ids, [9] * len(ids), timeout_s=5, lease_id=lease_id)
        assert raw_request(server.address, b'{"block_ids": [3]}\n') == b""
    finally:
        client.close()
        server.close()


@pytest.mark.parametrize("payload", [
    b"not json\n", b'{"block_ids": [1e309]}\n', b"[" * 100_000 + b"\n", b'{"block_ids": [true]}\n',
    b'{"block_ids": ["3"]}\n', b'{"block_ids": [1.5]}\n', b'{"block_ids": []}\n', b'{"block_ids": [24]}\n',
    b'{"block_ids": [' + b"0," * 24 + b'0]}\n',  # more ids than the cache has blocks
    b'{"block_ids": [0' + b" " * 100_000 + b"]}\n",  # a line longer than any real request
    b'{"block_ids": [0]}',  # no end of line before the peer stopped sending
], ids=["garbage", "overflow", "deep", "bool", "string", "float", "empty", "range", "too-many", "too-long",
        "unterminated"])
def test_tcp_server_drops_a_malformed_request_and_keeps_serving(payload, capfd):
    src, dst = caches()
    server = create_kv_transfer("tcp", src, "p-bad")
    client = create_kv_transfer("tcp", dst, "d-bad")
    try:
        assert raw_request(server.address, payload) == b""
        moved = client.read_blocks(server.agent_info(), [2], [2], timeout_s=5)
        assert moved == server.block_bytes and torch.equal(dst[2], src[2])
    finally:
        client.close()
        server.close()
    assert "Traceback" not in capfd.readouterr().err


def test_tcp_server_closes_connections_past_its_cap_and_serves_again_once_they_end(monkeypatch):
    import tandem.workers.kv_transfer.tcp_backend as tcp

    monkeypatch.setattr(tcp, "_MAX_CONNECTIONS", 2)
    src, dst = caches()
    server = create_kv_transfer("tcp", src, "p-cap")
    client = create_kv_transfer("tcp", dst, "d-cap")
    idle = [socket.create_connection(server.address, timeout=5) for _ in range(2)]
    try:
        with pytest.raises(KVTransferError):
            client.read_blocks(server.agent_info(), [1], [1], timeout_s=5)  # a third, closed at once
        for sock in idle:
            sock.close()
        for _ in range(50):  # the server notices the closes as its handler threads end
            try:
                client.read_blocks(server.agent_info(), [1], [1], timeout_s=5)
                break
            except KVTransferError:
                time.sleep(0.05)
        assert torch.equal(dst[1], src[1])
    finally:
        for sock in idle:
            sock.close()
        client.close()
        server.close()


def test_tcp_server_sends_a_run_that_outlasts_its_socket_timeout_to_a_reader_that_keeps_taking_it(monkeypatch):
    """The socket timeout bounds one sendall whole: one per run of blocks cut off any run slower to send than the
    timeout (gigabytes over a slow link) though the reader kept taking it (found by a review helper). Here the
    timeout is 0.5 s and the run takes ~1.5 s to a reader taking 64 KiB every 10 ms."""
    import tandem.workers.kv_transfer.tcp_backend as tcp

    monkeypatch.setattr(tcp._Handler, "timeout", 0.5)
    monkeypatch.setattr(tcp, "_WRITE_SLICE", 256 << 10)
    kv = torch.zeros(40, 4096 * 64, dtype=torch.uint8)  # 40 blocks of 256 KiB: one run of 10 MiB
    server = create_kv_transfer("tcp", kv, "p-slow-reader")
    try:
        with socket.create_connection(server.address, timeout=10) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
            sock.sendall(json.dumps({"block_ids": list(range(40))}).encode() + b"\n")
            got = 0
            while got < kv.numel() and (chunk := sock.recv(65536)):
                got += len(chunk)
                time.sleep(0.01 * len(chunk) / 65536)
        assert got == kv.numel()
    finally:
        server.close()
