"""The invariants of the chaos bench, checked on what one episode recorded.

Pure functions over plain data (the events the peer processes and the rogue reported,
and the peers' views of the mesh), so they can be tested on crafted records:

* a peer process the harness did not kill must not exit (``peer_crashes``);
* every activation (a fetch that returned) must hold exactly the trainer's bytes of a
  version the trainer published, under the trainer's manifest: a version the trainer
  never published, or published with another manifest, is ``forged_versions_accepted``;
  wrong bytes with the rogue among the sources are ``forged_chunks_accepted``, otherwise
  ``partial_activations``;
* a fetch that did not return must have raised ``VersionUnavailable`` saying what is
  missing; anything else, or a fetch still running when the episode is checked (seconds
  after its version was published), is a ``fetch_failures`` entry, printed;
* verified bytes are fetched once: a fetch that received more verified bytes than the
  version has counts the excess (``verified_bytes_refetched``);
* the rogue's words must not be found in any peer's view (``unauth_messages_accepted``:
  episodes in which some peer believed it) and it must not have read mesh state or
  bytes (``unauth_reads``);
* the insider (a member key, no publisher rights: :mod:`tensorhub.testing.chaos.insider`) may
  read and its own signed words may be kept, but no peer may believe what only the
  rules refuse (:func:`insider_traces`: a marked incarnation or stamp, a ``latest`` the
  trainer did not publish, a copy of a version the insider "published", a member at
  another member's address); its bytes count as the rogue's, and the fetches that
  banned it are counted (``insider_bans``, expected).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .insider import INSIDER, INSIDER_ATTACKS
from .rogue import FORGED_VERSION, MARK, marks, rogue_name

COUNTS = ("peer_crashes", "unauth_reads", "unauth_messages_accepted",
          "forged_versions_accepted", "forged_chunks_accepted", "partial_activations",
          "verified_bytes_refetched", "fetch_failures", "activations", "version_unavailable",
          "integrity_failures_detected", "rogue_chunks_served", "insider_bans")
ACCEPTED = ("unauth_messages_accepted", "forged_versions_accepted", "forged_chunks_accepted")
"""The acceptance counts, printed per family of attacks."""


def family(attack: str | None) -> str:
    """``insider`` (a member key), ``keyless`` (the rogue) or ``none``."""
    return "none" if attack is None else "insider" if attack in INSIDER_ATTACKS \
        else "keyless"


def bad_source(name: str) -> bool:
    """A source only an attacker is: the keyless rogue or the insider."""
    return name.startswith("rogue") or name == INSIDER


@dataclass
class Episode:
    """What one seed's run recorded (the driver fills it in)."""

    seed: int
    attack: str | None = None
    faults: list[str] = field(default_factory=list)
    killed: set[str] = field(default_factory=set)
    """Processes the harness killed on purpose."""
    exited: dict[str, str] = field(default_factory=dict)
    """Other processes that ended: name -> exit code and the end of their stderr."""
    published: dict[int, str | None] = field(default_factory=dict)
    """Versions the trainer was asked to publish -> its manifest id (None: no answer)."""
    started: list[dict[str, Any]] = field(default_factory=list)
    """Fetches the rollouts began (``peer``, ``version``)."""
    activations: list[dict[str, Any]] = field(default_factory=list)
    fetch_errors: list[dict[str, Any]] = field(default_factory=list)
    views: dict[str, dict[str, Any]] = field(default_factory=dict)
    rogue: dict[str, Any] = field(default_factory=dict)
    """The rogue's ``attacked`` reply (empty if it did not answer)."""
    addresses: dict[str, str] = field(default_factory=dict)
    """The peers' real control addresses when the attack began."""


@dataclass
class Verdict:
    counts: dict[str, int]
    problems: list[str]
    poisoned: bool
    """A peer keeps state the mesh cannot outlive (a stamp or an incarnation it cannot
    supersede): the driver restarts the mesh before the next seed."""


def rogue_traces(seed: int, views: dict[str, dict[str, Any]]) -> list[str]:
    """Where the rogue of episode ``seed`` is found in the peers' views."""
    name, ours = rogue_name(seed), marks(seed)
    out = []
    for peer, v in sorted(views.items()):
        for member, (status, inc) in v.get("members", {}).items():
            if member == name:
                out.append(f"{peer} lists {member} as {status}")
            elif inc in ours or inc >= 2**63:
                out.append(f"{peer} holds {member} {status} at incarnation {inc}")
        for origin, (gen, _seq) in v.get("stamps", {}).items():
            if origin == name or gen in ours:
                out.append(f"{peer} keeps an entry of {origin} stamped {gen}")
        for origin, (gen, _seq) in v.get("forgotten", {}).items():
            if gen in ours:
                out.append(f"{peer} refuses entries of {origin} not newer than {gen}")
        for origin, _model, version, _mid, publisher, _complete in v.get("holdings", []):
            if origin not in (name, INSIDER) and (publisher.startswith("rogue")
                                                   or version >= FORGED_VERSION):
                out.append(f"{peer} lists {origin} holding version {version} by {publisher}")
    return out


