"""An emulated multi-host cluster on one machine: network namespaces, veth, bridges, tc.

Theory of operation
-------------------
:func:`open_cluster` builds, for a run prefix ``P`` (names below drop it)::

    netns h0 ─ eth0 ══veth══ h0 ┐                       netns rt (only with dcs > 1)
    netns h1 ─ eth0 ══veth══ h1 ┼─ br0 ─ r0 ══veth══ dc0 ┐
       ...        (DC 0)        ┘                        ├─ relay (delay) + nft redirect
    netns h4 ─ eth0 ══veth══ h4 ┐                        │  (one leg per DC, any number)
       ...        (DC 1)        ┴─ br1 ─ r1 ══veth══ dc1 ┘
                         netns sw (the "switch": one bridge per DC)

What to build is a :class:`~tensorhub.testing.clusterspec.ClusterSpec` (any number of DCs,
each host's NIC rate, each DC pair's rate and round trip): :func:`open_topology` takes
one; :func:`open_cluster` builds the uniform one of its arguments.

* Every link lives in a namespace this module made; the machine's own namespace is never
  touched, so deleting the namespaces deletes every link, and no traffic can leave.
* Host ``i`` of DC ``d`` has address ``10.77.d.(k+1)/24`` on ``eth0`` (``k`` its index
  inside the DC). Clusters of different runs reuse these addresses in their own,
  isolated namespaces.
* NIC caps: a ``tbf`` qdisc on both ends of each host's veth: on ``eth0`` (upload) and on
  the switch-side end (download), at that host's own rate.
* Cross-DC: hosts route ``10.77.0.0/16`` via their DC's router address ``10.77.d.254``.
  The router does **not** forward IP (``ip_forward=0``); an nftables rule redirects every
  TCP connection arriving from a DC to the relay (:mod:`tensorhub.testing.relay`), which
  reads the original destination (``SO_ORIGINAL_DST``), dials it from the router and
  delays each direction by half the round trip of the DC pair (source subnet, destination
  subnet). So hosts use each other's real addresses across DCs; servers see the router's
  address as the source; only TCP crosses.
* Per-pair rates: the router end of DC ``d``'s leg (``dc<d>``: traffic *into* DC ``d``)
  has an ``htb`` qdisc with one class per other DC ``x`` at the rate of the direction
  ``x -> d`` (links may be asymmetric; :meth:`Cluster.set_link_rate` changes one while
  traffic flows). The relay puts each socket's bytes in the right class with ``SO_PRIORITY``
  (htb reads ``skb->priority`` as a class id; this kernel has no ``fw`` classifier):
  the socket it dials into ``d`` carries bytes from ``x``, the socket back to a client
  in ``x`` carries bytes from ``d``. The router leg of DC ``d`` carries exactly the
  cross-DC traffic of DC ``d``; its kernel counters are what :meth:`Cluster.wan_counters`
  reads.

Cleanup: processes started in the namespaces are ended (SIGTERM, then SIGKILL) and the
namespaces deleted on every exit of the ``with`` block, including exceptions, Ctrl-C and
SIGTERM/SIGHUP (turned into ``SystemExit`` while a cluster is open in the main thread).
A run killed with SIGKILL leaves its namespaces behind; :func:`cleanup_stale` (also run by
:func:`open_cluster` for the default prefix family) removes those of dead owners.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from ..errors import TensorHubError
from .clusterspec import ClusterSpec, pair_class, relay_buffer, relay_routes, uniform

#: Namespace names of default-prefixed runs: ``thc<owner pid>-<token>-<role>``.
DEFAULT_FAMILY = "thc"
#: The first two octets of every address inside the emulated cluster.
SUBNET = "10.77"
#: Where the relay listens inside the router namespace.
RELAY_PORT = 15000
#: The relay's per-direction buffer at least; more where rate x one-way delay needs it.
RELAY_MIN_BUFFER = 4 * 1024 * 1024

_RELAY_SCRIPT = Path(__file__).with_name("relay.py")
_SCRATCH = "scratch"
_OWNER = re.compile(rf"^{DEFAULT_FAMILY}(\d+)-[0-9a-f]+-")
_GRACE_S = 2.0


class ClusterUnavailable(TensorHubError):
    """This machine or user cannot host an emulated cluster (not root, tools missing)."""


class ClusterCommandError(TensorHubError):
    """An ``ip``/``tc``/``nft`` command failed; the message carries its stderr."""


class ClusterCleanupError(TensorHubError):
    """Namespaces of a cluster survived its teardown; they are named in the message."""


@dataclass(frozen=True)
class Host:
    """One emulated host: a network namespace with one NIC, ``eth0``."""

    name: str
    namespace: str
    ip: str
    dc: int
    nic_mbit: float
    """Its NIC's cap, both ways."""


