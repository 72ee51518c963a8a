"""The plumbing itself: addresses only in the benchmarking range, nothing left behind by ``close``,
a crashed run's namespaces swept by the next one, partitions and shaping that act on the cable."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys

import pytest

from kvferry.testing import netns

BENCHMARKING = ipaddress.ip_network("198.18.0.0/15")


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout


def _root_links() -> str:
    return subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout


def _reaches(host: netns.Host, address: str) -> bool:
    """A TCP connect from ``host`` to ``address`` port 9 is answered (refused counts: a reply came)."""
    probe = ("import socket, sys\ns = socket.socket(); s.settimeout(1)\n"
             "try:\n    s.connect((sys.argv[1], 9))\nexcept ConnectionRefusedError:\n    pass\n"
             "except OSError:\n    sys.exit(1)\n")
    return host.run([sys.executable, "-c", probe, address], check=False).returncode == 0


def test_addresses_names_and_cleanup(networks):
    net = networks("a", "b", "c")  # three: through a bridge
    for host in net.hosts.values():
        assert ipaddress.ip_address(host.data_ip) in BENCHMARKING and ipaddress.ip_address(host.control_ip) in BENCHMARKING
        assert host.netns.startswith(f"kvf-{netns.os.getpid()}-")
    assert _reaches(net.hosts["a"], net.hosts["c"].data_ip) and _reaches(net.hosts["b"], net.hosts["a"].data_ip)
    names, links = list(net.namespaces), [h.root_dev for h in net.hosts.values()]
    net.close()
    assert not any(n in _namespaces() for n in names)
    assert not any(f" {link}@" in _root_links() or f" {link}:" in _root_links() for link in links)


def test_a_cut_isolates_the_host_and_a_heal_reconnects_it(networks):
    net = networks("a", "b")
    a, b = net.hosts["a"], net.hosts["b"]
    assert _reaches(a, b.data_ip)
    net.cut("b")
    assert not _reaches(a, b.data_ip)
    net.heal("b")
    assert _reaches(a, b.data_ip)


def test_shaping_sets_a_token_bucket(networks):
    net = networks("a", "b")
    net.shape("a", 250)
    assert "tbf" in net.hosts["a"].run(["tc", "qdisc", "show", "dev", netns.DATA_DEV]).stdout
    assert "250Mbit" in net.hosts["a"].run(["tc", "qdisc", "show", "dev", netns.DATA_DEV]).stdout


def test_a_crashed_runs_namespaces_are_swept():
    child = subprocess.run([sys.executable, "-c", (
        "import os\nfrom kvferry.testing import netns\nnet = netns.Network(('a', 'b'))\n"
        "print(' '.join(net.namespaces), ' '.join(h.root_dev for h in net.hosts.values()), sep='|', flush=True)\n"
        "os._exit(0)  # no close: a crash\n")], capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr
    names, links = (part.split() for part in child.stdout.strip().split("|"))
    assert all(n in _namespaces() for n in names)  # left behind
    swept = netns.sweep()
    assert set(names) <= set(swept)
    assert not any(n in _namespaces() for n in names)
    assert not any(f" {link}@" in _root_links() for link in links)


def test_bad_host_names_are_refused():
    with pytest.raises(ValueError, match="2 to 200"):
        netns.Network(("a",))
    with pytest.raises(ValueError, match="lower-case"):
        netns.Network(("a", "B-1"))


def _addresses_seen(netns_name: str, queue) -> None:
    """A spawned child: into the host, then report the addresses its interfaces have there."""
    import re
    import socket

    netns.enter(netns_name)
    out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True).stdout
    with socket.socket() as s:  # and a socket there binds the host's data address
        s.bind((re.search(rf"{netns.DATA_DEV}\s+inet ([0-9.]+)/", out).group(1), 0))
        queue.put((out, s.getsockname()[0], sorted(os.listdir("/sys/class/net"))))


def test_a_child_process_enters_a_host(networks):
    """What NIXL's processes do in ``bench/peers.py --netns``: ``enter`` moves a spawned process
    into the host's namespace, where it sees that host's cable and address and nothing of ours,
    in /sys too (where UCX lists the devices it may use)."""
    import multiprocessing

    net = networks("a", "b")
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_addresses_seen, args=(net.hosts["b"].netns, queue))
    child.start()
    try:
        seen, bound, devices = queue.get(timeout=60)
    finally:
        child.join(timeout=30)
    assert bound == net.hosts["b"].data_ip and net.hosts["a"].data_ip not in seen
    assert net.hosts["a"].root_dev not in seen and "ctl0" in seen
    assert netns.DATA_DEV in devices and net.hosts["a"].root_dev not in devices
    with pytest.raises(OSError):
        netns.enter("kvf-no-such-namespace")
