"""The insider of the chaos bench: a rogue that holds a valid member key.

A compromised rollout: the keyring lists it as member ``insider`` (so CURVE + ZAP let
its control connections in and the data-plane handshake admits it), but it publishes no
model.  It signs everything it says with its own identity exactly as a peer does
(:meth:`~tensorhub.protocol.swim_wire.Update.signed_bytes`,
:meth:`~tensorhub.protocol.refs.OriginEntry.signed_bytes`,
:func:`~tensorhub.protocol.refs.announcement_bytes`), so its words pass the transport and
signature layers and only the mesh's *rules* can refuse them.  Its attacks
(:data:`INSIDER_ATTACKS`, one a seed, in turn):

* ``insider_false_left``: ``left`` and ``dead`` claims about another member at a huge
  incarnation (signed by the insider as accuser);
* ``insider_take_address``: an alive claim about another member with the insider's
  addresses, and an alive claim of its own with the other member's addresses;
* ``insider_announce``: its own entry, holding ``m@999`` and the current version under
  another manifest, both "published" (signed) by the insider;
* ``insider_impersonate``: an entry in the trainer's name, signed with the insider's key;
* ``insider_forged_chunks``: it reads the real manifest as a member, copies the
  trainer's signed holdings into its own entry and serves other bytes for them.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import replace
from typing import Any, Protocol

import zmq

from ...model import PeerInfo
from ...protocol.control import RefsDelta
from ...protocol.coordination import CoordRequest
from ...protocol.dataplane import NONCE_BYTES, AuthHello, AuthProof
from ...protocol.membership import Gossip, PushPull, Update
from ...protocol.refs import Holding, OriginEntry, Stamp, announcement_bytes
from ...protocol.swim_wire import KIND_ALIVE, KIND_DEAD, KIND_LEFT
from ...security import load
from ...transport.frames import encode_frame
from ...transport.handshake import transcript
from .rogue_wares import DataServer, forged_offer, read_message
from .worker import model_bytes

INSIDER = "insider"
INSIDER_ATTACKS = ("insider_false_left", "insider_take_address", "insider_announce",
                   "insider_impersonate", "insider_forged_chunks")
FORGED_VERSION = 999


class RogueProgram(Protocol):
    """What the insider's attacks need of the rogue program that runs them
    (:class:`~tensorhub.testing.chaos.rogue.Rogue`): its control socket, its data server and
    the model's sizes, and its claim on the trainer's versions."""

    control: str
    names: set[str]
    """The member names the program answers pings for."""
    server: DataServer
    size: int
    chunk: int

    def send(self, dest: str, msg: Any) -> None: ...

    def pump(self, seconds: float) -> None: ...

    def claim_as_published(self, name: str, peers: list[dict[str, Any]],
                           cmd: dict[str, Any], claimed: tuple[Holding, ...],
                           reads: list[str], copy_signed: bool = False) -> None: ...


class Insider:
    """The insider's keys, and signing the way a peer signs."""

    def __init__(self, keys: str) -> None:
        sec = load(keys, INSIDER)
        self.identity = sec.identity
        self.server_public, self.server_secret = sec.cluster.z85()
        self.keyring = sec.keyring
        self.clock = 0
        self.incarnation = 0
        self.joined: list[dict[str, Any]] = []
        """The peers told of our current membership (told again when we leave)."""

    def tick(self) -> int:
        """A strictly growing boot-stamp-like number (microseconds), as a peer's
        incarnations and generations are: never one the insider's attacks mark."""
        self.clock = max(self.clock + 1, time.time_ns() // 1000)
        return self.clock

    def curve(self, sock: zmq.Socket[bytes]) -> None:
        """Serve with the cluster key (as every member does), connect as ourselves."""
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.server_secret)

    def client(self, sock: zmq.Socket[bytes]) -> None:
        """Switch ``sock`` to connect as a CURVE client with our member key (bind first)."""
        public, secret = self.identity.curve_keys()
        sock.setsockopt(zmq.CURVE_SERVER, 0)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)

    def update(self, u: Update) -> Update:
        return replace(u, sig=self.identity.sign(u.signed_bytes()))

    def entry(self, e: OriginEntry) -> OriginEntry:
        return replace(e, sig=self.identity.sign(e.signed_bytes()))

    def published(self, h: Holding) -> Holding:
        """``h`` as if the insider had published it (its publisher signature)."""
        h = replace(h, publisher=INSIDER, publisher_gen=self.clock)
        return replace(h, publisher_sig=self.identity.sign(announcement_bytes(h)))

    # -- the data-plane handshake, both sides (plain sockets) ------------------------------

    def prove_to_holder(self, conn: socket.socket, holder: str) -> None:
        mine = os.urandom(NONCE_BYTES)
        conn.sendall(encode_frame(AuthHello(INSIDER, mine)))
        challenge = read_message(conn)
        if not isinstance(challenge, AuthHello):
            raise ConnectionError(f"{holder} refused the insider: {challenge}")
        conn.sendall(encode_frame(AuthProof(self.identity.sign(
            transcript(b"reader", mine, challenge.nonce, INSIDER, holder)))))
        if not isinstance(read_message(conn), AuthProof):
            raise ConnectionError(f"{holder} refused the insider's proof")

    def admit_reader(self, conn: socket.socket) -> str:
        """The holder's side: prove ourselves to whoever says hello (the insider does
        not care who reads its forgeries)."""
        hello = read_message(conn)
        if not isinstance(hello, AuthHello):
            raise ConnectionError("no AuthHello")
        mine = os.urandom(NONCE_BYTES)
        conn.sendall(encode_frame(AuthHello("", mine)))
        read_message(conn)  # the reader's proof: not checked
        conn.sendall(encode_frame(AuthProof(self.identity.sign(
            transcript(b"holder", hello.nonce, mine, INSIDER, hello.name)))))
        return hello.name


