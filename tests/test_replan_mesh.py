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
                while any(len(p.control.membership.live_members()) < 3
                          for p in (pub, *peers.values())):
                    await trio.sleep(0.02)
                await pub.publish("m", 1, w)
                # Find the planned relay: the reader the other one's plan names.
                size = CHUNK * CHUNKS
                parent = child = None
                while parent is None:
                    await trio.sleep(0.02)
                    for a, b in (("r1", "r2"), ("r2", "r1")):
                        reply = await peers[b].ask_coordinator("m", 1, size=size,
                                                               chunks=CHUNKS)
                        if a in {s.peer for s in reply.sources}:
                            parent, child = a, b
                            break
                    assert slow.served < CHUNKS // 2, "the readers got no relay plan"
                key = tensorhub.VersionKey("m", 1)
                while (local := peers[child].store.get(key)) is None:
                    await trio.sleep(0.01)  # the child's fetch has not begun yet
                while sum(local.verified) < 4:  # the child is under way through its parent
                    await trio.sleep(0.01)
                assert not local.complete
                # The rest comes from the publisher alone, at a pace that leaves the
                # child's fetch running through two of its re-asks at the longest backoff:
                # the new plan reaches it before it ends, with margin on a loaded host.
                slow.delay = 2 * REASK_MAX / (CHUNKS - sum(local.verified))
                scopes[parent].cancel()  # the parent leaves the mesh mid-fetch
                while child not in fetched:
                    await trio.sleep(0.02)
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
