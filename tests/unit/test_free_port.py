"""jetflow.distributed.free_port: a port for a rendezvous to bind a moment later, outside the kernel's ephemeral
range so that no other process's bind(0) or outgoing connection takes it in between."""

import random
import socket

import pytest

from jetflow import distributed
from jetflow.distributed import free_port


def test_the_port_is_below_the_ephemeral_range_and_bindable():
    if not distributed.EPHEMERAL_PORT_RANGE.exists():
        pytest.skip("no /proc/sys/net/ipv4/ip_local_port_range (not Linux)")
    low = int(distributed.EPHEMERAL_PORT_RANGE.read_text().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(max(1024, low - 10000) <= p < low for p in ports)
    assert len(ports) > 1  # drawn at random: two processes choosing at once rarely meet
    same = []
    for _ in range(3):  # not from the global RNG, which runs seed alike (run.seed): after one seed, other ports
        random.seed(0)
        first = free_port()
        random.seed(0)
        same.append(free_port() == first)
    assert not all(same)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))


def test_without_the_range_file_it_falls_back_to_an_ephemeral_port(monkeypatch, tmp_path):
    monkeypatch.setattr(distributed, "EPHEMERAL_PORT_RANGE", tmp_path / "missing")
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