def insider_traces(ep: Episode) -> list[str]:
    """Where the insider's refusable words of episode ``ep`` are found in the views."""
    out = rogue_traces(ep.seed, ep.views)
    model = f"chaos{ep.seed}"
    owner = {a: n for n, a in ep.addresses.items()}
    for peer, v in sorted(ep.views.items()):
        latest = v.get("latest", {}).get(model)
        if latest is not None and latest not in ep.published:
            out.append(f"{peer} takes version {latest} as latest")
        for origin, _model, version, _mid, publisher, _complete in v.get("holdings", []):
            if origin != INSIDER and publisher == INSIDER:
                out.append(f"{peer} lists {origin} holding version {version} by {publisher}")
        for member, address in v.get("addresses", {}).items():
            if owner.get(address, member) != member:
                out.append(f"{peer} lists {member} at {owner[address]}'s address")
            elif member in ep.addresses and address != ep.addresses[member]:
                out.append(f"{peer} lists {member} at {address}")
    return list(dict.fromkeys(out))  # a holding both checks find, once


def poisoned(views: Iterable[dict[str, Any]]) -> bool:
    for v in views:
        if any(inc >= 2**63 for _, inc in v.get("members", {}).values()):
            return True
        stamps = [*v.get("stamps", {}).items(), *v.get("forgotten", {}).items()]
        if any(gen >= MARK and not origin.startswith("rogue") for origin, (gen, _) in stamps):
            return True
    return False


def check(ep: Episode) -> Verdict:
    counts = dict.fromkeys(COUNTS, 0)
    problems: list[str] = []
    tag = f"seed {ep.seed}"
    for name, why in sorted(ep.exited.items()):
        counts["peer_crashes"] += 1
        problems.append(f"{tag}: {name} died ({why})")
    for a in ep.activations:
        _activation(ep, a, counts, problems)
    for e in ep.fetch_errors:
        if e.get("kind") == "VersionUnavailable" and e.get("detail"):
            counts["version_unavailable"] += 1
        else:
            counts["fetch_failures"] += 1
            problems.append(f"{tag}: {e.get('peer')} fetch of version {e.get('version')} "
                            f"ended in {e.get('kind')}: {str(e.get('error'))[:300]}")
    ended = [(e.get("peer"), e.get("version")) for e in (*ep.activations, *ep.fetch_errors)]
    for s in ep.started:
        key = (s.get("peer"), s.get("version"))
        if key in ended:
            ended.remove(key)
        elif s.get("peer") not in ep.killed and s.get("peer") not in ep.exited:
            counts["fetch_failures"] += 1
            problems.append(f"{tag}: {key[0]}'s fetch of version {key[1]} had not ended "
                            "when the episode was checked")
    if ep.attack in INSIDER_ATTACKS:  # a member: its reads are its right
        traces = insider_traces(ep)
        if traces:
            counts["unauth_messages_accepted"] += 1
            problems.append(f"{tag}: insider ({ep.attack}) believed: " + "; ".join(traces[:4])
                            + (f" (+{len(traces) - 4} more)" if len(traces) > 4 else ""))
    elif ep.attack is not None:
        counts["unauth_reads"] += len(ep.rogue.get("reads", []))
        for r in ep.rogue.get("reads", []):
            problems.append(f"{tag}: rogue ({ep.attack}) read {r}")
        traces = rogue_traces(ep.seed, ep.views)
        if traces:
            counts["unauth_messages_accepted"] += 1
            problems.append(f"{tag}: rogue ({ep.attack}) believed: " + "; ".join(traces[:4])
                            + (f" (+{len(traces) - 4} more)" if len(traces) > 4 else ""))
    return Verdict(counts, problems, poisoned(ep.views.values()))


def _activation(ep: Episode, a: dict[str, Any], counts: dict[str, int],
                problems: list[str]) -> None:
    counts["activations"] += 1
    report = a.get("report", {})
    sources = report.get("bytes_by_source", {})
    counts["integrity_failures_detected"] += sum(report.get("integrity_failures", {}).values())
    counts["rogue_chunks_served"] += sum(n for s, n in sources.items() if bad_source(s))
    counts["insider_bans"] += INSIDER in report.get("banned_sources", {}) \
        or INSIDER in report.get("integrity_failures", {})
    excess = int(report.get("bytes", 0)) - int(a.get("nbytes", 0))
    if excess > 0:
        counts["verified_bytes_refetched"] += excess
        problems.append(f"seed {ep.seed}: {a.get('peer')} received {excess} verified bytes "
                        f"twice fetching version {a.get('version')}")
    version = a.get("version")
    what = f"seed {ep.seed}: {a.get('peer')} activated version {version}"
    expected = ep.published.get(version) if isinstance(version, int) else None
    if version not in ep.published or (expected is not None and a.get("manifest_id") != expected):
        counts["forged_versions_accepted"] += 1
        problems.append(f"{what}, which the trainer did not publish (manifest "
                        f"{a.get('manifest_id')}; sources {sorted(sources)})")
    elif not a.get("content_ok") or not report.get("verified"):
        if any(bad_source(s) for s in sources):
            counts["forged_chunks_accepted"] += 1
            problems.append(f"{what} with the rogue's bytes (sources {sorted(sources)})")
        else:
            counts["partial_activations"] += 1
            problems.append(f"{what} with bytes that are not the trainer's "
                            f"(verified={report.get('verified')}, sources {sorted(sources)})")