# -- the attacks ----------------------------------------------------------------------------


def join(rogue: RogueProgram, ins: Insider, peers: list[dict[str, Any]]) -> None:
    """Join as member ``insider`` (a fresh incarnation), as a joiner does."""
    rogue.names.add(INSIDER)
    ins.incarnation = ins.tick()
    me = ins.update(Update(KIND_ALIVE, INSIDER, ins.incarnation, INSIDER, own_info(rogue)))
    ins.joined = peers
    for p in peers:
        rogue.send(p["control"], PushPull(rogue.control, INSIDER, b"", (me,), True))


def own_info(rogue: RogueProgram, control: str | None = None, data: str | None = None) -> PeerInfo:
    """On the readers' host (they try shared memory, are refused, read over TCP),
    claiming a very fast NIC: the planner wants to read from it."""
    return PeerInfo(INSIDER, control or rogue.control, data or rogue.server.address,
                    (("host", "localhost"), ("nic_bps", "1e15")))


def leave(rogue: RogueProgram, ins: Insider) -> None:
    """Say we left (signed, at our incarnation), so the mesh does not suspect us."""
    if not ins.joined:
        return
    bye = ins.update(Update(KIND_LEFT, INSIDER, ins.incarnation, INSIDER, None))
    for p in ins.joined:
        rogue.send(p["control"], Gossip(rogue.control, INSIDER, (bye,)))
    ins.joined = []
    rogue.pump(0.2)
    rogue.names.discard(INSIDER)


def gossip(rogue: RogueProgram, peers: list[dict[str, Any]], *updates: Update,
           skip: str = "") -> None:
    for p in peers:
        if p["name"] != skip:
            rogue.send(p["control"], Gossip(rogue.control, INSIDER, updates))


def ask_coordinator(rogue: RogueProgram, peers: list[dict[str, Any]], h: Holding) -> None:
    """Register as a fetcher of ``h``'s version with its coordinator (asked through
    every peer), as a reader does before it fetches: the coordinator's plan may then
    send later readers to us."""
    for i, p in enumerate(peers):
        rogue.send(p["control"], CoordRequest(rogue.control, INSIDER, (h.version << 8) + i,
                                              h.model, h.version, None, 0,
                                              model_bytes(rogue.size), h.num_chunks))


def announce(rogue: RogueProgram, peers: list[dict[str, Any]], entry: OriginEntry) -> None:
    for p in peers:
        rogue.send(p["control"], RefsDelta(rogue.control, INSIDER, (entry,)))


def attack(rogue: RogueProgram, ins: Insider, cmd: dict[str, Any], mark: range,
           notes: list[str]) -> None:
    """Run insider attack ``cmd["kind"]`` (the rogue pumps and answers after)."""
    kind, peers = cmd["kind"], cmd["peers"]
    victim = next(p for p in peers if p["name"] == cmd["victim"])
    model, version, trainer = cmd["model"], cmd["version"], cmd["trainer"]
    join(rogue, ins, peers)
    rogue.pump(0.3)
    if kind == "insider_false_left":
        gossip(rogue, peers, ins.update(Update(KIND_LEFT, victim["name"], mark[1], INSIDER, None)),
               ins.update(Update(KIND_DEAD, victim["name"], mark[2], INSIDER, None)),
               skip=victim["name"])
    elif kind == "insider_take_address":
        theirs = PeerInfo(victim["name"], rogue.control, rogue.server.address,
                          (("host", "localhost"), ("nic_bps", "1e15")))
        ins.incarnation = ins.tick()
        gossip(rogue, peers,
               ins.update(Update(KIND_ALIVE, victim["name"], mark[3], INSIDER, theirs)),
               ins.update(Update(KIND_ALIVE, INSIDER, ins.incarnation, INSIDER,
                                 own_info(rogue, victim["control"], victim["data"]))))
    elif kind == "insider_announce":
        holdings = []
        for v in (FORGED_VERSION, version, version + 1):
            fid, offer, n = forged_offer(model, v, rogue.size, rogue.chunk)
            rogue.server.offers[(model, v)] = offer
            holdings.append(ins.published(Holding(model, v, fid, INSIDER, n)))
        announce(rogue, peers, ins.entry(OriginEntry(Stamp(INSIDER, ins.tick(), 1),
                                                     tuple(holdings))))
    elif kind == "insider_impersonate":
        fid, _, n = forged_offer(model, version + 1, rogue.size, rogue.chunk)
        for origin in (trainer, victim["name"]):
            forged = Holding(model, version + 1, fid, trainer, n)
            announce(rogue, peers, ins.entry(OriginEntry(Stamp(origin, mark[4], 1),
                                                         (forged,))))
    elif kind == "insider_forged_chunks":
        rogue.claim_as_published(INSIDER, peers, cmd, (), notes, copy_signed=True)
    else:
        raise ValueError(f"unknown insider attack {kind!r}")
