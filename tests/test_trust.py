"""Signed words, sans-IO: membership claims, reference entries, version announcements."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from tensorhub import PeerConfig
from tensorhub.model import PeerInfo, VersionKey
from tensorhub.protocol.control import ControlPlane, RefsDelta
from tensorhub.protocol.coordination import CoordReply, CoordRequest
from tensorhub.protocol.membership import ALIVE, DEAD, SUSPECT, Gossip, Membership, Update
from tensorhub.protocol.refs import Holding, OriginEntry, RefTable, Stamp
from tensorhub.protocol.trust import Trust
from tensorhub.protocol.versions import ShardClaim, VersionView
from tensorhub.security import ClusterKey, Identity, Keyring, Security

A, S, D, L = range(4)
NAMES = ("a", "b", "c")
IDS = {n: Identity.generate() for n in NAMES}
CLUSTER = ClusterKey.generate()


def security(name: str, publishers: dict[str, list[str]] | None = None) -> Security:
    ring = Keyring({n: [i.public] for n, i in IDS.items()}, publishers or {"m": ["a"]})
    return Security(IDS[name], CLUSTER, ring, version_window=10)


def info(name: str, port: int | None = None) -> PeerInfo:
    port = port or 7000 + NAMES.index(name)
    return PeerInfo(name, f"tcp://127.0.0.1:{port}", f"127.0.0.1:{port + 100}")


def claim(by: str, kind: int, name: str, inc: int, who: PeerInfo | None = None) -> Update:
    u = Update(kind, name, inc, by, who if kind == A else None)
    return replace(u, sig=IDS[by].sign(u.signed_bytes()))


def member(name: str, trust: Trust | None = None) -> Membership:
    sec = security(name)
    cfg = PeerConfig.local(name, security=sec)
    return Membership(info(name), cfg, random.Random(1), 0.0, trust or Trust(sec), 100)


def hear(m: Membership, *updates: Update) -> None:
    m.receive(1.0, Gossip("tcp://127.0.0.1:7999", "c", updates))


def state(m: Membership, name: str) -> tuple[str, int] | None:
    st = m.members().get(name)
    return None if st is None else (st.status, st.incarnation)


def test_alive_claims_count_only_signed_by_the_member_itself() -> None:
    trust = Trust(security("a"))
    a = member("a", trust)
    hear(a, claim("c", A, "b", 5, info("b")))  # c vouches for b: not b's word
    assert state(a, "b") is None
    hear(a, claim("b", A, "b", 5, info("b")))
    assert state(a, "b") == (ALIVE, 5)
    assert trust.refused["membership claim"] == 1


def test_nobody_leaves_refutes_or_moves_for_another() -> None:
    a = member("a")
    hear(a, claim("b", A, "b", 5, info("b")), claim("c", A, "c", 3, info("c")))
    hear(a, claim("c", L, "b", 2**63))  # c says b left, for good: refused
    hear(a, replace(claim("c", L, "b", 9), origin="b"))  # signed by c, claimed as b's
    assert state(a, "b") == (ALIVE, 5)
    # an accusation of b's current incarnation: fine, but the info riding on it (not
    # covered by the accuser's signature) does not move b
    hear(a, replace(claim("c", S, "b", 5), info=info("b", 7666)))
    assert state(a, "b") == (SUSPECT, 5) and a.members()["b"].info == info("b")
    hear(a, claim("c", A, "b", 6, info("b")))  # c refutes for b: refused
    assert state(a, "b") == (SUSPECT, 5)
    hear(a, claim("b", A, "b", 6, info("b")))  # b refutes itself
    assert state(a, "b") == (ALIVE, 6)
    # c takes b's control address (its own, signed, claim): refused
    hear(a, claim("c", A, "c", 4, replace(info("c"), control=info("b").control)))
    assert state(a, "c") == (ALIVE, 3)
    assert a.members()["c"].info == info("c")


def test_accusations_of_future_incarnations_are_refused() -> None:
    a = member("a")
    hear(a, claim("b", A, "b", 5, info("b")))
    hear(a, claim("c", D, "b", 6), claim("c", S, "b", 10**12))
    assert state(a, "b") == (ALIVE, 5)
    hear(a, claim("c", D, "b", 5))
    assert state(a, "b") == (DEAD, 5)
    # of a member never seen signing anything, nothing is believed
    hear(a, claim("b", S, "c", 0))
    assert state(a, "c") is None


def test_accusations_of_us_are_refuted_only_when_signed_by_a_member() -> None:
    a = member("a")
    before = a.incarnation
    hear(a, replace(claim("b", S, "a", before), sig=b"\0" * 64))
    assert a.incarnation == before
    hear(a, claim("b", S, "a", before + 7))  # not our incarnation: ignored
    assert a.incarnation == before
    hear(a, claim("b", S, "a", before))
    assert a.incarnation == before + 1
    assert state(a, "a") == (ALIVE, before + 1)


def test_reference_entries_are_signed_by_their_origin() -> None:
    table = RefTable("a", 1, Trust(security("a")))
    h = Holding("m", 1, b"x" * 16, "a", 4)
    entry = OriginEntry(Stamp("b", 5, 1), (h,))
    forged = replace(entry, sig=IDS["c"].sign(entry.signed_bytes()))  # c writes b's entry
    assert not table.merge(forged)
    assert not table.merge(entry)  # unsigned
    assert table.merge(replace(entry, sig=IDS["b"].sign(entry.signed_bytes())))
    # once forgotten (b died), even b's own entry waits for a newer stamp ...
    table.forget("b")
    again = replace(entry, sig=IDS["b"].sign(entry.signed_bytes()))
    assert not table.merge(again)
    table.unforget("b")  # ... until b is seen alive again (it refuted)
    assert table.merge(again)


def test_insecure_tables_sign_nothing() -> None:
    table = RefTable("a", 1)
    table.put_local(Holding("m", 1, b"x" * 16, "a", 4))
    assert table.local.sig == b""
    assert table.merge(OriginEntry(Stamp("b", 5, 1), ()))


def _claims(*specs: tuple[int, bytes, int]) -> list[ShardClaim]:
    return [ShardClaim(f"o{i}", v, 0, 1, b"", True, mid, gen)
            for i, (v, mid, gen) in enumerate(specs)]


def test_version_window_sticky_seal_and_earliest_publish() -> None:
    view = VersionView(window=10)
    assert view.update("m", _claims((5, b"M5", 1))) == (5,)
    assert view.update("m", _claims((5, b"M5", 1), (16, b"M16", 1))) == ()  # beyond 5+10
    assert view.update("m", _claims((5, b"M5", 1), (15, b"M15", 1))) == (15,)
    # a sealed version is never taken over: a re-publish of 15 with another manifest
    # (even an *earlier* generation) is ignored
    assert view.update("m", _claims((15, b"X15", 0), (15, b"M15", 1))) == ()
    assert view.sealed("m") == (15,)
    assert view.counted("m") == frozenset({(15, 0, b"", b"M15")})
    # ... even once only the other manifest is announced (the real holders left)
    assert view.update("m", _claims((15, b"X15", 0))) == ()
    assert not view.sealed("m") and not view.counted("m")
    # before a seal, two signed publishes of one number: the earliest counts everywhere
    for order in (1, -1):
        v2 = VersionView(window=10)
        v2.update("m", _claims((3, b"new", 7), (3, b"old", 2))[::order])
        assert v2.counted("m") == frozenset({(3, 0, b"", b"old")})
        assert v2.sealed("m") == (3,) and not v2.unsealed("m")
    # insecure (no window): a disagreement is a conflict, as before
    v3 = VersionView()
    v3.update("m", _claims((3, b"new", 7), (3, b"old", 2)))
    assert v3.unsealed("m") and "manifest" in v3.unsealed("m")[0].reason()


def _plane(name: str) -> ControlPlane:
    cfg = PeerConfig.local(name, security=security(name))
    return ControlPlane(info(name), cfg, random.Random(2), 0.0, 1000)


def _reader_of(*planes: ControlPlane) -> ControlPlane:
    reader = _plane("c")
    for p in planes:  # the reader knows them as members
        me = p.membership._view.records[p.me.name]
        reader.receive(0.5, Gossip(p.me.control, p.me.name, (me,)))
    return reader


def test_only_a_publishers_signed_announcement_makes_a_version() -> None:
    pub, rogue = _plane("a"), _plane("b")
    reader = _reader_of(pub, rogue)
    good = pub.sign_announcement(Holding("m", 1, b"g" * 16, "", 1))
    pub.put_holding(good)
    # b is a member but not a publisher of m: its own signed m@999 counts for nothing
    rogue.put_holding(rogue.sign_announcement(Holding("m", 999, b"r" * 16, "", 1)))
    # nor does a copy of a's announcement with another version number or manifest
    rogue.refs.put_local(replace(good, version=2))
    rogue.put_holding(replace(good, manifest_id=b"f" * 16))
    for p in (pub, rogue):
        reader.receive(1.0, RefsDelta(p.me.control, p.me.name, (p.refs.local,)))
    assert reader.latest("m") == 1
    assert [p.name for p, _ in reader.holders(VersionKey("m", 1))] == ["a"]
    assert not reader.holders(VersionKey("m", 999)) and not reader.holders(VersionKey("m", 2))


def test_nobody_but_a_publisher_can_claim_other_tensor_specs() -> None:
    """The schema id is signed: a copy claiming other specs for a publish does not
    count, so it cannot make the version unsealable."""
    pub, rogue = _plane("a"), _plane("b")
    reader = _reader_of(pub, rogue)
    good = pub.sign_announcement(Holding("m", 1, b"g" * 16, "", 1, schema=b"s" * 16))
    pub.put_holding(good)
    rogue.put_holding(replace(good, schema=b"z" * 16))
    for p in (pub, rogue):
        reader.receive(1.0, RefsDelta(p.me.control, p.me.name, (p.refs.local,)))
    assert reader.latest("m") == 1 and not reader.unsealed("m")
    assert [c.origin for c in reader.claims("m")] == ["a"]
    # the honest copy counts
    rogue.put_holding(good)
    reader.receive(2.0, RefsDelta(rogue.me.control, "b", (rogue.refs.local,)))
    assert sorted(c.origin for c in reader.claims("m")) == ["a", "b"]


def test_trust_caches_verdicts_until_the_keyring_changes() -> None:
    trust = Trust(security("a"))
    sig = IDS["b"].sign(b"data")
    assert trust.check_cached("b", b"data", sig)
    trust.keyring.replace({"a": [IDS["a"].public]})  # b removed
    assert not trust.check_cached("b", b"data", sig)


@pytest.mark.parametrize("kind", [S, D])
def test_non_alive_records_may_carry_info_without_breaking_the_signature(kind: int) -> None:
    u = claim("c", kind, "b", 1)
    assert replace(u, info=info("b")).signed_bytes() == u.signed_bytes()
    a = claim("b", A, "b", 1, info("b"))
    assert replace(a, info=info("b", 7555)).signed_bytes() != a.signed_bytes()


def _plane(name: str) -> ControlPlane:
    plane = ControlPlane(info(name), PeerConfig.local(name, security=security(name)),
                         random.Random(2), 0.0, 100)
    for other in NAMES:
        if other != name:
            plane.receive(0.5, Gossip(info(other).control, other,
                                      (claim(other, A, other, 100, info(other)),)))
    return plane


def _coordinated_by(plane: ControlPlane) -> VersionKey:
    return next(k for v in range(1000) if plane.coordinator(k := VersionKey("m", v))
                == plane.me.name)


def test_a_forwarded_coordinator_request_speaks_only_for_its_signed_asker() -> None:
    coordinator = _plane("a")
    assert set(coordinator.live_names()) == set(NAMES)
    key = _coordinated_by(coordinator)
    asker = _plane("c")
    _req_id, (out,) = asker.ask_coordinator(key)
    sent = out.msg
    assert isinstance(sent, CoordRequest) and sent.sig  # signed by its asker
    forwarded = replace(sent, hops=1)  # as a forwarder (b) passes it on, over b's connection
    replies = coordinator.receive(1.0, forwarded)
    (reply,) = replies
    assert isinstance(reply.msg, CoordReply) and reply.msg.ok
    assert reply.dest == info("c").control
    state_of_key = coordinator.coordination.view.state(key)
    assert state_of_key is not None and "c" in state_of_key.fetchers
    # b registers c (signed by b, in c's name), or an unsigned request: refused
    forged = replace(forwarded, req_id=forwarded.req_id + 1, sig=b"")
    forged = replace(forged, sig=IDS["b"].sign(forged.signed_bytes()))
    assert coordinator.receive(1.0, forged) == []
    assert coordinator.receive(1.0, replace(forwarded, sig=b"")) == []
    assert coordinator.trust is not None
    assert coordinator.trust.refused["coordinator request"] == 2
