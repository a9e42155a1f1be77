"""A running fetch follows the coordinator's newer plan over a real mesh: its planned
parent leaves mid-fetch, the coordinator plans again without it, and the fetch (which
asks again while it runs, ``fetching.follow_plan``) takes the new plan, says so in its
report and ends verified.  When the parent was also the version's coordinator, the
fetch's question in flight to it is asked again of the new coordinator at once (not
after a timeout).  The publisher serves slowly (``slow_serving``) so the fetch
lasts long enough on loopback for the parent to leave in the middle of it."""

from __future__ import annotations

import numpy as np
import trio
from helpers import all_live, wait_until
from slow_serving import slow_served

import tensorhub
from tensorhub import PeerConfig
from tensorhub.protocol.reading import REASK_MAX

CHUNK = 1 << 16
CHUNKS = 64


def weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {"w": rng.integers(0, 256, CHUNK * CHUNKS, dtype=np.uint8)}


async def test_a_running_fetch_takes_the_plan_made_after_its_parent_left() -> None:
    w = weights()
    tcp = ("tcp",)  # the slow publisher paces TCP reads only
    async with tensorhub.open_peer(PeerConfig.local("p0", chunk_size=CHUNK,
                                                    transports=tcp)) as pub:
        slow = slow_served(pub, 0.05)  # 64 chunks: about 3 s from the publisher
        seed = pub.info.control.removeprefix("tcp://")
        peers: dict[str, tensorhub.Peer] = {}
        scopes = {name: trio.CancelScope() for name in ("r1", "r2")}
        fetched: dict[str, tensorhub.Fetched] = {}
        joined = {name: trio.Event() for name in scopes}

        async def reader(name: str) -> None:
            with scopes[name]:
                async with tensorhub.open_peer(PeerConfig.local(
                        name, join=(seed,), chunk_size=CHUNK, transports=tcp)) as p:
                    peers[name] = p
                    joined[name].set()
                    await p.wait_for_version("m", None)
                    fetched[name] = await p.fetch("m", 1)
                    await trio.sleep_forever()  # keep serving until told to leave

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for name in scopes:
                    nursery.start_soon(reader, name)
                for event in joined.values():
                    await event.wait()
                await wait_until(lambda: all_live([pub, *peers.values()]), 60,
                                 what="the three peers seeing each other")
                await pub.publish("m", 1, w)
                # Find the planned relay: the reader the other one's plan names.
                size = CHUNK * CHUNKS
                relay: list[str] = []  # parent, child

                async def planned() -> bool:
                    for a, b in (("r1", "r2"), ("r2", "r1")):
                        reply = await peers[b].ask_coordinator("m", 1, size=size,
                                                               chunks=CHUNKS)
                        if a in {s.peer for s in reply.sources}:
                            relay[:] = [a, b]
                            return True
                    assert slow.served < CHUNKS // 2, "the readers got no relay plan"
                    return False

                await wait_until(planned, 60, every=0.02, what="a relay planned")
                parent, child = relay
                key = tensorhub.VersionKey("m", 1)
                await wait_until(lambda: peers[child].store.get(key) is not None, 60,
                                 what="the child's fetch begun")
                local = peers[child].store.get(key)
                assert local is not None
                await wait_until(lambda: sum(local.verified) >= 4, 60,
                                 what="the child under way through its parent")
                assert not local.complete
                # The rest comes from the publisher alone, at a pace that leaves the
                # child's fetch running through two of its re-asks at the longest backoff:
                # the new plan reaches it before it ends, with margin on a loaded host.
                slow.delay = 2 * REASK_MAX / (CHUNKS - sum(local.verified))
                scopes[parent].cancel()  # the parent leaves the mesh mid-fetch
                await wait_until(lambda: child in fetched, 60, what="the child's fetch done")
                nursery.cancel_scope.cancel()

    report = fetched[child].report
    np.testing.assert_array_equal(fetched[child].tensors["w"], w["w"])
    assert report.verified
    # The plan it started with named the parent; it took a newer one while running (from
    # another coordinator when the parent was the coordinator too) that moved chunks.
    started, _, taken = report.plan.partition(", then ")
    assert taken and "chunks to new sources" in taken, report.plan
    assert not started.startswith(parent) or not taken.startswith("plan"), report.plan
    assert report.bytes_by_source.get("p0", 0) > 0  # the rest came from the publisher
