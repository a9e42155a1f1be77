"""The rogue peer of the chaos bench (``python -m tensorhub.testing.chaos.rogue``).

A process that was never given a key and that speaks the mesh's own wire format (the
codec and messages of :mod:`tensorhub.protocol`) over raw ZeroMQ and TCP sockets, with
none of the checks a :class:`~tensorhub.peer.node.Peer` makes on what it sends.  The
driver (:mod:`tensorhub.bench.chaos`) sends one JSON command per stdin line:

* ``{"cmd": "attack", "kind", ...}`` runs one attack of :data:`ATTACKS` against the
  peers named in the command and answers ``attacked`` with what it saw: ``reads`` (mesh
  state or bytes it obtained without a key) and notes;
* ``{"cmd": "end"}`` closes every connection an attack keeps open and stops floods;
* ``{"cmd": "flood", "control", "data", "on"}`` starts or stops a flood of one peer's
  control and data ports (for ``flood_fetch_time_ratio``).

Every value the rogue invents that a peer might store is marked: its names start with
``rogue``, its incarnations, stamp generations and versions come from
:func:`marks` of the episode's seed, so the driver can find the rogue's words in any
peer's view and tell which episode put them there.  What the rogue cannot see (whether a
peer believed it) the driver measures from the peers' own views and fetches.

With ``--insider-keys DIR`` the same program is the *insider* (:mod:`.insider`): it
speaks as member ``insider`` of that keyring (CURVE, data-plane handshake, signatures)
and runs :data:`~tensorhub.testing.chaos.insider.INSIDER_ATTACKS`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import select
import socket
import sys
import threading
import time
from typing import Any

import zmq

from ...manifest.manifest import manifest_id_of
from ...model import PeerInfo
from ...processes import free_ports
from ...protocol import codec
from ...protocol.control import RefsDelta, RefsDigest
from ...protocol.dataplane import (
    MAX_FRAME,
    OK,
    ChunkRequest,
    ManifestRequest,
    Reply,
    ShmVersionRequest,
)
from ...protocol.membership import Ack, Gossip, Ping, PushPull, Update
from ...protocol.messages import register_all
from ...protocol.refs import Holding, OriginEntry, Stamp
from ...protocol.swim_wire import KIND_ALIVE, KIND_LEFT, KIND_SUSPECT
from ...transport.frames import FRAME_LENGTH, encode_frame, recv_exact_blocking
from . import insider as insider_mod
from .insider import INSIDER_ATTACKS, Insider
from .rogue_wares import DataServer, forged_offer, huge_manifest, read_message

register_all()

MARK = 1 << 62
"""Incarnations, stamp generations at or above this are the rogue's (real ones are
boot times in microseconds, ~2**51, or small counters)."""
FORGED_VERSION = 999
MAX_U64 = 2**64 - 1

LIGHT = ("max_incarnation", "bad_endpoint", "false_left", "announce_future",
         "claim_existing", "impersonate_origin", "forged_chunks", "control_flood",
         "unauth_reader", "lease_hold")
HEAVY = ("huge_manifest", "half_frames")
ATTACKS = LIGHT + HEAVY

def marks(seed: int) -> range:
    """The incarnations and generations the rogue uses in episode ``seed``."""
    base = MARK + seed * 64
    return range(base, base + 64)


def rogue_name(seed: int) -> str:
    return f"rogue{seed}"


# -- the rogue ------------------------------------------------------------------------------


class Rogue:
    def __init__(self, size: int, chunk: int, huge_tensors: int, ip: str,
                 insider: Insider | None = None) -> None:
        """``insider``: speak as that member (CURVE with its key, its signatures)."""
        self.insider = insider
        self.received = 0
        self.size = size
        self.chunk = chunk
        self.huge_tensors = huge_tensors
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.control = f"tcp://{ip}:{free_ports(1, ip)[0]}"
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTING_ID, self.control.encode())
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.LINGER, 0)
        if insider is not None:
            insider.curve(self.sock)
        self.sock.bind(self.control)
        if insider is not None:
            insider.client(self.sock)
        self.server = DataServer(ip, insider.admit_reader if insider else None)
        self.names: set[str] = set()
        self.connected: set[str] = set()
        self.pending: list[tuple[str, bytes, float]] = []
        self.inbox: list[Any] = []
        self.held: list[socket.socket] = []
        self.flooding: threading.Event | None = None
        self.flood_threads: list[threading.Thread] = []

    # -- control socket ------------------------------------------------------------------

    def send(self, dest: str, msg: Any) -> None:
        self.pending.append((dest, codec.encode(msg, 64 << 20), time.monotonic() + 1.0))

    def pump(self, seconds: float) -> None:
        """Send what is pending, read what comes, answer pings to our names."""
        end = time.monotonic() + seconds
        while True:
            now = time.monotonic()
            still = []
            for dest, data, deadline in self.pending:
                if not self._try_send(dest, data) and now < deadline:
                    still.append((dest, data, deadline))
            self.pending = still
            if now >= end:
                return
            if self.sock.poll(10):
                while int(self.sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                    frames = self.sock.recv_multipart(zmq.NOBLOCK)
                    if len(frames) == 2:
                        self._received(frames[1])

    def _try_send(self, dest: str, data: bytes) -> bool:
        try:
            if dest not in self.connected:
                self.connected.add(dest)
                self.sock.connect(dest)
            self.sock.send_multipart([dest.encode(), data], zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            return False

    def _received(self, data: bytes) -> None:
        try:
            msg = codec.decode(data, 64 << 20)
        except Exception:  # whatever a peer sends, the rogue reads on
            return
        self.received += 1
        self.inbox.append(msg)
        if isinstance(msg, Ping) and msg.target in self.names:
            self.send(msg.sender, Ack(self.control, msg.target, msg.seq, ()))

    def info(self, name: str, control: str | None = None, nic: str = "1e15") -> PeerInfo:
        """Our member record: on a host of its own, claiming a NIC the planner will
        want to read from (``nic`` bytes/s)."""
        return PeerInfo(name, control or self.control, self.server.address,
                        (("host", "localhost"), ("nic_bps", nic)))

    def join(self, name: str, peers: list[dict[str, Any]]) -> None:
        """Announce ourselves as a member, the way a joiner does (full state to seeds)."""
        self.names.add(name)
        me = Update(KIND_ALIVE, name, 0, name, self.info(name))
        for p in peers:
            self.send(p["control"], PushPull(self.control, name, b"", (me,), True))

    def announce(self, name: str, peers: list[dict[str, Any]], entry: OriginEntry) -> None:
        for p in peers:
            self.send(p["control"], RefsDelta(self.control, name, (entry,)))

    # -- attacks ----------------------------------------------------------------------------

    def attack(self, cmd: dict[str, Any]) -> dict[str, Any]:
        kind = cmd["kind"]
        seed = cmd["seed"]
        name = rogue_name(seed)
        mark = marks(seed)
        peers: list[dict[str, Any]] = cmd["peers"]
        victim = next(p for p in peers if p["name"] == cmd["victim"])
        model, version = cmd["model"], cmd["version"]
        self.inbox.clear()
        reads: list[str] = []
        notes: list[str] = []
        received = self.received
        if kind in INSIDER_ATTACKS:
            if self.insider is None:
                raise ValueError(f"{kind} needs --insider-keys")
            insider_mod.attack(self, self.insider, cmd, mark, notes)
        elif kind == "max_incarnation":
            vinfo = PeerInfo(victim["name"], victim["control"], victim["data"],
                             (("host", "localhost"),))
            for p in peers:
                self.send(p["control"], Gossip(self.control, name, (
                    Update(KIND_ALIVE, victim["name"], MAX_U64, victim["name"], vinfo),
                    Update(KIND_SUSPECT, victim["name"], MAX_U64, name, None))))
        elif kind == "bad_endpoint":
            for p in peers:
                self.send(p["control"], Ping("tcp://no-such-host:99999", name, 1, p["name"], ()))
                self.send(p["control"], PushPull("not an endpoint", name, b"", (), True))
                bad = self.info(name, "tcp://[::1:bad", nic="fast")
                self.send(p["control"], Gossip(self.control, name,
                                               (Update(KIND_ALIVE, name, mark[0], name, bad),)))
        elif kind == "false_left":
            for p in peers:
                if p["name"] != victim["name"]:
                    self.send(p["control"], Gossip(self.control, name, (
                        Update(KIND_LEFT, victim["name"], mark[1], name, None),)))
        elif kind in ("announce_future", "claim_existing", "forged_chunks", "huge_manifest"):
            holdings = self._offers(kind, cmd, name, reads)  # ready before we join
            self.join(name, peers)
            self.pump(0.3)
            self.announce(name, peers, OriginEntry(Stamp(name, mark[2], 1), holdings))
            if kind == "forged_chunks":
                self.claim_as_published(name, peers, cmd, holdings, reads)
        elif kind == "impersonate_origin":
            fid, _, n = forged_offer(model, version + 1, self.size, self.chunk)
            entry = OriginEntry(Stamp(cmd["trainer"], mark[3], 1), (
                Holding(model, version + 1, fid, cmd["trainer"], n),))
            self.announce(name, peers, entry)
        elif kind == "control_flood":
            self.flood(victim["control"], victim["data"], True)
            self.pump(1.0)
            self.flood("", "", False)
        elif kind == "unauth_reader":
            reads += self.unauth_reads(peers, victim, cmd)
        elif kind == "lease_hold":
            if self.lease(victim["data"], model, version):
                reads.append(f"leased {model}@{version} from {victim['name']}")
        elif kind == "half_frames":
            notes.append(f"{self.half_frames(victim['data'], cmd.get('connections', 1000))} "
                         "half-frame connections open")
        else:
            raise ValueError(f"unknown attack {kind!r}")
        self.pump(cmd.get("linger", 0.5))
        return {"event": "attacked", "kind": kind, "reads": reads, "notes": notes,
                "received": self.received - received, "admitted": self.server.admitted,
                "chunks_served": self.server.chunks_served,
                "manifests_served": self.server.manifests_served}

    def _offers(self, kind: str, cmd: dict[str, Any], name: str,
                reads: list[str]) -> tuple[Holding, ...]:
        model, version, trainer = cmd["model"], cmd["version"], cmd["trainer"]
        if kind == "announce_future":
            out = []
            for v in (FORGED_VERSION, MAX_U64):
                fid, offer, n = forged_offer(model, min(v, 2**63 - 1), self.size, self.chunk)
                self.server.offers[(model, v)] = offer
                out.append(Holding(model, v, fid, name, n))
            return tuple(out)
        if kind == "claim_existing":  # the real version with other content, and the next
            out = []
            for v in (version, version + 1):
                fid, offer, n = forged_offer(model, v, self.size, self.chunk)
                self.server.offers[(model, v)] = offer
                out.append(Holding(model, v, fid, trainer, n))
            return tuple(out)
        if kind == "huge_manifest":  # a version ahead of the trainer's: readers want it
            ahead = version + 100
            body = huge_manifest(model, ahead, self.huge_tensors)
            self.server.offers[(model, ahead)] = (body, lambda c: bytes(16 << 20))
            return (Holding(model, ahead, manifest_id_of(body), name, 1),)
        # forged_chunks: the real manifest (read without a key if the holder lets us),
        # the real manifest id, and chunks of other bytes.
        real = self.read_data(cmd["trainer_data"], ManifestRequest(1, model, version))
        if real is not None:
            reads.append(f"manifest of {model}@{version} from {trainer}")
        _, offer, n = forged_offer(model, version, self.size, self.chunk)
        self.server.offers[(model, version)] = (real or offer[0], offer[1])
        return (Holding(model, version, bytes.fromhex(cmd["manifest_id"]), trainer, n),)

    def claim_as_published(self, name: str, peers: list[dict[str, Any]],
                           cmd: dict[str, Any], claimed: tuple[Holding, ...],
                           reads: list[str], copy_signed: bool = False) -> None:
        """For ``cmd["watch"]`` seconds, read the trainer's reference entry and claim
        every new version of the model it holds (same manifest id, other bytes); with
        ``copy_signed`` (the insider) the trainer's holding itself, its publisher
        signature included, in an entry the insider signs."""
        model, trainer = cmd["model"], cmd["trainer"]
        have = {h.version: h for h in claimed}
        control = next(p["control"] for p in peers if p["name"] == trainer)
        seq = 1
        end = time.monotonic() + cmd.get("watch", 1.5)
        while time.monotonic() < end:
            self.inbox.clear()
            self.send(control, RefsDigest(self.control, name, (), False))
            self.pump(0.1)
            new = list({h.version: h for m in self.inbox if isinstance(m, RefsDelta)
                        for e in m.entries if e.origin == trainer for h in e.holdings
                        if h.model == model and h.complete and h.version not in have
                        }.values())
            for h in new:
                real = self.read_data(cmd["trainer_data"], ManifestRequest(1, model, h.version),
                                      trainer)
                if real is not None:
                    reads.append(f"manifest of {model}@{h.version} from {trainer}")
                _, offer, n = forged_offer(model, h.version, self.size, self.chunk)
                self.server.offers[(model, h.version)] = (real or offer[0], offer[1])
                have[h.version] = h if copy_signed else Holding(
                    model, h.version, h.manifest_id, trainer, n)
            if new and self.insider is not None and copy_signed:
                seq += 1
                self.announce(name, peers, self.insider.entry(OriginEntry(
                    Stamp(name, self.insider.tick(), seq), tuple(have.values()))))
                for h in new:  # a fetcher of it, so the plan may send readers to us
                    insider_mod.ask_coordinator(self, peers, h)
            elif new:
                seq += 1
                self.announce(name, peers, OriginEntry(
                    Stamp(name, marks(cmd["seed"])[2], seq), tuple(have.values())))

    def unauth_reads(self, peers: list[dict[str, Any]], victim: dict[str, Any],
                     cmd: dict[str, Any]) -> list[str]:
        """List members and references over the control port, read a manifest and a
        chunk over the data port: each that succeeds is one unauthenticated read."""
        name = rogue_name(cmd["seed"])
        self.send(victim["control"], PushPull(self.control, name, b"", (), True))
        self.send(victim["control"], RefsDigest(self.control, name, (), False))
        self.pump(1.0)
        out = []
        if any(isinstance(m, PushPull) and m.members for m in self.inbox):
            out.append(f"member list from {victim['name']}")
        if any(isinstance(m, RefsDelta) and m.entries for m in self.inbox):
            out.append(f"reference table from {victim['name']}")
        model, version = cmd["model"], cmd["version"]
        if self.read_data(cmd["trainer_data"], ManifestRequest(1, model, version)) is not None:
            out.append(f"manifest of {model}@{version} over TCP")
        if self.read_data(cmd["trainer_data"], ChunkRequest(2, model, version, 0)) is not None:
            out.append(f"chunk 0 of {model}@{version} over TCP")
        return out

    def read_data(self, address: str, req: Any, holder: str = "") -> bytes | None:
        """One request on a fresh data connection; the payload if the holder sent one.
        The insider first proves itself a member to ``holder``."""
        host, _, port = address.rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=2.0) as conn:
                if self.insider is not None:
                    self.insider.prove_to_holder(conn, holder)
                conn.sendall(encode_frame(req))
                reply = read_message(conn)
                if not isinstance(reply, Reply) or reply.status != OK or reply.length <= 0:
                    return None
                payload = bytearray(min(reply.length, 64 << 20))
                recv_exact_blocking(conn, memoryview(payload))
                return bytes(payload)
        except Exception:  # refused, reset, garbage
            return None

    def lease(self, address: str, model: str, version: int) -> bool:
        """Take a same-host version lease and never release it (kept until ``end``)."""
        host, _, port = address.rpartition(":")
        try:
            conn = socket.create_connection((host, int(port)), timeout=2.0)
            conn.sendall(encode_frame(ShmVersionRequest(1, model, version, 0)))
            reply = read_message(conn)
        except Exception:  # refused, reset, garbage
            return False
        self.held.append(conn)
        return not isinstance(reply, Reply)

    def half_frames(self, address: str, count: int) -> int:
        host, _, port = address.rpartition(":")
        opened = 0
        for _ in range(count):
            try:
                conn = socket.create_connection((host, int(port)), timeout=1.0)
                conn.sendall(FRAME_LENGTH.pack(MAX_FRAME) + b"\x93")
            except OSError:
                break
            self.held.append(conn)
            opened += 1
        return opened

    def flood(self, control: str, data: str, on: bool) -> None:
        if not on:
            if self.flooding is not None:
                self.flooding.set()
                for t in self.flood_threads:
                    t.join()
            self.flooding, self.flood_threads = None, []
            return
        stop = self.flooding = threading.Event()
        self.flood_threads = [
            threading.Thread(target=self._flood_control, args=(control, stop), daemon=True),
            threading.Thread(target=self._flood_data, args=(data, stop), daemon=True)]
        for t in self.flood_threads:
            t.start()

    def _flood_control(self, control: str, stop: threading.Event) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 1000)
        sock.connect(control)
        frames = [os.urandom(64), os.urandom(4096), b"\x91\x00",
                  codec.encode(RefsDigest(self.control, "rogue-flood", (), True)),
                  codec.encode(Ping(self.control, "rogue-flood", 1, "nobody", ()))]
        i = 0
        while not stop.is_set():
            try:
                sock.send(frames[i % len(frames)], zmq.NOBLOCK)
                i += 1
            except zmq.Again:
                time.sleep(0.001)
        sock.close(0)

    def _flood_data(self, data: str, stop: threading.Event) -> None:
        host, _, port = data.rpartition(":")
        junk = os.urandom(64 << 10)
        while not stop.is_set():
            try:
                with socket.create_connection((host, int(port)), timeout=1.0) as conn:
                    conn.sendall(FRAME_LENGTH.pack(MAX_FRAME) + junk)
                    conn.sendall(junk * 16)
            except OSError:
                time.sleep(0.01)

    def end(self) -> None:
        """Close what attacks keep open; forget the offers; stop answering for names."""
        self.flood("", "", False)
        if self.insider is not None:
            insider_mod.leave(self, self.insider)
        for conn in self.held:
            conn.close()
        self.held.clear()
        self.server.offers.clear()
        self.names.clear()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tensorhub.testing.chaos.rogue")
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--chunk", type=int, required=True)
    p.add_argument("--huge-tensors", type=int, default=4_000_000)
    p.add_argument("--ip", default="127.0.0.1", help="the address to listen on")
    p.add_argument("--insider-keys", default="",
                   help="a keygen directory: speak as its member 'insider' (CURVE, signed)")
    args = p.parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    rogue = Rogue(args.size, args.chunk, args.huge_tensors, args.ip,
                  Insider(args.insider_keys) if args.insider_keys else None)
    # The bulk of the huge manifest takes seconds to build: do it before it is needed.
    threading.Thread(target=huge_manifest, args=("m", 0, args.huge_tensors),
                     daemon=True).start()
    print(json.dumps({"event": "ready", "control": rogue.control,
                      "data": rogue.server.address}), flush=True)
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], 0.05)
        if not ready:
            rogue.pump(0.0)  # keep answering pings while idle
            continue
        line = sys.stdin.readline()
        if not line or not line.strip():
            return
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            return
        if cmd["cmd"] == "attack":
            reply = rogue.attack(cmd)
        elif cmd["cmd"] == "flood":
            rogue.flood(cmd["control"], cmd["data"], cmd["on"])
            reply = {"event": "flood", "on": cmd["on"]}
        elif cmd["cmd"] == "end":
            rogue.end()
            reply = {"event": "ended"}
        else:
            reply = {"event": "error", "error": f"unknown command {cmd['cmd']!r}"}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
