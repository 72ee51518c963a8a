"""Hosts on one machine: Linux network namespaces joined by veth links, with real ``kvferry serve``
daemons in them, for tests and benchmarks that need a real network between sidecars.

Addresses come only from the benchmarking range 198.18.0.0/15 (RFC 2544), never a private or public one:

- data network, 198.18.0.0/24, inside the namespaces only: two hosts are joined by one veth pair;
  three or more each by a veth to a bridge in a namespace of its own. Shaping (``tc ... tbf``),
  partitions (``ip link set DEV down``) and loss (``iptables -m statistic``) act here.
- control network: each host has its own veth to the root namespace, a /30 of 198.19.0.0/16
  taken under a lock (``/run/lock``) so parallel runs never share one. The test (or benchmark)
  reaches the sidecars' REST API over it with the ordinary SDK, no helper processes; it is never
  shaped, cut or lossy, so a transfer can be watched while its data link is down. This is the
  management network / data network split of a real deployment.

Every name carries the creating process's pid and a random tag (``kvf-<pid>-<tag>-<host>``):
parallel runs never collide, ``Network.close`` removes what it made, and ``sweep`` (run before each
new network) removes what runs whose process is gone left behind. Each daemon also gets its own
UTS namespace and hostname, as on separate machines (``kvferry.engine.ipc.host_id`` differs).
This kernel may lack netem: no delay, reorder or corruption, only rate, partitions and loss.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import ipaddress
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvferry.client import Client

DATA_NET = ipaddress.ip_network("198.18.0.0/24")
CONTROL_NET = ipaddress.ip_network("198.19.0.0/16")
CONTROL_PORT, DATA_PORT = 7700, 7701  # each host is a namespace of its own: fixed ports never clash
DATA_DEV = "data0"
PREFIX = "kvf-"
_LOCK = Path("/run/lock/kvferry-netns.lock")
_CLONE_NEWNET = 0x40000000
_CLONE_NEWNS = 0x00020000
_MS_REC, _MS_PRIVATE, _MNT_DETACH = 0x4000, 1 << 18, 2
_ROOT = Path(__file__).resolve().parents[2]  # where ``kvferry`` imports from, for the daemons


class Unavailable(RuntimeError):
    """Network namespaces cannot be used here (not root, no ``ip``, no netns support): skip."""


def _run(argv: Sequence[str], check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and done.returncode:
        raise RuntimeError(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr.strip() or done.stdout.strip()}")
    return done


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None: root, ``ip`` and ``tc``, and a namespace that
    can be created, given a veth and deleted."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"{tool} (iproute2) is not installed"
    probe = f"{PREFIX}{os.getpid()}-probe{secrets.token_hex(2)}"
    try:
        _run(["ip", "netns", "add", probe])
        try:
            _run(["ip", "link", "add", "p0", "netns", probe, "type", "veth", "peer", "name", "p1", "netns", probe])
        finally:
            _run(["ip", "netns", "del", probe], check=False)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return f"ip netns does not work here: {exc}"
    return None


def iptables_unavailable() -> str | None:
    """Why packet loss cannot be made here, or None (``iptables`` with the statistic match)."""
    if shutil.which("iptables") is None:
        return "iptables is not installed (.ci/run installs it)"
    probe = f"{PREFIX}{os.getpid()}-ipt{secrets.token_hex(2)}"
    try:
        _run(["ip", "netns", "add", probe])
        try:
            _run(["ip", "netns", "exec", probe, "iptables", "-w", "-A", "INPUT", "-m", "statistic",
                  "--mode", "random", "--probability", "0.5", "-j", "DROP"])
        finally:
            _run(["ip", "netns", "del", probe], check=False)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return f"iptables cannot drop packets at random here: {exc}"
    return None


def sweep() -> list[str]:
    """Delete the namespaces of runs whose process has exited (a crash, a SIGKILL), killing what
    still runs in them first; returns their names. The root-namespace ends of their veths go
    with them."""
    removed, tags = [], set()
    listing = _run(["ip", "netns", "list"], check=False).stdout
    for netns, pid, tag in re.findall(rf"^({re.escape(PREFIX)}(\d+)-([0-9a-f]+)-\S+)", listing, flags=re.M):
        if _alive(int(pid)):
            continue
        _kill_inside(netns)
        _run(["ip", "netns", "del", netns], check=False)
        removed.append(netns)
        tags.add(tag)
    links = _run(["ip", "-o", "link", "show"], check=False).stdout
    for tag in tags:  # the root ends of their control veths, which the kernel removes only later
        for dev in re.findall(rf"^\d+: (kvf{tag}\d+)[@:]", links, flags=re.M):
            _run(["ip", "link", "del", dev], check=False)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_inside(netns: str) -> None:
    """SIGKILL the processes left in a namespace this module made (its daemons)."""
    for pid in _run(["ip", "netns", "pids", netns], check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def enter(netns: str) -> None:
    """Move this process into namespace ``netns`` (``setns``): the calling thread and the threads
    it starts afterwards. Call it first thing in a child process, before a library starts threads.

    Raises:
        OSError: no such namespace, or not allowed.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/run/netns/{netns}") as handle:
        if libc.setns(handle.fileno(), _CLONE_NEWNET) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"setns into {netns}: {os.strerror(error)}")
    # Libraries that list network devices from /sys (UCX) would still see the old namespace's:
    # as ``ip netns exec`` does, remount /sys in a mount namespace of this process's own.
    if libc.unshare(_CLONE_NEWNS) == 0 and libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) == 0:
        libc.umount2(b"/sys", _MNT_DETACH)
        if libc.mount(b"sysfs", b"/sys", b"sysfs", 0, None) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"mounting /sys in {netns}: {os.strerror(error)}")


