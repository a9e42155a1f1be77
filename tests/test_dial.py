"""The transport dial: ``PeerConfig.transports`` in order, each detected at start; one
asked for and unavailable is an error; the transport chosen per holder, and every
refusal, show in ``statistics()`` and the fetch report."""

from __future__ import annotations

import re

import numpy as np
import pytest
import trio
from helpers import open_mesh
from test_mesh import weights
from test_staging import HostAsDevice, host_rings

import tensorhub
from tensorhub import ConfigError, PeerConfig
from tensorhub.transport.dial import detect, probe_backend

HOST = (("host", "h1"),)


async def publish_and_fetch(pub: tensorhub.Peer, reader: tensorhub.Peer,
                            w: dict[str, np.ndarray], version: int) -> tensorhub.Fetched:
    """``pub`` publishes ``w`` as ``m@version``; ``reader`` fetches it, checked."""
    await pub.publish("m", version, w)
    with trio.fail_after(10):
        await reader.wait_for_version("m", version - 1)
    got = await reader.fetch("m", version)
    for k in w:
        np.testing.assert_array_equal(got.tensors[k], w[k])
    return got


def test_unknown_or_repeated_transports_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="once each"):
        PeerConfig.local("a", transports=("tcp", "carrier-pigeon"))
    with pytest.raises(ConfigError, match="once each"):
        PeerConfig.local("a", transports=("tcp", "tcp"))
    with pytest.raises(ConfigError):
        PeerConfig.local("a", transports=())
    assert PeerConfig.local("a", transports=("rdma", "cuda-ipc", "shm", "tcp")).transports


@pytest.mark.parametrize("name", ["rdma", "cuda-ipc"])
async def test_a_transport_asked_for_and_unavailable_fails_the_start(name: str) -> None:
    ok, why = detect(name)
    if ok:
        pytest.skip(f"{name} is usable on this machine: {why}")
    config = PeerConfig.local("a", transports=(name, "tcp"))
    with pytest.raises(ConfigError, match=re.escape(f"{name}: {why}")):
        async with tensorhub.open_peer(config):
            pass


def test_the_real_backends_say_why_they_are_missing() -> None:
    for name in ("rdma", "cuda-ipc"):
        factory, why = probe_backend(name)
        print(f"{name}: {'available' if factory else 'unavailable'}: {why}")
        assert why


async def test_a_fetch_over_the_rdma_stand_in_shows_its_transport() -> None:
    async with open_mesh(2, transports=("rdma-standin", "tcp"), planning=False) as (pub, reader):
        w = weights(1, mib=2)
        got = await publish_and_fetch(pub, reader, w, 1)
        assert got.report.transport_by_source == {"p0": "rdma-standin"}
        assert got.report.transport_refusals == {}
        stats = reader.statistics()
        assert stats.transports["rdma-standin"].startswith("available")
        assert stats.transport_chosen == {"p0": "rdma-standin"}
        assert stats.bytes_by_transport == {"rdma-standin": got.report.bytes}
        served = pub.statistics().registrations["rdma-standin"]
        assert served["registered"] == len(w) and served["granted"] == len(w)
        # The next version in the same arrays: nothing registered again, v1's keys revoked
        await pub.unpublish("m", 1)
        for a in w.values():
            a += 1
        got = await publish_and_fetch(pub, reader, w, 2)
        served = pub.statistics().registrations["rdma-standin"]
        assert served["registered"] == len(w) and served["revoked"] == len(w)
        assert served["granted"] == 2 * len(w)
        links, pool = pub.reader.dialer.host.links_opened, reader.reader.pool
        print("links opened", links, "pool", pool.opened, pool.reused)
        assert links == pool.opened  # kept between fetches
        assert pool.reused > 0


async def test_every_refusal_shows_and_the_next_transport_is_used() -> None:
    """The reader prefers CUDA IPC, then RDMA; the holder serves neither and sits on
    another host: both are skipped, with their reasons, and TCP reads."""
    holder_cfg = PeerConfig.local("p0", transports=("tcp",), chunk_size=1 << 20,
                                  planning=False, labels=(("host", "h0"),))
    async with tensorhub.open_peer(holder_cfg) as pub:
        reader_cfg = PeerConfig.local(
            "p1", join=(pub.info.control.removeprefix("tcp://"),), chunk_size=1 << 20,
            planning=False, labels=HOST, transports=("cuda-ipc-standin", "rdma-standin",
                                                     "tcp"))
        async with tensorhub.open_peer(reader_cfg) as reader:
            got = await publish_and_fetch(pub, reader, weights(1, mib=1), 1)
            assert got.report.transport_by_source == {"p0": "tcp"}
            why = got.report.transport_refusals["p0"]
            assert "cuda-ipc-standin: p0 is on another host" in why
            assert "rdma-standin: p0 does not serve rdma-standin" in why
            refusals = reader.statistics().transport_refusals["p0"]
            assert set(refusals) == {"cuda-ipc-standin", "rdma-standin"}


