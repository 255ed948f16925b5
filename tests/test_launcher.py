"""free_port: the ports handed to child processes stay clear of the kernel's ephemeral range."""

from __future__ import annotations

import socket

from tandem.launcher import _ephemeral_ports, free_port


def test_free_ports_are_bindable_distinct_and_below_the_ephemeral_range():
    low, _ = _ephemeral_ports()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= p < low for p in ports)
    for port in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_not_handed_out(monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy_port = busy.getsockname()[1]
        busy.listen()
        # Every draw hits the busy port: free_port must skip it and fall back on the kernel's choice.
        monkeypatch.setattr("tandem.launcher._ephemeral_ports", lambda: (busy_port + 1, 60999))
        monkeypatch.setattr("random.SystemRandom.randint", lambda self, a, b: busy_port)
        assert free_port() != busy_port