@dataclass
class Host:
    """One "machine": a network namespace with a data address and a control address."""

    name: str
    netns: str
    data_ip: str
    control_ip: str
    root_dev: str  # the root namespace's end of the control veth

    def command(self, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *argv]

    def run(self, argv: Sequence[str], check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
        return _run(self.command(argv), check=check, timeout=timeout)


@dataclass
class Sidecar:
    """A ``kvferry serve`` in a host's namespace: control API on the host's control address, data
    port on its data address (what peers are given)."""

    host: Host
    process: subprocess.Popen
    client: Client
    url: str
    data_address: str
    log: Path

    def kill(self) -> None:
        """SIGKILL: no goodbye to its peers."""
        self.client.close()
        self.process.kill()
        self.process.wait(timeout=30)

    def stall(self) -> None:
        """SIGSTOP: the process stops where it is, its connections open (a stall, not a crash)."""
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.process.send_signal(signal.SIGCONT)

    def stop(self, timeout: float = 20.0) -> None:
        self.client.close()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


@dataclass
class Network:
    """``hosts`` hosts (names) on one data network, each reachable from here on its own control
    link. Use as a context manager, or call ``close`` (a finalizer): it stops the daemons and
    deletes every namespace and link it made, whatever happened before."""

    names: Sequence[str] = ("a", "b")
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    peer_secret: str = field(default_factory=lambda: secrets.token_hex(16))
    hosts: dict[str, Host] = field(default_factory=dict, init=False)
    sidecars: list[Sidecar] = field(default_factory=list, init=False)
    namespaces: list[str] = field(default_factory=list, init=False)
    workdir: Path = field(init=False)

    def __post_init__(self) -> None:
        if len(set(self.names)) != len(self.names) or len(self.names) < 2 or len(self.names) > 200:
            raise ValueError(f"hosts {list(self.names)}: give 2 to 200 distinct names")
        if any(not re.fullmatch(r"[a-z][a-z0-9]{0,5}", n) for n in self.names):
            raise ValueError("host names: a lower-case letter, then up to 5 letters or digits")
        reason = unavailable()
        if reason:
            raise Unavailable(reason)
        sweep()
        self.tag = f"{os.getpid()}-{secrets.token_hex(3)}"
        self.workdir = Path(tempfile.mkdtemp(prefix=f"kvferry-net-{self.tag}-"))
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # ---- building ----------------------------------------------------------------------------
    def _build(self) -> None:
        data_ips = list(DATA_NET.hosts())
        for i, name in enumerate(self.names):
            netns = f"{PREFIX}{self.tag}-{name}"
            _run(["ip", "netns", "add", netns])
            self.namespaces.append(netns)
            _run(["ip", "-n", netns, "link", "set", "lo", "up"])
            self.hosts[name] = Host(name, netns, str(data_ips[i]), "", "")
        a, b = (self.hosts[n] for n in self.names[:2])
        if len(self.names) == 2:  # one cable
            _run(["ip", "link", "add", DATA_DEV, "netns", a.netns, "type", "veth", "peer", "name", DATA_DEV,
                  "netns", b.netns])
        else:  # a switch: a bridge in a namespace of its own
            bridge = f"{PREFIX}{self.tag}-sw"
            _run(["ip", "netns", "add", bridge])
            self.namespaces.append(bridge)
            _run(["ip", "-n", bridge, "link", "add", "br0", "type", "bridge"])
            _run(["ip", "-n", bridge, "link", "set", "br0", "up"])
            for i, name in enumerate(self.names):
                port = f"p{i}"
                _run(["ip", "link", "add", DATA_DEV, "netns", self.hosts[name].netns, "type", "veth", "peer",
                      "name", port, "netns", bridge])
                _run(["ip", "-n", bridge, "link", "set", port, "master", "br0"])
                _run(["ip", "-n", bridge, "link", "set", port, "up"])
        for host in self.hosts.values():
            _run(["ip", "-n", host.netns, "addr", "add", f"{host.data_ip}/{DATA_NET.prefixlen}", "dev", DATA_DEV])
            _run(["ip", "-n", host.netns, "link", "set", DATA_DEV, "up"])
        for i, host in enumerate(self.hosts.values()):
            self._control_link(host, i)

    def _control_link(self, host: Host, index: int) -> None:
        """A veth from the root namespace to ``host``, on a /30 of CONTROL_NET no other run holds
        (chosen and configured under a lock, so the next run sees it taken)."""
        host.root_dev = f"kvf{self.tag.split('-')[1]}{index}"  # <= 15 characters, unique in the root namespace
        _LOCK.parent.mkdir(parents=True, exist_ok=True)
        with open(_LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            used = {ipaddress.ip_interface(a).network for a in
                    re.findall(r"inet (\S+)", _run(["ip", "-4", "-o", "addr", "show"]).stdout)}
            subnets = CONTROL_NET.num_addresses // 4
            for _ in range(1000):
                subnet = ipaddress.ip_network((int(CONTROL_NET.network_address) + 4 * random.randrange(subnets), 30))
                if not any(subnet.overlaps(u) for u in used):
                    break
            else:
                raise RuntimeError(f"no free /30 in {CONTROL_NET}")
            here, there = list(subnet.hosts())
            _run(["ip", "link", "add", host.root_dev, "type", "veth", "peer", "name", "ctl0", "netns", host.netns])
            _run(["ip", "addr", "add", f"{here}/30", "dev", host.root_dev])
            _run(["ip", "-n", host.netns, "addr", "add", f"{there}/30", "dev", "ctl0"])
            _run(["ip", "link", "set", host.root_dev, "up"])
            _run(["ip", "-n", host.netns, "link", "set", "ctl0", "up"])
        host.control_ip = str(there)

    # ---- the link ----------------------------------------------------------------------------
    def shape(self, host: str, rate_mbit: float, burst_bytes: int | None = None, latency_ms: float = 50.0) -> None:
        """Token-bucket shape what ``host`` sends on the data network to ``rate_mbit`` Mbit/s
        (``tc qdisc replace ... tbf``); the bucket holds 2 ms of the rate (at least 64 KiB) unless
        ``burst_bytes`` says, and ``latency_ms`` of queue."""
        burst = burst_bytes or max(64 << 10, int(rate_mbit * 1e6 / 8 * 0.002))
        self.hosts[host].run(["tc", "qdisc", "replace", "dev", DATA_DEV, "root", "tbf", "rate", f"{rate_mbit}mbit",
                              "burst", str(burst), "latency", f"{latency_ms}ms"])

    def shape_all(self, rate_mbit: float, **kwargs: float) -> None:
        for name in self.hosts:
            self.shape(name, rate_mbit, **kwargs)

    def unshape(self, host: str) -> None:
        self.hosts[host].run(["tc", "qdisc", "del", "dev", DATA_DEV, "root"], check=False)

    def cut(self, host: str) -> None:
        """Partition ``host`` from the data network (its data link down; control stays up)."""
        self.hosts[host].run(["ip", "link", "set", DATA_DEV, "down"])

    def heal(self, host: str) -> None:
        self.hosts[host].run(["ip", "link", "set", DATA_DEV, "up"])

    def forget_connections(self, host: str) -> None:
        """Abort every TCP socket of ``host``'s kernel (``ss -K``), closed ones still sending
        their goodbye included, as a reboot would; with its link cut, their resets go nowhere."""
        self.hosts[host].run(["ss", "-K", "-t", "state", "all"], check=False)

    def drop(self, host: str, probability: float) -> None:
        """Drop each packet ``host`` receives on the data network with ``probability``
        (``iptables -m statistic --mode random``)."""
        if not 0 <= probability <= 1:
            raise ValueError(f"probability {probability} is not in [0, 1]")
        self.hosts[host].run(["iptables", "-w", "-A", "INPUT", "-i", DATA_DEV, "-m", "statistic", "--mode", "random",
                              "--probability", f"{probability:.6f}", "-j", "DROP"])

    def dropped(self, host: str) -> int:
        """Packets ``drop`` has dropped on ``host`` so far."""
        listing = self.hosts[host].run(["iptables", "-w", "-L", "INPUT", "-v", "-n", "-x"]).stdout
        return sum(int(line.split()[0]) for line in listing.splitlines() if " DROP " in f" {line} " and "statistic" in line)

    def undrop(self, host: str) -> None:
        self.hosts[host].run(["iptables", "-w", "-F", "INPUT"])

    # ---- daemons -----------------------------------------------------------------------------
    def sidecar(self, host: str, env: Mapping[str, str] | None = None, extra: Sequence[str] = (),
                backend: str = "tcp", device: str = "cpu", ready_timeout: float = 120.0) -> Sidecar:
        """Start ``kvferry serve`` on ``host`` (control API on its control address, data port on its
        data address, with this network's token and peer secret) and wait until it is ready.

        Raises:
            RuntimeError: it exited or was not ready in ``ready_timeout`` s (with its log's tail).
        """
        h = self.hosts[host]
        log = self.workdir / f"{host}-{len(self.sidecars)}.log"
        serve = [sys.executable, "-m", "kvferry.cli", "serve", "--host", h.control_ip, "--port", str(CONTROL_PORT),
                 "--data-host", h.data_ip, "--data-port", str(DATA_PORT), "--advertise-host", h.data_ip,
                 "--transport-backend", backend, "--device", device, "--log-level", "warning", *extra]
        if shutil.which("unshare"):  # its own hostname, as on a machine of its own
            serve = ["unshare", "--uts", "--", "sh", "-c", 'hostname "$0" && exec "$@"', f"{h.netns}", *serve]
        environment = {k: v for k, v in os.environ.items() if not k.startswith("KVFERRY_")}
        environment.update({"KVFERRY_TOKEN": self.token, "KVFERRY_PEER_SECRET": self.peer_secret,
                            "UCX_TLS": "tcp", "UCX_NET_DEVICES": DATA_DEV, **(env or {})})
        environment["PYTHONPATH"] = os.pathsep.join(p for p in (str(_ROOT), os.environ.get("PYTHONPATH", "")) if p)
        with open(log, "w") as out:  # the child holds it; an unread pipe would block a chatty daemon
            process = subprocess.Popen(h.command(serve), env=environment, stdin=subprocess.DEVNULL,
                                       stdout=out, stderr=subprocess.STDOUT)
        url = f"http://{h.control_ip}:{CONTROL_PORT}"
        sidecar = Sidecar(h, process, Client(url, token=self.token, timeout=120), url, f"{h.data_ip}:{DATA_PORT}", log)
        self.sidecars.append(sidecar)
        deadline = time.monotonic() + ready_timeout
        while not sidecar.client.ready():
            if process.poll() is not None:
                raise RuntimeError(f"the sidecar on {host} exited ({process.returncode}): {sidecar.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the sidecar on {host} was not ready in {ready_timeout:g} s: {sidecar.log_tail()}")
            time.sleep(0.1)
        return sidecar

    # ---- teardown ----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the daemons, delete the namespaces (their veths go with them) and the work folder;
        safe to call twice and after a failure half way through building."""
        for sidecar in self.sidecars:
            with contextlib.suppress(Exception):
                sidecar.stop(timeout=10)
        self.sidecars.clear()
        for netns in reversed(self.namespaces):
            _kill_inside(netns)
            _run(["ip", "netns", "del", netns], check=False)
        self.namespaces.clear()
        for host in self.hosts.values():  # a root end whose namespace lingers (a process in exit)
            if host.root_dev:
                _run(["ip", "link", "del", host.root_dev], check=False)
        if getattr(self, "workdir", None):
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

