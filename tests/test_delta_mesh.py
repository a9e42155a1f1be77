"""Chunk deltas between real peers: a reader that holds the last version gets the next
one as deltas, checked chunk by chunk; a holder whose deltas are wrong is banned and the
chunks come in full from another; a plan's remote seed pulls the deltas across."""

from __future__ import annotations

import numpy as np
import pytest
import trio
from helpers import complete_holders, open_mesh, wait_until

import tensorhub
from tensorhub import PeerConfig, VersionKey
from tensorhub.errors import RemoteProtocolError
from tensorhub.manifest.digests import digest_of
from tensorhub.model import PeerInfo
from tensorhub.protocol.dataplane import NOT_HELD, OK, DeltaReply, DeltaRunRequest
from tensorhub.transport.deltas import delta_run
from tensorhub.transport.frames import recv_frame, send_frame


def step(w: dict[str, np.ndarray], fraction: float, seed: int) -> dict[str, np.ndarray]:
    """An RL-like step: ``fraction`` of the values of each tensor changed a little."""
    rng = np.random.default_rng(seed)
    out = {}
    for k, v in w.items():
        new = v.copy()
        flat = new.reshape(-1)
        idx = rng.choice(flat.size, max(1, int(flat.size * fraction)), replace=False)
        flat[idx] = flat[idx] * (1 + 0.01 * rng.standard_normal(idx.size)).astype(v.dtype)
        out[k] = new
    return out


def weights(mib: int = 4) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    n = mib << 18
    return {"a": (rng.standard_normal(n) * 0.02).astype(np.float16),
            "b": (rng.standard_normal(n) * 0.02).astype(np.float16),
            "frozen": rng.standard_normal(1 << 18).astype(np.float32)}


async def wait_complete(peer: tensorhub.Peer, key: VersionKey, n: int) -> None:
    await wait_until(lambda: len(complete_holders(peer, key)) >= n,
                     what=f"{peer.info.name} seeing {n} complete holders of {key}")