async def test_same_host_peers_read_over_the_cuda_ipc_stand_in() -> None:
    async with open_mesh(2, transports=("cuda-ipc-standin", "shm", "tcp"), labels=HOST,
                         planning=False) as (pub, reader):
        got = await publish_and_fetch(pub, reader, weights(1, mib=1), 1)
        assert got.report.transport_by_source == {"p0": "cuda-ipc-standin"}


async def test_a_device_version_is_read_over_cuda_ipc_in_place_not_staged() -> None:
    """A version held in device memory (host memory posing as it, through host-copier
    rings) is granted to a CUDA IPC reader as its tensors themselves, and lands in the
    reader's tensors themselves, checked there against the device digests: neither
    staging ring copies anything."""
    async with open_mesh(2, transports=("cuda-ipc-standin", "tcp"), labels=HOST,
                         chunk_size=1 << 18, planning=False) as (pub, reader):
        for p in (pub, reader):
            host_rings(p)
        src = {"w": np.random.default_rng(3).standard_normal((300, 1000), np.float32),
               "b": np.arange(777, dtype=np.int64)}
        manifest = await pub.publish("m", 1, {k: HostAsDevice(v) for k, v in src.items()})
        assert manifest.num_chunks > 4
        staged = pub.device_rings.serve_cache(0).ring.statistics().claims  # the digests
        with trio.fail_after(10):
            await reader.wait_for_version("m", None)
        dst = {k: HostAsDevice(np.zeros_like(v)) for k, v in src.items()}
        got = await reader.fetch("m", 1, into=dst)
        assert got.report.verified
        assert got.report.transport_by_source == {"p0": "cuda-ipc-standin"}
        assert all(np.array_equal(dst[k].arr, v) for k, v in src.items())
        assert pub.device_rings.serve_cache(0).ring.statistics().claims == staged
        assert len(manifest.device_digests) == manifest.num_chunks
        assert got.report.device_digest_chunks == manifest.num_chunks
        with reader.device_rings.landing_ring(0) as ring:
            assert ring.statistics().claims == 0


async def test_without_tcp_a_holder_no_transport_reaches_is_not_read() -> None:
    async with open_mesh(2, transports=("rdma-standin", "tcp"), planning=False) as (pub, _):
        seed = pub.info.control.removeprefix("tcp://")
        cfg = PeerConfig.local("p9", join=(seed,), transports=("cuda-ipc-standin",),
                               stall_timeout=1.0, planning=False)
        async with tensorhub.open_peer(cfg) as reader:
            await pub.publish("m", 1, weights(1, mib=1))
            with trio.fail_after(10):
                await reader.wait_for_version("m", 0)
            with pytest.raises(tensorhub.VersionUnavailable):
                await reader.fetch("m", 1)
            assert "cannot tell whether p0 shares this host" in \
                reader.statistics().transport_refusals["p0"]["cuda-ipc-standin"]


async def test_a_chunk_the_holder_cannot_serve_one_sided_is_read_over_the_next() -> None:
    """A version in memory a one-sided backend cannot keep registered (here: arrays
    over ``bytes``; over CUDA IPC: host memory) is refused chunk by chunk; the reader
    skips that transport for the holder from then on, and reads over TCP."""
    async with open_mesh(2, transports=("rdma-standin", "tcp"), planning=False) as (pub, reader):
        w = {k: np.frombuffer(v.tobytes(), v.dtype).reshape(v.shape)
             for k, v in weights(1, mib=1).items()}  # read-only, over bytes objects
        got = await publish_and_fetch(pub, reader, w, 1)
        assert got.report.transport_by_source == {"p0": "tcp"}
        assert "cannot be weakly referenced" in got.report.transport_refusals["p0"]
        assert "rdma-standin" in reader.statistics().transport_refusals["p0"]
