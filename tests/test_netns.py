"""The emulated cluster harness (tensorhub.testing.netns) and its delaying relay.

The relay tests run anywhere (loopback only). The cluster tests need root, ``ip``, ``tc``
and ``nft``; they skip with the reason where a namespace cannot be made. They check the
harness, not TensorHub: addresses reach each other, ``tc`` caps hold within a generous
band, the inter-DC relay adds its delay, the WAN counters see the bytes that crossed, and
nothing is left behind on exceptions, SIGINT, SIGTERM or after a SIGKILL.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import leftovers

from tensorhub.bench import baselines
from tensorhub.testing import netns
from tensorhub.testing.clusterspec import parse_topology
from tensorhub.testing.netns import ClusterUnavailable, cleanup_stale, open_cluster, open_topology

RELAY = Path(netns.__file__).with_name("relay.py")
ROOT = Path(__file__).resolve().parents[1]
# Child Pythons import this checkout (after any PYTHONPATH the run was given).
CHILD_ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)])),
}
MIB = 1024 * 1024

# Small programs run inside the namespaces; they print one result line.
SERVE = r"""
import socket, sys
size, conns = int(sys.argv[1]), int(sys.argv[2])
listener = socket.create_server(("0.0.0.0", 9000), backlog=16)
print("ready", flush=True)
payload = memoryview(bytes(range(256)) * (size // 256))
for _ in range(conns):
    conn, _ = listener.accept()
    conn.recv(1)
    conn.sendall(payload)
    conn.close()
"""
PULL = r"""
import socket, sys, time
size = int(sys.argv[2])
view = memoryview(bytearray(size))
conn = socket.create_connection((sys.argv[1], 9000))
start = time.monotonic()
conn.sendall(b"g")
got = 0
while got < size and (n := conn.recv_into(view[got:])):
    got += n
ok = view[:256].tobytes() == bytes(range(256)) and view[-256:].tobytes() == bytes(range(256))
print(got, ok, start, time.monotonic(), flush=True)
"""
ECHO = r"""
import socket
listener = socket.create_server(("0.0.0.0", 9001), backlog=16)
print("ready", flush=True)
while True:
    conn, _ = listener.accept()
    while data := conn.recv(65536):
        conn.sendall(data)
    conn.close()
"""
PING = r"""
import socket, sys, time
for ip in sys.argv[1:]:
    conn = socket.create_connection((ip, 9001), timeout=5)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(5):
        start = time.monotonic()
        conn.sendall(b"p")
        assert conn.recv(1) == b"p"
        rtts.append(time.monotonic() - start)
    print(ip, min(rtts), flush=True)
"""


def _python(cluster: netns.Cluster, host: str, code: str, *args: object) -> subprocess.Popen[str]:
    return cluster.run(
        host, [sys.executable, "-c", code, *map(str, args)], stdout=subprocess.PIPE, text=True
    )


def _started(process: subprocess.Popen[str]) -> subprocess.Popen[str]:
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "ready"
    return process


def _pull(cluster: netns.Cluster, pairs: list[tuple[str, str]], size: int) -> float:
    """Every (source, receiver) pair moves ``size`` bytes at once; aggregate bytes/s."""
    sources = {source for source, _ in pairs}
    for source in sources:
        conns = sum(1 for s, _ in pairs if s == source)
        _started(_python(cluster, source, SERVE, size, conns))
    pullers = [_python(cluster, r, PULL, cluster.host(s).ip, size) for s, r in pairs]
    results = [p.communicate(timeout=30)[0].split() for p in pullers]
    assert all(int(got) == size and ok == "True" for got, ok, _, _ in results), results
    elapsed = max(float(r[3]) for r in results) - min(float(r[2]) for r in results)
    return size * len(pairs) / elapsed


def _round_trips(cluster: netns.Cluster, src: str, dsts: list[str]) -> dict[str, float]:
    """Best of five TCP round trips from ``src`` to each of ``dsts`` (echo servers up)."""
    ping = _python(cluster, src, PING, *(cluster.host(d).ip for d in dsts))
    out = ping.communicate(timeout=10)[0]
    return {ip: float(rtt) for ip, rtt in (line.split() for line in out.splitlines())}


# -- the relay, on loopback -------------------------------------------------------------


@pytest.fixture
def echo_server() -> Iterator[int]:
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # listener closed: the test is over
            with conn:
                while data := conn.recv(65536):
                    conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    yield listener.getsockname()[1]
    listener.close()


def _relay(target_port: int, one_way_ms: float) -> tuple[subprocess.Popen[str], int]:
    relay = subprocess.Popen(
        [sys.executable, str(RELAY), "--listen", "127.0.0.1:0",
         "--to", f"127.0.0.1:{target_port}", "--one-way-ms", str(one_way_ms)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert relay.stdout is not None
    line = relay.stdout.readline()
    assert line.startswith("relay listening on"), line
    return relay, int(line.rsplit(":", 1)[1])


def test_relay_delays_each_direction_and_keeps_order(echo_server: int) -> None:
    relay, port = _relay(echo_server, one_way_ms=25)
    try:
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            start = time.monotonic()
            conn.sendall(b"p")
            assert conn.recv(1) == b"p"
            assert 0.045 <= time.monotonic() - start < 0.5  # 2 x 25 ms one way
            payload = os.urandom(3 * MIB)  # more than one chunk, in order, after half-close

            def send() -> None:
                conn.sendall(payload)
                conn.shutdown(socket.SHUT_WR)

            sender = threading.Thread(target=send)
            sender.start()
            echoed = bytearray()
            while data := conn.recv(MIB):
                echoed += data
            sender.join()
            assert echoed == payload
    finally:
        relay.terminate()
        relay.wait()


def test_relay_resets_client_when_target_refuses() -> None:
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    relay, relay_port = _relay(port, one_way_ms=0)
    try:
        with socket.create_connection(("127.0.0.1", relay_port)) as conn:
            conn.settimeout(5)
            with pytest.raises(ConnectionResetError):
                conn.sendall(b"x")
                conn.recv(1)
    finally:
        relay.terminate()
        relay.wait()


# -- the cluster ------------------------------------------------------------------------


@pytest.mark.netns
def test_four_hosts_reach_each_other_and_nics_are_capped(cluster_support: None) -> None:
    cap = 200e6 / 8  # bytes/s
    with open_cluster(4, nic_mbit=200) as cluster:
        names = [h.name for h in cluster.hosts]
        assert len({h.ip for h in cluster.hosts}) == 4
        for name in names:
            _started(_python(cluster, name, ECHO))
        for name in names:
            others = [n for n in names if n != name]
            assert set(_round_trips(cluster, name, others)) == {
                cluster.host(n).ip for n in others
            }
        single = _pull(cluster, [("h0", "h1")], 6 * MIB)
        upload = _pull(cluster, [("h0", "h2"), ("h0", "h3")], 3 * MIB)
        download = _pull(cluster, [("h2", "h1"), ("h3", "h1")], 3 * MIB)
        for rate in (single, upload, download):
            assert 0.7 * cap <= rate <= 1.3 * cap, (single, upload, download, cap)
        assert cluster.nic_counters("h0").tx_bytes >= 12 * MIB


@pytest.mark.netns
def test_two_dcs_add_relay_delay_and_count_wan_bytes(wan_support: None) -> None:
    size = 4 * MIB
    with open_cluster(4, nic_mbit=200, dcs=2, wan_mbit=100, wan_delay_ms=20) as cluster:
        assert [h.dc for h in cluster.hosts] == [0, 0, 1, 1]
        for name in ("h1", "h2"):
            _started(_python(cluster, name, ECHO))
        rtts = _round_trips(cluster, "h0", ["h1", "h2"])
        local, remote = rtts[cluster.host("h1").ip], rtts[cluster.host("h2").ip]
        assert 0.018 <= remote - local <= 0.060, rtts
        before = cluster.wan_counters()
        _pull(cluster, [("h0", "h1")], size)  # stays inside DC 0
        assert cluster.wan_bytes() - sum(c.tx_bytes for c in before.values()) < 64 * 1024
        before = cluster.wan_counters()
        rate = _pull(cluster, [("h0", "h3")], size)  # crosses once, DC 0 -> DC 1
        crossed = {dc: c - before[dc] for dc, c in cluster.wan_counters().items()}
        assert size <= crossed[1].tx_bytes <= 1.05 * size, crossed  # into DC 1
        assert size <= crossed[0].rx_bytes <= 1.05 * size, crossed  # out of DC 0
        assert crossed[0].tx_bytes < 0.05 * size  # only ACKs go back
        assert rate <= 1.3 * 100e6 / 8


@pytest.mark.netns
def test_three_dcs_give_each_pair_its_rate_and_round_trip(wan_support: None) -> None:
    spec = parse_topology("""
        [[dc]]
        name = "a"
        hosts = [200, 100]
        [[dc]]
        name = "b"
        hosts = [200]
        [[dc]]
        name = "c"
        hosts = [200]
        [[link]]
        between = ["a", "b"]
        mbit = 50
        rtt_ms = 40
        [[link]]
        between = ["a", "c"]
        mbit = 100
        rtt_ms = 10
        [[link]]
        between = ["b", "c"]
        rtt_ms = 0
    """)
    with open_topology(spec) as cluster:
        assert [(h.dc, h.nic_mbit) for h in cluster.hosts] == [(0, 200), (0, 100), (1, 200),
                                                                 (2, 200)]
        for name in ("h1", "h2", "h3"):
            _started(_python(cluster, name, ECHO))
        rtts = _round_trips(cluster, "h0", ["h1", "h2", "h3"])
        local = rtts[cluster.host("h1").ip]
        assert 0.038 <= rtts[cluster.host("h2").ip] - local <= 0.080, rtts
        assert 0.009 <= rtts[cluster.host("h3").ip] - local <= 0.040, rtts
        rates = {pair: _pull(cluster, [pair], 3 * MIB)
                 for pair in [("h0", "h1"), ("h0", "h2"), ("h2", "h0"), ("h0", "h3"),
                              ("h2", "h3")]}
        expected = {("h0", "h1"): 100, ("h0", "h2"): 50, ("h2", "h0"): 50, ("h0", "h3"): 100,
                    ("h2", "h3"): 200}  # the slower NIC, the pair's cap, or both NICs
        for pair, mbit in expected.items():
            assert 0.7 * mbit <= rates[pair] * 8 / 1e6 <= 1.3 * mbit, (pair, rates)
    assert leftovers(cluster.prefix) == []


@pytest.mark.netns
def test_one_way_links_cap_each_direction_and_change_while_running(wan_support: None) -> None:
    spec = parse_topology("""
        [[dc]]
        name = "a"
        hosts = [200]
        [[dc]]
        name = "b"
        hosts = [200]
        [[link]]
        from = "a"
        to = "b"
        mbit = 100
        rtt_ms = 10
        [[link]]
        from = "b"
        to = "a"
        mbit = 40
        rtt_ms = 10
    """)
    with open_topology(spec) as cluster:
        assert (cluster.link_rate_mbit(0, 1), cluster.link_rate_mbit(1, 0)) == (100, 40)
        there = _pull(cluster, [("h0", "h1")], 3 * MIB) * 8 / 1e6
        back = _pull(cluster, [("h1", "h0")], 2 * MIB) * 8 / 1e6
        assert 70 <= there <= 130 and 28 <= back <= 52, (there, back)
        cluster.set_link_rate(0, 1, 40)
        assert cluster.link_rate_mbit(0, 1) == 40
        assert cluster.link_rate_mbit(1, 0) == 40  # the other direction as it was
        slower = _pull(cluster, [("h0", "h1")], 2 * MIB) * 8 / 1e6
        assert 28 <= slower <= 52, slower
        with pytest.raises(ValueError, match="> 0"):
            cluster.set_link_rate(0, 1, 0)
    assert leftovers(cluster.prefix) == []


@pytest.mark.netns
def test_everything_is_removed_when_the_body_raises(wan_support: None) -> None:
    with (
        pytest.raises(RuntimeError, match="boom"),
        open_cluster(2, nic_mbit=100, dcs=2, wan_delay_ms=2) as cluster,
    ):
        sleeper = cluster.run("h1", ["sleep", "60"])
        assert len(leftovers(cluster.prefix)) == 5  # sw, h0, h1, rt, scratch
        raise RuntimeError("boom")
    assert leftovers(cluster.prefix) == []
    assert sleeper.poll() is not None


OWNER = r"""
import signal, sys, time
from tensorhub.testing.netns import open_cluster
# Ctrl-C raises, as in a terminal, also when the suite runs as a background job (its
# children inherit SIGINT ignored, and Python then keeps it ignored)
signal.signal(signal.SIGINT, signal.default_int_handler)
with open_cluster(2, nic_mbit=100, dcs=2, prefix=sys.argv[1] or None) as cluster:
    cluster.run("h0", ["sleep", "60"])
    print(cluster.prefix, flush=True)
    time.sleep(60)
"""


def _owner(prefix: str) -> tuple[subprocess.Popen[str], str]:
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, prefix], stdout=subprocess.PIPE, text=True, env=CHILD_ENV
    )
    assert owner.stdout is not None
    return owner, owner.stdout.readline().strip()


@pytest.mark.netns
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_everything_is_removed_on_signal(wan_support: None, sig: signal.Signals) -> None:
    owner, prefix = _owner("")
    assert len(leftovers(prefix)) == 5
    owner.send_signal(sig)
    owner.wait(timeout=20)
    assert leftovers(prefix) == []


@pytest.mark.netns
def test_cleanup_stale_removes_what_a_killed_run_left(wan_support: None) -> None:
    owner, prefix = _owner("")  # default prefix: carries the owner's pid
    assert cleanup_stale(prefix) == []  # the owner lives: not stale
    owner.kill()
    owner.wait()
    left = leftovers(prefix)  # SIGKILL: no chance to clean up
    assert len(left) == 5
    orphans = [  # the sleeper and the relay outlived their owner
        int(pid)
        for name in left[:-1]
        for pid in subprocess.run(
            ["ip", "netns", "pids", name], capture_output=True, text=True
        ).stdout.split()
    ]
    assert len(orphans) == 2
    assert sorted(cleanup_stale(prefix)) == sorted(left)
    assert leftovers(prefix) == []
    assert all(_dead(pid) for pid in orphans)


def _dead(pid: int) -> bool:
    """Exited: gone, or a zombie that init has not reaped yet."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def test_refuses_clearly_without_root_or_tools(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ClusterUnavailable, match="need root"), open_cluster(2, nic_mbit=100):
        pass
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda tool: None if tool == "nft" else tool)
    netns.check_support(dcs=1)
    with pytest.raises(ClusterUnavailable, match=r"missing nft .*nftables"):
        netns.check_support(dcs=2)


@pytest.mark.netns
def test_star_baseline_takes_about_its_bound(cluster_support: None) -> None:
    with open_cluster(3, nic_mbit=200) as cluster:
        bound = baselines.star_bound_s(cluster, 2 * MIB)
        assert bound == pytest.approx(2 * 2 * MIB / 25e6)
        assert 0.8 * bound <= baselines.star(cluster, 2 * MIB) <= 2.5 * bound


def test_sizes_parse() -> None:
    assert baselines.parse_size("64MiB") == 64 * MIB
    assert baselines.parse_size("3 gib") == 3 << 30
    assert baselines.parse_size("512") == 512
    with pytest.raises(argparse.ArgumentTypeError, match="not a size"):
        baselines.parse_size("64MB")