def same_bytes(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    for k, v in want.items():
        assert digest_of("blake3", [memoryview(got[k]).cast("B")]) == \
            digest_of("blake3", [memoryview(v).cast("B")]), k


async def test_a_reader_with_the_last_version_gets_the_next_as_deltas() -> None:
    async with open_mesh(2, planning=False, delta="always") as (pub, reader):
        w1 = weights()
        await pub.publish("m", 1, w1)
        await wait_complete(reader, VersionKey("m", 1), 1)
        first = await reader.fetch("m", 1)
        assert first.report.delta["note"].startswith("no older version")
        w2 = step(w1, 0.01, 1)
        w2["frozen"] = w1["frozen"]  # one tensor, its chunks, did not change
        await pub.publish("m", 2, w2)
        await wait_complete(reader, VersionKey("m", 2), 1)
        got = await reader.fetch("m", 2)
        r = got.report
        assert r.verified and r.delta["base"] == 1, r.delta
        assert r.unchanged_chunks >= 1  # the frozen tensor's chunk: not sent
        assert r.delta_chunks == 4 and r.bytes == 0, r.to_dict()
        assert 0 < r.delta_bytes < 0.05 * sum(v.nbytes for v in w2.values())
        assert r.delta["bytes_by_source"] == {"p0": r.delta_bytes}
        assert r.delta_encode_seconds > 0 and r.delta_apply_seconds > 0
        same_bytes(got.tensors, w2)
        stats = reader.statistics().delta
        assert stats["delta_bytes"] == r.delta_bytes and stats["delta_chunks"] == r.delta_chunks
        served = pub.statistics().delta
        assert served["served_chunks"] == r.delta_chunks
        assert served["served_delta_bytes"] == r.delta_bytes


async def test_wrong_deltas_ban_their_holder_and_the_chunks_come_in_full() -> None:
    async with open_mesh(3, planning=False, delta="always") as (pub, relay, reader):
        w1 = weights()
        await pub.publish("m", 1, w1)
        await wait_complete(reader, VersionKey("m", 1), 1)
        kept = await relay.fetch("m", 1)
        await reader.fetch("m", 1)
        w2 = step(w1, 0.02, 2)
        await pub.publish("m", 2, w2)
        await wait_complete(relay, VersionKey("m", 2), 1)
        await relay.fetch("m", 2)
        await wait_complete(reader, VersionKey("m", 2), 2)
        # The relay's copy of version 1 rots in memory: every delta it encodes from it
        # now makes wrong chunks (its full chunks of version 2 are still right).
        for name in ("a", "b"):
            kept.tensors[name].view(np.uint8)[:: 1 << 20] ^= 0xFF
        got = await reader.fetch("m", 2)
        r = got.report
        assert r.delta["failed"]["p1"].startswith("integrity"), r.delta
        assert r.integrity_failures.get("p1", 0) >= 1
        assert r.verified and r.bytes > 0 and set(r.bytes_by_source) == {"p0"}
        same_bytes(got.tensors, w2)
        assert "p1" in reader.statistics().bans
        assert reader.statistics().delta["fallbacks"] == 1
        # The reader left the relay's run midway: a reader gone, not bad input.
        served = relay.statistics()
        assert served.malformed_dropped == 0 and served.internal_errors == 0, relay.bad_inputs
        assert served.data_server is not None and served.data_server.bad_frames == 0


async def test_a_planned_remote_seed_pulls_one_delta_across_and_its_dc_fans_it_out() -> None:
    # peers p0, p1, p2 in DCs a, b, b
    async with open_mesh(3, peer_labels=[{"dc": dc} for dc in "abb"],
                         delta="always") as (pub, s1, s2):
        w1 = weights()
        await pub.publish("m", 1, w1)
        for p in (s1, s2):
            await wait_complete(p, VersionKey("m", 1), 1)
            await p.fetch("m", 1)
        served = pub.statistics().delta["served_chunks"]
        w2 = step(w1, 0.01, 3)
        await pub.publish("m", 2, w2)
        for p in (s1, s2):
            await wait_complete(p, VersionKey("m", 2), 1)
        got: dict[str, tensorhub.Fetched] = {}

        async def fetch(p: tensorhub.Peer) -> None:
            got[p.info.name] = await p.fetch("m", 2)

        async with trio.open_nursery() as nursery:
            for p in (s1, s2):
                nursery.start_soon(fetch, p)
        notes = {n: f.report.delta["note"] for n, f in got.items()}
        for f in got.values():
            assert f.report.verified and f.report.delta_chunks > 0, f.report.delta
            assert f.report.bytes == 0 and "epoch" in f.report.plan, f.report.to_dict()
            same_bytes(f.tensors, w2)
        # One of DC b pulled the deltas across from p0 (the seed), the other took them
        # from the seed: the publisher encoded each changed chunk once.
        seed = next(n for n, note in notes.items() if "from p0" in note)
        other = ({"p1", "p2"} - {seed}).pop()
        assert f"from {seed}" in notes[other], notes
        assert pub.statistics().delta["served_chunks"] - served == \
            got[seed].report.delta_chunks


async def test_where_the_link_outruns_encoding_auto_sends_full_chunks() -> None:
    async with open_mesh(2, planning=False, delta="auto") as (pub, reader):
        w1 = weights()
        await pub.publish("m", 1, w1)
        await wait_complete(reader, VersionKey("m", 1), 1)
        await reader.fetch("m", 1)
        assert reader.reader.links.rates["p0"] > 0  # measured by that full fetch
        reader.reader.links.rates["p0"] = 1e12  # as if the link were a terabyte a second
        w2 = step(w1, 0.01, 4)
        w2["frozen"] = w1["frozen"]
        await pub.publish("m", 2, w2)
        await wait_complete(reader, VersionKey("m", 2), 1)
        got = await reader.fetch("m", 2)
        r = got.report
        assert "faster than encoding" in r.delta["skipped"]["p0"], r.delta
        assert r.delta_chunks == 0 and r.unchanged_chunks == 1 and r.bytes > 0
        assert pub.statistics().delta["served_chunks"] == 0
        same_bytes(got.tensors, w2)


async def test_a_holder_without_the_base_answers_each_chunk_not_held() -> None:
    async with open_mesh(1) as (pub,):
        await pub.publish("m", 2, weights())
        answers: list[tuple[int, int]] = []

        async def handle(chunk: int, reply: DeltaReply, payload: bytes) -> bool:
            answers.append((chunk, reply.status))
            assert payload == b""
            return True

        await delta_run(pub.info.data, "p0", 2.0, None, VersionKey("m", 2), 1, [0, 1, 3],
                        lambda c: 1 << 21, handle)
        assert answers == [(0, NOT_HELD), (1, NOT_HELD), (3, NOT_HELD)]
        assert pub.statistics().delta["served_chunks"] == 0


async def test_a_rogue_holders_oversized_or_out_of_turn_answers_are_its_fault() -> None:
    """A holder that declares a delta larger than its chunk may take, or answers another
    chunk than asked: the reader refuses before reading a payload byte."""
    for reply in (DeltaReply(1, 0, OK, 1 << 40), DeltaReply(1, 7, OK, 10)):
        listener = trio.socket.socket()
        await listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]

        async def rogue(listener: trio.socket.SocketType = listener,
                        answer: DeltaReply = reply) -> None:
            conn, _ = await listener.accept()
            with conn:
                assert isinstance(await recv_frame(conn), DeltaRunRequest)
                await send_frame(conn, answer)
                await trio.sleep_forever()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(rogue)
            with pytest.raises(RemoteProtocolError, match=r"at most|out of turn"):
                await delta_run(f"127.0.0.1:{port}", "rogue", 2.0, None, VersionKey("m", 2),
                                1, [0], lambda c: 1 << 20, _never)
            nursery.cancel_scope.cancel()
        listener.close()


