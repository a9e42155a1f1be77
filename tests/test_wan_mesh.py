"""The WAN learnt by real peers on loopback: a cross-DC fetch's measurement travels in
the reader's reference entry to a third peer, each DC's prober times the links into it
(in a closed mesh too), the probe's bounds on the wire, and what ``status`` shows."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import trio
from helpers import Keys, open_mesh, wait_until

from tensorhub.cli import _print_status
from tensorhub.errors import RemoteProtocolError, TransportError
from tensorhub.links import LinkSpec
from tensorhub.ops.status import gather, wan_rows
from tensorhub.protocol.dataplane import OK, ProbeRequest, Reply
from tensorhub.protocol.probing import PROBE_STREAMS
from tensorhub.transport.frames import recv_frame, send_frame
from tensorhub.transport.probe import _ask, probe
from tensorhub.transport.tcp import TcpConnection

MIB = 1 << 20
DCS = [{"dc": "east"}, {"dc": "west"}, {"dc": "south"}]


def measured(peer: Any, src: str, dst: str) -> bool:
    e = peer.control.wan.estimate(src, dst)
    return e is not None and e.how == "measured"


async def test_a_cross_dc_fetch_is_measured_and_its_report_reaches_a_third_peer() -> None:
    async with open_mesh(3, peer_labels=DCS, wan_probe_bytes=0) as (east, west, south):
        weights = {"w": np.arange(2 * MIB, dtype=np.float32)}  # 8 MiB
        await east.publish("m", 1, weights)
        await wait_until(lambda: west.control.latest("m") == 1, what="the version sealed")
        got = await west.fetch("m", 1)
        assert got.report.bytes_by_source == {"p0": 8 * MIB}
        assert "west" in got.report.route and got.report.to_dict()["route"] == got.report.route
        e = west.control.wan.estimate("east", "west")
        assert e is not None and e.how == "measured" and e.reporters == 1
        assert e.bps > 0
        await wait_until(lambda: measured(south, "east", "west"),
                         what="the reader's measurement gossiped to a third peer")
        heard = south.control.wan.estimate("east", "west")
        assert heard is not None and heard.bps == e.bps
        row = next(r for r in south.statistics().wan["links"] if r["from"] == "east")
        assert (row["to"], row["how"], row["reporters"]) == ("west", "measured", 1)
        assert not measured(south, "west", "east")  # nobody read the other way
        assert west.statistics().wan["probes"].startswith("off")


async def test_each_dcs_prober_times_the_links_into_it() -> None:
    async with open_mesh(3, peer_labels=[{"dc": "east"}, {"dc": "west"}, {"dc": "west"}],
                         wan_probe_bytes=MIB, wan_probe_after=0.2) as (east, w1, w2):
        await wait_until(lambda: measured(east, "west", "east")
                         and measured(w1, "east", "west"), what="both links probed")
        e = w1.control.wan.estimate("east", "west")
        assert e is not None and e.rtt_s > 0 and e.reporters == 1
        # p1 is west's prober, not p2: each link is read once, 4 streams from p0
        assert east.statistics().data_server.probes == PROBE_STREAMS
        assert east.statistics().data_server.probe_bytes == PROBE_STREAMS * MIB
        assert w2.link_probes.notes == {} and "east->west" in w1.link_probes.notes
        await wait_until(lambda: measured(w2, "east", "west"), what="the probe gossiped")
        assert w1.statistics().wan["probed"]["east->west"].startswith("from p0:")


async def test_probes_in_a_closed_mesh_are_authenticated() -> None:
    keys = Keys(["p0", "p1"], {"m": ["p0"]})
    async with open_mesh(2, peer_labels=DCS[:2], keys=keys, wan_probe_bytes=MIB,
                         wan_probe_after=0.2) as (east, west):
        await wait_until(lambda: measured(west, "east", "west"), what="the probe in")
        with pytest.raises(TransportError):  # no member identity: no bytes
            await probe(east.info.data, "p0", MIB, 5.0)
        assert east.statistics().data_server.refused_auth >= 1


async def test_the_server_caps_a_probe_and_refuses_when_probes_are_off() -> None:
    async with open_mesh(2, peer_labels=DCS[:2], wan_probe_bytes=MIB,
                         wan_probe_after=1e6) as (on, _):
        s = await probe(on.info.data, "p0", 2**64 - 1, 5.0)  # asks far more than the cap
        assert (s.nbytes, s.tail_bytes) == (PROBE_STREAMS * MIB, PROBE_STREAMS * MIB // 2)
        assert s.tail_seconds > 0 and s.rtt_s > 0
    async with open_mesh(1, wan_probe_bytes=0) as (off,):
        with pytest.raises(TransportError, match="refused the probe"):
            await probe(off.info.data, "p0", MIB, 5.0)


async def test_a_holder_that_declares_more_than_was_asked_is_refused() -> None:
    a, b = trio.socket.socketpair()
    conn = TcpConnection(a, "liar")

    async def liar() -> None:
        req = await recv_frame(b)
        assert isinstance(req, ProbeRequest)
        await send_frame(b, Reply(req.req_id, OK, req.nbytes + 1))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(liar)
        with pytest.raises(RemoteProtocolError, match="declared"):
            await _ask(conn, ProbeRequest(7, MIB), MIB)
    a.close()
    b.close()


async def test_status_shows_the_wan_table(capsys: pytest.CaptureFixture[str]) -> None:
    declared = (LinkSpec("east", "west", 300e6 / 8, 0.15),)
    async with open_mesh(2, peer_labels=DCS[:2], links=declared,
                         wan_probe_bytes=0) as (east, west):
        west.control.wan.observe("south", "west", 4 * MIB, 0.5, rtt_s=0.04)
        report = await gather(west, timeout=2.0)
        rows = wan_rows(report)
        assert ("east", "west", "300", "150", "declared", "-") in rows
        assert ("south", "west", "67.109", "40", "measured", "1") in rows
        _print_status(report)
        out = capsys.readouterr().out
        assert "links between DCs" in out and "declared" in out and "measured" in out
        assert east.statistics().wan["links"][0]["how"] == "declared"
