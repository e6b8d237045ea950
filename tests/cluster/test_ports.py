"""The ports the tests and benchmarks give their clusters: distinct, free, and out of the kernel's way."""

import socket
from pathlib import Path

from cluster.ports import free_ports


def test_no_port_is_handed_out_twice_across_many_calls():
    ports = [port for _ in range(300) for port in free_ports(2)]
    assert len(set(ports)) == len(ports) == 600


def test_every_port_handed_out_can_be_bound():
    with socket.socket() as first, socket.socket() as second, socket.socket() as third:
        for probe, port in zip((first, second, third), free_ports(3)):
            probe.bind(("127.0.0.1", port))


def test_ports_lie_outside_the_range_the_kernel_hands_to_port_0():
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    assert not [port for port in free_ports(200) if low <= port <= high]