async def _never(chunk: int, reply: DeltaReply, payload: bytes) -> bool:
    raise AssertionError("no answer of a rogue holder reaches the caller")


async def test_when_our_own_base_rotted_the_holder_is_not_blamed() -> None:
    async with open_mesh(2, planning=False, delta="always") as (pub, reader):
        w1 = weights()
        await pub.publish("m", 1, w1)
        await wait_complete(reader, VersionKey("m", 1), 1)
        mine = await reader.fetch("m", 1)
        w2 = step(w1, 0.01, 5)
        await pub.publish("m", 2, w2)
        await wait_complete(reader, VersionKey("m", 2), 1)
        mine.tensors["a"].view(np.uint8)[::4096] ^= 0xFF  # our copy, not the holder's
        got = await reader.fetch("m", 2)
        r = got.report
        assert r.delta["failed"]["p0"].startswith("local: our copy"), r.delta
        assert not r.integrity_failures and "p0" not in reader.statistics().bans
        assert r.verified and r.bytes == 2 << 20  # tensor a's two chunks, in full
        assert r.delta_chunks == 3  # the others still came as deltas
        same_bytes(got.tensors, w2)


async def test_before_any_measurement_the_link_is_what_the_nic_labels_say() -> None:
    async with tensorhub.open_peer(PeerConfig.local(
            "r", labels=(("nic_bps", "50e6"),), delta="auto")) as reader:
        labelled = PeerInfo("h", "tcp://127.0.0.1:1", "127.0.0.1:2", (("nic_bps", "1e9"),))
        plain = PeerInfo("p", "tcp://127.0.0.1:1", "127.0.0.1:2")
        garbled = PeerInfo("g", "tcp://127.0.0.1:1", "127.0.0.1:2", (("nic_bps", "x"),))
        assert reader.reader.deltas.link_bps(labelled) == 50e6  # 400 Mbit here: a delta pays
        assert reader.reader.deltas.link_bps(plain) == 50e6
        assert reader.reader.deltas.link_bps(garbled) == reader.config.nic_bps
        reader.reader.links.rates["h"] = 3e9  # measured since: that counts
        assert reader.reader.deltas.link_bps(labelled) == 3e9