@dataclass(frozen=True)
class LinkCounters:
    """Kernel counters of one interface (``ip -s link``), headers included."""

    rx_bytes: int
    tx_bytes: int
    rx_packets: int
    tx_packets: int

    def __sub__(self, earlier: LinkCounters) -> LinkCounters:
        return LinkCounters(
            self.rx_bytes - earlier.rx_bytes,
            self.tx_bytes - earlier.tx_bytes,
            self.rx_packets - earlier.rx_packets,
            self.tx_packets - earlier.tx_packets,
        )


def check_support(dcs: int = 1) -> None:
    """Raise :class:`ClusterUnavailable` saying why a cluster cannot be built here."""
    if sys.platform != "linux":
        raise ClusterUnavailable(f"network namespaces need Linux, this is {sys.platform}")
    if os.geteuid() != 0:
        raise ClusterUnavailable("network namespaces need root (euid 0)")
    tools = ["ip", "tc"] + (["nft"] if dcs > 1 else [])
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        raise ClusterUnavailable(
            f"missing {', '.join(missing)} (apt-get install iproute2"
            + (" nftables" if "nft" in missing else "")
            + ")"
        )


class Cluster:
    """A running emulated cluster; made by :func:`open_cluster`, valid inside its block."""

    def __init__(self, prefix: str, spec: ClusterSpec, mtu: int) -> None:
        self.prefix = prefix
        self.spec = spec
        self.dcs = len(spec.dcs)
        self.mtu = mtu
        self.switch_namespace = f"{prefix}sw"
        self.router_namespace = f"{prefix}rt" if self.dcs > 1 else None
        built: list[Host] = []
        for i, (dc, nic) in enumerate(spec.hosts):
            k = sum(1 for h in built if h.dc == dc)
            built.append(Host(f"h{i}", f"{prefix}h{i}", f"{SUBNET}.{dc}.{k + 1}", dc, nic))
        self.hosts: tuple[Host, ...] = tuple(built)
        #: A directory for the run's files (e.g. Ray's temp dirs), deleted at teardown.
        self.scratch_dir = Path(tempfile.gettempdir()) / f"{prefix}{_SCRATCH}"
        self._namespaces: list[str] = []
        self._processes: list[subprocess.Popen[Any]] = []

    def host(self, which: Host | str | int) -> Host:
        """A host by name (``"h3"``) or index (``3``); a :class:`Host` is returned as is."""
        if isinstance(which, Host):
            return which
        if isinstance(which, int):
            return self.hosts[which]
        for host in self.hosts:
            if host.name == which:
                return host
        raise KeyError(f"no host {which!r} in this cluster")

    def run(
        self, host: Host | str | int, argv: Sequence[str], **popen_kwargs: Any
    ) -> subprocess.Popen[Any]:
        """Start ``argv`` inside ``host``'s namespace; it is ended at teardown if still alive."""
        return self.run_in(self.host(host).namespace, argv, **popen_kwargs)

    def run_in(
        self, namespace: str, argv: Sequence[str], **popen_kwargs: Any
    ) -> subprocess.Popen[Any]:
        """Like :meth:`run`, for any namespace of this cluster (switch, router)."""
        if namespace not in self._namespaces:
            raise ValueError(f"{namespace!r} is not a namespace of this cluster")
        process = subprocess.Popen(["ip", "netns", "exec", namespace, *argv], **popen_kwargs)
        self._processes.append(process)
        return process

    def end_processes(self, host: Host | str | int) -> None:
        """End every process in ``host``'s namespace (daemons too): SIGTERM, then SIGKILL."""
        _end_processes(self.host(host).namespace)

    def nic_counters(self, host: Host | str | int) -> LinkCounters:
        """Counters of the host's ``eth0``: tx is what it uploaded, rx what it downloaded."""
        return _counters(self.host(host).namespace, "eth0")

    def wan_counters(self) -> dict[int, LinkCounters]:
        """Per DC, the router leg's counters: tx = bytes into the DC, rx = bytes out of it."""
        if self.router_namespace is None:
            raise ValueError("a single-DC cluster has no inter-DC link")
        return {dc: _counters(self.router_namespace, f"dc{dc}") for dc in range(self.dcs)}

    def wan_bytes(self) -> int:
        """Bytes (with their TCP/IP/Ethernet headers) that crossed between DCs so far."""
        return sum(c.tx_bytes for c in self.wan_counters().values())

    def set_link_rate(self, src: int, dst: int, mbit: float) -> None:
        """Cap the bytes from DC ``src`` into DC ``dst`` at ``mbit`` from now on (``tc
        class change`` of the htb class ``pair_class(src)`` on ``dst``'s router leg; its
        queue keeps the size it was built with). Only a direction capped in the spec has
        a class; the spec itself is not changed."""
        if self.router_namespace is None:
            raise ValueError("a single-DC cluster has no inter-DC link")
        if self.spec.link(src, dst).mbit is None:
            raise ValueError(f"the link {src}->{dst} was built without a cap: no class")
        if not mbit > 0:
            raise ValueError(f"a rate must be > 0, got {mbit}")
        burst = _burst(mbit)
        _run(["tc", "-n", self.router_namespace, "class", "change", "dev", f"dc{dst}",
              "parent", "1:", "classid", f"1:{pair_class(src):x}", "htb",
              "rate", f"{round(mbit * 1000)}kbit", "burst", str(burst), "cburst", str(burst),
              "quantum", "65536"])  # fmt: skip

    def link_rate_mbit(self, src: int, dst: int) -> float | None:
        """The cap the kernel now applies to bytes from DC ``src`` into DC ``dst`` (its
        htb class's rate), or None if that direction has no class (uncapped)."""
        if self.router_namespace is None:
            raise ValueError("a single-DC cluster has no inter-DC link")
        classid = f"1:{pair_class(src):x}"
        shown = _run(["tc", "-n", self.router_namespace, "class", "show", "dev", f"dc{dst}",
                      "classid", classid])
        found = re.search(r"\brate (\d+(?:\.\d+)?)([KMG]?)bit\b", shown)
        if found is None:
            return None
        scale = {"": 1e-6, "K": 1e-3, "M": 1.0, "G": 1e3}[found.group(2)]
        return float(found.group(1)) * scale

    # -- building and tearing down ------------------------------------------------------

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self._namespaces.append(name)
        _sh(
            name,
            "sysctl", "-q", "-w",
            "net.ipv4.ip_forward=0",
            "net.ipv6.conf.all.disable_ipv6=1",
            "net.ipv6.conf.default.disable_ipv6=1",
        )  # fmt: skip
        _ip("-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        self.scratch_dir.mkdir(mode=0o700)
        sw = self.switch_namespace
        self._add_namespace(sw)
        for dc in range(self.dcs):
            _ip("-n", sw, "link", "add", f"br{dc}", "type", "bridge", "forward_delay", "0")
            _ip("-n", sw, "link", "set", f"br{dc}", "mtu", str(self.mtu), "up")
        for host in self.hosts:
            self._add_namespace(host.namespace)
            self._add_link(sw, host.name, host.namespace, "eth0", f"br{host.dc}", host.nic_mbit)
            _ip("-n", host.namespace, "addr", "add", f"{host.ip}/24", "dev", "eth0")
            if self.router_namespace is not None:
                gateway = f"{SUBNET}.{host.dc}.254"
                _ip("-n", host.namespace, "route", "add", f"{SUBNET}.0.0/16", "via", gateway)
        if self.router_namespace is not None:
            self._build_router(self.router_namespace)

    def _build_router(self, rt: str) -> None:
        self._add_namespace(rt)
        for dc in range(self.dcs):
            self._add_link(self.switch_namespace, f"r{dc}", rt, f"dc{dc}", f"br{dc}", None)
            _ip("-n", rt, "addr", "add", f"{SUBNET}.{dc}.254/24", "dev", f"dc{dc}")
            self._cap_pairs(rt, dc)
        rules = (
            "table ip tensorhub {\n"
            " chain prerouting {\n"
            "  type nat hook prerouting priority dstnat; policy accept;\n"
            f'  iifname "dc*" ip daddr {SUBNET}.0.0/16 meta l4proto tcp'
            f" redirect to :{RELAY_PORT}\n"
            " }\n"
            "}\n"
        )
        _run(["ip", "netns", "exec", rt, "nft", "-f", "-"], stdin=rules)
        relay = self.run_in(
            rt,
            [sys.executable, "-u", str(_RELAY_SCRIPT), "--listen", f"0.0.0.0:{RELAY_PORT}",
             "--original-dst", "--routes", json.dumps(relay_routes(self.spec, SUBNET)),
             "--buffer-bytes", str(max(RELAY_MIN_BUFFER, relay_buffer(self.spec)))],
            stdout=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
        line = read_line(relay, timeout_s=20.0)
        if not line.startswith("relay listening"):
            raise RuntimeError(f"the relay said {line!r} instead of 'relay listening ...'")

    def _cap_pairs(self, rt: str, dc: int) -> None:
        """On the router end of DC ``dc``'s leg (bytes into ``dc``): one htb class per
        other DC, at the rate of that pair; unclassified bytes (ARP) are not capped."""
        capped = [(x, self.spec.link(x, dc).mbit) for x in range(self.dcs) if x != dc]
        if all(mbit is None for _, mbit in capped):
            return
        _run(["tc", "-n", rt, "qdisc", "add", "dev", f"dc{dc}", "root", "handle", "1:",
              "htb", "default", "1"])  # fmt: skip
        _run(["tc", "-n", rt, "class", "add", "dev", f"dc{dc}", "parent", "1:",
              "classid", "1:1", "htb", "rate", "100gbit", "quantum", "65536"])  # fmt: skip
        for x, mbit in capped:
            if mbit is None:
                continue
            burst = _burst(mbit)
            classid = f"1:{pair_class(x):x}"
            _run(["tc", "-n", rt, "class", "add", "dev", f"dc{dc}", "parent", "1:",
                  "classid", classid, "htb", "rate", f"{round(mbit * 1000)}kbit",
                  "burst", str(burst), "cburst", str(burst), "quantum", "65536"])  # fmt: skip
            queue = burst + int(mbit * 1e6 / 8 * 0.05)  # 50 ms at rate, as the tbf NIC caps
            _run(["tc", "-n", rt, "qdisc", "add", "dev", f"dc{dc}", "parent", classid,
                  "bfifo", "limit", str(queue)])  # fmt: skip

    def _add_link(
        self, sw: str, sw_name: str, other: str, other_name: str, bridge: str, mbit: float | None
    ) -> None:
        """A veth from the switch's ``bridge`` to ``other``, capped both ways at ``mbit``."""
        _ip("-n", sw, "link", "add", sw_name, "mtu", str(self.mtu), "type", "veth",
            "peer", "name", other_name, "mtu", str(self.mtu), "netns", other)  # fmt: skip
        _ip("-n", sw, "link", "set", sw_name, "master", bridge, "up")
        _ip("-n", other, "link", "set", other_name, "up")
        if mbit is not None:
            _cap(sw, sw_name, mbit)
            _cap(other, other_name, mbit)

    def _teardown(self) -> None:
        """End every process, delete every namespace; raise if any namespace survived."""
        for process in self._processes:
            _end(process)
        failures = []
        for namespace in reversed(self._namespaces):
            try:
                _end_namespace(namespace)
            except (ClusterCommandError, subprocess.SubprocessError, OSError) as error:
                failures.append(str(error))  # go on with the others, report below
        shutil.rmtree(self.scratch_dir, ignore_errors=True)  # absent if the build failed early
        left = [name for name in _namespaces() if name in self._namespaces]
        if left:
            raise ClusterCleanupError(
                f"namespaces survived teardown: {', '.join(left)}; {'; '.join(failures)}"
            )


@contextmanager
def open_cluster(
    hosts: int,
    nic_mbit: float,
    dcs: int = 1,
    wan_mbit: float | None = None,
    wan_delay_ms: float = 0.0,
    prefix: str | None = None,
    mtu: int = 9000,
) -> Iterator[Cluster]:
    """Build an emulated cluster, yield it, and always remove everything it created.

    ``hosts`` are split into ``dcs`` contiguous blocks (host 0, the trainer by convention,
    is in DC 0). ``nic_mbit`` caps each host's upload and download. With ``dcs > 1``,
    ``wan_mbit`` (None: no cap) caps each DC pair's link each way and ``wan_delay_ms`` is
    the **round trip** the relay adds (half per direction). ``mtu`` defaults to jumbo
    frames, as in datacenter fabrics: it keeps header overhead in the counters under 1%
    and the packet rate (CPU) low. ``prefix`` defaults to ``thc<pid>-<token>-``.
    The same as :func:`open_topology` of :func:`~tensorhub.testing.clusterspec.uniform`.
    """
    if hosts < 1 or dcs < 1 or dcs > hosts or hosts > 250 * dcs:
        raise ValueError(f"need 1 <= dcs <= hosts <= 250 * dcs, got {hosts=} {dcs=}")
    if nic_mbit <= 0 or (wan_mbit is not None and wan_mbit <= 0) or wan_delay_ms < 0:
        raise ValueError("rates must be > 0 and the delay >= 0")
    spec = uniform(hosts, nic_mbit, dcs, wan_mbit, wan_delay_ms)
    with open_topology(spec, prefix, mtu) as cluster:
        yield cluster


@contextmanager
def open_topology(spec: ClusterSpec, prefix: str | None = None, mtu: int = 9000
                  ) -> Iterator[Cluster]:
    """Build the cluster ``spec`` describes (see :func:`open_cluster`), yield it, and
    always remove everything it created."""
    check_support(len(spec.dcs))
    if prefix is None:
        cleanup_stale()
        prefix = f"{DEFAULT_FAMILY}{os.getpid()}-{secrets.token_hex(2)}-"
    cluster = Cluster(prefix, spec, mtu)
    with _signals_as_exit():
        try:
            cluster._build()
            yield cluster
        finally:
            with _signals_blocked():
                cluster._teardown()


def cleanup_stale(prefix: str = DEFAULT_FAMILY) -> list[str]:
    """Remove namespaces and scratch dirs starting with ``prefix``; return their names.

    The namespaces' processes are ended first. Names made from a default prefix carry
    their owner's pid; those whose owner is still alive are left alone, so concurrent runs
    are safe.
    """

    def stale(name: str) -> bool:
        owner = _OWNER.match(name)
        return name.startswith(prefix) and not (owner and _alive(int(owner.group(1))))

    removed = []
    for name in filter(stale, _namespaces()):
        _end_namespace(name)
        removed.append(name)
    for scratch in Path(tempfile.gettempdir()).glob(f"*{_SCRATCH}"):
        if stale(scratch.name):
            shutil.rmtree(scratch)
            removed.append(scratch.name)
    return removed


# -- helpers ----------------------------------------------------------------------------


def _run(argv: Sequence[str], stdin: str | None = None) -> str:
    done = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        message = f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}"
        if "Operation not permitted" in done.stderr:
            raise ClusterUnavailable(message)
        raise ClusterCommandError(message)
    return done.stdout


def _ip(*args: str) -> str:
    return _run(["ip", *args])


def _sh(namespace: str, *argv: str) -> str:
    return _run(["ip", "netns", "exec", namespace, *argv])


def _cap(namespace: str, dev: str, mbit: float) -> None:
    """Egress token bucket: ``mbit`` sustained, 64 KiB bursts (one GSO packet), 50 ms queue."""
    burst = _burst(mbit)
    _run(["tc", "-n", namespace, "qdisc", "add", "dev", dev, "root", "tbf",
          "rate", f"{round(mbit * 1000)}kbit", "burst", str(burst), "latency", "50ms"])  # fmt: skip


def _burst(mbit: float) -> int:
    """64 KiB (one GSO packet), or 1 ms at rate if more."""
    return max(64 * 1024, int(mbit * 1e6 / 8 / 1000))


def _counters(namespace: str, dev: str) -> LinkCounters:
    (link,) = json.loads(_ip("-n", namespace, "-s", "-j", "link", "show", "dev", dev))
    stats = link["stats64"]
    return LinkCounters(
        stats["rx"]["bytes"], stats["tx"]["bytes"], stats["rx"]["packets"], stats["tx"]["packets"]
    )


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _end(process: subprocess.Popen[Any]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(_GRACE_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    for stream in (process.stdin, process.stdout, process.stderr):
        if stream is not None:
            stream.close()


def _end_namespace(name: str) -> None:
    """End every process in namespace ``name``, then delete it."""
    _end_processes(name)
    _ip("netns", "del", name)


def _end_processes(name: str) -> None:
    """End every process in namespace ``name`` (ours: only we start processes there)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = [int(p) for p in _ip("netns", "pids", name).split()]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):  # it exited on its own meanwhile
                os.kill(pid, sig)
        deadline = time.monotonic() + _GRACE_S
        while pids and time.monotonic() < deadline:
            pids = [pid for pid in pids if _alive(pid) and not _zombie(pid)]
            time.sleep(0.05)
        if not pids:
            return


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True  # gone


def read_line(process: subprocess.Popen[str], timeout_s: float) -> str:
    """The next line ``process`` prints on stdout, stripped.

    Raises ``TimeoutError`` if none comes within ``timeout_s`` (the reading thread then
    stays blocked until the process ends) and ``EOFError`` if the process closes stdout.
    """
    stdout = process.stdout
    if stdout is None:
        raise ValueError("start the process with stdout=subprocess.PIPE")
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not lines:
        raise TimeoutError(f"{process.args!r} printed no line within {timeout_s} s")
    if not lines[0]:
        raise EOFError(f"{process.args!r} closed its output (exit code {process.poll()})")
    return lines[0].strip()


@contextmanager
def _signals_as_exit() -> Iterator[None]:
    """While open in the main thread, SIGTERM/SIGHUP unwind like Ctrl-C (cleanup runs)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def exit_on(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, exit_on) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def _signals_blocked() -> Iterator[None]:
    """Hold SIGINT/SIGTERM/SIGHUP until the block ends, so teardown is not cut short."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
