"""Secure meshes of real peers over loopback ZeroMQ: who may join, speak and publish."""

from __future__ import annotations

import itertools
import logging
import os
from dataclasses import replace

import numpy as np
import pytest
import trio
import zmq
import zmq.utils.z85
from helpers import Keys, open_mesh, wait_until

import tensorhub
from tensorhub import LocalProtocolError, PeerConfig
from tensorhub.errors import ConfigError
from tensorhub.model import VersionKey
from tensorhub.peer.zap import ZapHandler
from tensorhub.protocol import codec
from tensorhub.protocol.control import RefsDelta
from tensorhub.protocol.membership import ALIVE, Gossip, PushPull, Update
from tensorhub.protocol.messages import register_all
from tensorhub.protocol.refs import OriginEntry, Stamp
from tensorhub.security import Identity, Keyring, Security

register_all()


def weights(version: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(version)
    return {"w": rng.standard_normal((512, 512)).astype(np.float32)}


def test_insecure_needs_loopback_or_an_explicit_opt_out() -> None:
    PeerConfig.local("a")  # loopback: allowed, and said loudly at start
    with pytest.raises(ConfigError, match="tensorhub keygen"):
        PeerConfig("a", listen="0.0.0.0:0")
    with pytest.raises(ConfigError, match="without keys"):
        PeerConfig("a", data_listen="10.1.2.3:0")
    PeerConfig("a", listen="0.0.0.0:0", allow_insecure=True)
    keys = Keys(["a"], {})
    PeerConfig("a", listen="0.0.0.0:0", security=keys.security("a"))


async def test_insecure_mode_is_said_in_statistics_and_the_log(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="tensorhub.peer"):
        async with tensorhub.open_peer(PeerConfig.local("solo")) as peer:
            assert peer.statistics().security.startswith("insecure")
    assert any("solo" in r.getMessage() and "insecure" in r.getMessage()
               for r in caplog.records)


async def test_members_gossip_publish_and_fetch_with_keys() -> None:
    keys = Keys(["p0", "p1", "p2"], {"m": ["p0"]})
    async with open_mesh(3, keys=keys) as (pub, a, b):
        w = weights(1)
        await pub.publish("m", 1, w)
        with trio.fail_after(10):
            assert await b.wait_for_version("m") == 1
            assert await a.wait_for_version("m") == 1
        got = await a.fetch("m", "latest")
        np.testing.assert_array_equal(got.tensors["w"], w["w"])
        key = VersionKey("m", 1)
        # the copy carries the publisher's signature, so b counts a as a holder too
        await wait_until(lambda: {p.name for p, h in b.control.holders(key) if h.complete}
                         == {"p0", "p1"}, 20)
        st = b.statistics()
        assert st.security.startswith("keys:") and st.refused.get("membership claim", 0) == 0
        with pytest.raises(LocalProtocolError, match="not a publisher"):
            await a.publish("m", 2, w)


_PROBE_PORTS = itertools.count(40000 + os.getpid() % 10000)


def _ask_members(ctx: zmq.Context[zmq.Socket[bytes]], control: str,
                 curve: tuple[bytes, bytes] | None, server: bytes, name: str) -> bool:
    """A PushPull asking the peer at ``control`` for its members (blocking; run in a
    thread): True iff anything came back."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    ident = f"tcp://127.0.0.1:{next(_PROBE_PORTS)}"  # a routing id never used before
    sock.setsockopt(zmq.ROUTING_ID, ident.encode())
    if curve is not None:
        sock.setsockopt(zmq.CURVE_PUBLICKEY, curve[0])
        sock.setsockopt(zmq.CURVE_SECRETKEY, curve[1])
        sock.setsockopt(zmq.CURVE_SERVERKEY, server)
    sock.connect(control)
    sock.send(codec.encode(PushPull(ident, name, b"", (), True)))
    got = sock.poll(1500)
    sock.close(0)
    return bool(got)


async def test_non_members_get_nothing_through_and_are_counted() -> None:
    keys = Keys(["p0", "p1"], {"m": ["p0"]})
    async with open_mesh(2, keys=keys) as (p0, _p1):
        server_public = keys.cluster.z85()[0]
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()

        async def ask(curve: tuple[bytes, bytes] | None, name: str = "intruder") -> bool:
            return await trio.to_thread.run_sync(
                _ask_members, ctx, p0.info.control, curve, server_public, name)

        try:
            # libzmq admits any CURVE client key unless a ZAP handler refuses it
            assert not await ask(Identity.generate().curve_keys())
            assert not await ask(None)  # no CURVE at all
            # a member's key under another name is refused by the dispatcher ...
            assert not await ask(keys.ids["p1"].curve_keys())
            # ... and under its own name answered (so the probe is sound)
            assert await ask(keys.ids["p1"].curve_keys(), "p1")
        finally:
            ctx.destroy(0)
        await wait_until(lambda: p0.statistics().refused.get("not a member", 0) >= 1
                         and p0.statistics().refused.get("handshake", 0) >= 2
                         and p0.statistics().refused.get("sender name", 0) >= 1, 20)
        assert "intruder" not in p0.members()


async def test_a_member_cannot_forge_another_origins_words() -> None:
    keys = Keys(["p0", "p1", "p2"], {"m": ["p0"]})
    async with open_mesh(3, keys=keys) as (p0, p1, p2):
        await p0.publish("m", 1, weights(1))
        await wait_until(lambda: p2.control.latest("m") == 1, 20)
        # p1 (a member, signing with its own key) speaks for p0: leaves for it, writes
        # its reference entry, and announces m@999 as if p0 had published it
        me = p1.control
        forged_left = Update(3, "p0", 2**62, "p0", None, me.trust.sign(b"x"))
        stamp = p0.control.refs.local.stamp
        held = p0.control.refs.local.holdings[0]
        fake = replace(held, version=999)
        forged_entry = OriginEntry(Stamp("p0", stamp.generation + 1, 0), (fake,))
        forged_entry = replace(forged_entry, sig=me.trust.sign(forged_entry.signed_bytes()))
        # p1's own entry announces m@999: a copy of p0's signature (which does not cover
        # 999), and its own signed publish (p1 may not publish m)
        mine = me.sign_announcement(replace(fake, manifest_id=b"r" * 16))
        own = OriginEntry(Stamp("p1", me.refs.local.stamp.generation + 1, 0), (fake, mine))
        own = replace(own, sig=me.trust.sign(own.signed_bytes()))
        for msg in (PushPull(p1.info.control, "p1", b"", (forged_left,), False),
                    RefsDelta(p1.info.control, "p1", (forged_entry, own))):
            assert p1.send_to("p2", msg)
        await wait_until(lambda: p2.statistics().refused.get("reference entry", 0) >= 1
                         and p2.statistics().refused.get("membership claim", 0) >= 1, 20)
        assert p2.members()["p0"][1] == ALIVE
        assert p2.control.refs.local.stamp.origin == "p2"
        held_by_p0 = [h for e in p2.control.refs.origins() if e.origin == "p0"
                      for h in e.holdings]
        assert [h.version for h in held_by_p0] == [1]
        await wait_until(lambda: any(h.version == 999 for e in p2.control.refs.origins()
                                     if e.origin == "p1" for h in e.holdings), 20)
        assert p2.control.latest("m") == 1  # m@999 from p1 is not a version
        assert not p2.control.holders(VersionKey("m", 999))
        assert not p2.unsealed("m")


async def test_a_peer_that_refutes_its_death_is_a_holder_again() -> None:
    # No keys, no attacker: p0 is declared dead for a moment (a pause, a GC stall) by
    # p1 and p2, which forget its references; it refutes, and must be listed again.
    async with open_mesh(3) as peers:
        p0, p1, p2 = peers
        await wait_until(lambda: all(len(p.control.membership.live_members()) == 3
                                     for p in peers), 20)
        await p0.publish("m", 1, weights(1))
        key = VersionKey("m", 1)
        await wait_until(lambda: all([q.name for q, _ in p.control.holders(key)] == ["p0"]
                                     for p in (p1, p2)), 20)
        inc = p0.control.membership.incarnation
        for p in (p1, p2):
            death = Update(2, "p0", inc, p.info.name, None)
            # as if p had heard of the death: its protocol takes it in at once, and the
            # shell sends what it answers (no public call hands a peer its own input)
            p._send(p.control.receive(trio.current_time(), Gossip(
                p.info.control, p.info.name, (death,))))
            assert p.members()["p0"][1] == "dead" and not p.control.holders(key)
        await wait_until(lambda: p0.control.membership.incarnation > inc, 20)  # refuted
        await wait_until(lambda: all([q.name for q, _ in p.control.holders(key)] == ["p0"]
                                     for p in (p1, p2)), 20)
        assert p1.control.latest("m") == 1


async def test_key_rotation_while_a_fetch_is_in_flight() -> None:
    keys = Keys(["p0", "p1", "p2"], {"m": ["p0"]})
    async with open_mesh(3, keys=keys, fetch_window=1, chunk_size=128 << 10) as peers:
        p0, p1, p2 = peers
        rng = np.random.default_rng(3)
        w = {"w": rng.integers(0, 255, 64 << 20, dtype=np.uint8)}
        await p0.publish("m", 1, w)
        await wait_until(lambda: p1.control.latest("m") == 1, 20)
        key = VersionKey("m", 1)
        got: dict[str, np.ndarray] = {}

        async def fetch() -> None:
            got.update((await p1.fetch("m", 1)).tensors)

        def partial() -> bool:
            local = p1.store.get(key)
            return local is not None and 0 < local.num_verified < local.manifest.num_chunks

        async with trio.open_nursery() as nursery:
            nursery.start_soon(fetch)
            await wait_until(partial, 20, every=0.001)
            old, new = keys.ids["p0"], Identity.generate()
            ring = {n: [i.public] for n, i in keys.ids.items()}
            for p in peers:  # 1. add the new key everywhere
                p.update_keyring({**ring, "p0": [old.public, new.public]})
            inc = p0.control.membership.incarnation
            p0.rotate_identity(new)  # 2. switch: p0 re-signs its claim and its entry
            stamp = p0.control.refs.local.stamp
            await wait_until(lambda: all(
                p.members()["p0"][1] == ALIVE and p.control.membership.members()["p0"]
                .incarnation > inc and any(e.stamp == stamp for e in p.control.refs.origins())
                for p in (p1, p2)), 20)
            for p in peers:  # 3. remove the old key
                p.update_keyring({**ring, "p0": [new.public]})
            in_flight_at_removal = partial()
        np.testing.assert_array_equal(got["w"], w["w"])  # the fetch completed, verified
        assert in_flight_at_removal  # (by a wide margin: ~30 of 512 chunks here)
        # p1's copy adopted p0's new signature, so it still counts towards the seal
        await wait_until(lambda: {c.origin for c in p2.control.claims("m")} == {"p0", "p1"}, 20)
        # gossip goes on under the new key: a new version spreads
        await p0.publish("m", 2, weights(2))
        await wait_until(lambda: p2.control.latest("m") == 2 and p1.control.latest("m") == 2, 20)
        # and the data plane proves p0's new key: a new connection reads from it
        again = await p2.fetch("m", 2, sources=["p0"])
        np.testing.assert_array_equal(again.tensors["w"], weights(2)["w"])
        # a frame signed with the old key is refused
        refused = p2.statistics().refused.get("reference entry", 0)
        st = p0.control.refs.local.stamp
        stale = OriginEntry(Stamp("p0", st.generation, st.seq + 100), ())
        stale = replace(stale, sig=old.sign(stale.signed_bytes()))
        assert p1.send_to("p2", RefsDelta(p1.info.control, "p1", (stale,)))
        await wait_until(lambda: p2.statistics().refused.get("reference entry", 0) > refused, 20)
        assert p2.control.holders(VersionKey("m", 2))


def test_zap_answers_every_request_and_admits_members_only() -> None:
    keys = Keys(["p0"], {})
    ring = keys.security("p0").keyring
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        zap = ZapHandler(ctx, ring)
        member_key = zmq.utils.z85.decode(keys.ids["p0"].curve_keys()[0])
        stranger = zmq.utils.z85.decode(Identity.generate().curve_keys()[0])
        head = [b"1.0", b"7", b"tensorhub", b"127.0.0.1", b""]
        assert zap.answer([*head, b"CURVE", member_key])[2:5] == [b"200", b"OK", b"p0"]
        assert zap.answer([*head, b"CURVE", stranger])[2] == b"400"
        assert zap.answer([*head, b"NULL"])[2] == b"400"
        assert zap.answer([b"junk"]) == [b"1.0", b"", b"400", b"not a member of this cluster",
                                         b"", b""]
        ring.replace({})  # rotation: consulted at every handshake
        assert zap.answer([*head, b"CURVE", member_key])[2] == b"400"
        assert (zap.admitted, zap.refused) == (1, 4)
        zap.close()
    finally:
        ctx.term()


async def test_an_outsider_peer_cannot_join() -> None:
    keys = Keys(["p0", "p1"], {"m": ["p0"]})
    outsider = Identity.generate()
    # the outsider knows the cluster key and lists itself, but the members do not
    ring = Keyring({**{n: [i.public] for n, i in keys.ids.items()}, "x": [outsider.public]})
    async with open_mesh(2, keys=keys) as (p0, p1):
        await p0.publish("m", 1, weights(1))
        seed = (p0.info.control.removeprefix("tcp://"),)
        cfg = PeerConfig.local("x", join=seed, security=Security(outsider, keys.cluster, ring))
        async with tensorhub.open_peer(cfg) as x:
            await wait_until(lambda: p0.statistics().refused.get("not a member", 0) >= 1, 20)
            await trio.sleep(1.0)  # a few probe and gossip rounds: nothing gets through
            assert set(x.members()) == {"x"} and x.control.latest("m") is None
            assert "x" not in p0.members() and "x" not in p1.members()
