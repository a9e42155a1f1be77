"""What an emulated cluster looks like: datacenters, hosts' NIC rates, links between DCs.

Theory of operation
-------------------
A :class:`ClusterSpec` is the plain description :func:`~tensorhub.testing.netns.open_topology`
builds: DCs in order, each a list of hosts given by their NIC rate (Mbit/s, both ways),
and one :class:`DCLink` per *ordered* pair of DCs: the rate of that direction (Mbit/s, or
no cap) and the round trip the pair adds (ms; the same both ways). Links may be
asymmetric. :class:`LinkChange` entries change a direction's rate at a time after a
fan-out starts (the benchmark applies them; the bound accounts for them). Hosts are
numbered across DCs in order: ``h0`` is the first host of the first DC (the trainer, or
the holder, by convention).

It comes from a topology file (:func:`load_topology`, TOML, format in ``docs/cluster.md``)
or from the shorthand flags (:func:`uniform`: ``hosts`` split into ``dcs`` contiguous
blocks, every NIC alike, every DC pair alike). Files are checked as a whole and every
mistake is reported with where it is (:class:`TopologyFileError`).

:func:`fluid_bound_s` is the time no schedule can beat when ``h0`` sends ``size`` bytes
to every other host; the formula is in its docstring and in ``docs/cluster.md``.

:func:`relay_routes`, :func:`relay_buffer` and :func:`pair_class` say what the router
of the emulated cluster does per pair of DCs (delay, buffer, htb class).

Pure: no I/O except reading the file in :func:`load_topology`.
"""

from __future__ import annotations

import itertools
import math
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..errors import ConfigError

MAX_HOSTS_PER_DC = 250
"""Host ``k`` of DC ``d`` is ``10.77.d.(k+1)``; ``.254`` is the DC's router."""
MAX_DCS = 250


class TopologyFileError(ConfigError):
    """A topology file cannot be read or describes no valid cluster; says where."""


@dataclass(frozen=True)
class DCSpec:
    """One datacenter: a name and the NIC rate of each of its hosts (Mbit/s)."""

    name: str
    nics_mbit: tuple[float, ...]


@dataclass(frozen=True)
class DCLink:
    """One direction of the link between two DCs: its cap (Mbit/s; None: none) and the
    round trip the pair adds (ms; half of it each way, the same both ways)."""

    mbit: float | None
    rtt_ms: float

    @property
    def bytes_per_s(self) -> float:
        return math.inf if self.mbit is None else self.mbit * 1e6 / 8


@dataclass(frozen=True)
class LinkChange:
    """``at_s`` seconds after a fan-out starts, the link ``src -> dst`` (DC indices; a
    capped one) runs at ``mbit`` from then on."""

    at_s: float
    src: int
    dst: int
    mbit: float


@dataclass(frozen=True)
class ClusterSpec:
    """DCs in order (host numbering follows it), a link for every ordered pair of DCs,
    and the changes of link rates during a fan-out."""

    dcs: tuple[DCSpec, ...]
    links: Mapping[tuple[int, int], DCLink]
    """Keyed by ``(src, dst)`` (DC indices): the direction ``src -> dst``. A key ``(a, b)``
    whose reverse ``(b, a)`` is not given stands for both directions (symmetric links, as
    before links had directions); the mapping is completed on construction."""
    changes: tuple[LinkChange, ...] = ()
    """Rate changes during a fan-out, in the order given."""

    def __post_init__(self) -> None:
        links = dict(self.links)
        for (a, b), link in self.links.items():
            links.setdefault((b, a), link)
        object.__setattr__(self, "links", links)
        problems = _problems(self)
        if problems:
            raise ConfigError("; ".join(problems))

    @property
    def hosts(self) -> list[tuple[int, float]]:
        """``(dc, nic_mbit)`` of every host in order: ``h0`` first."""
        return [(d, nic) for d, dc in enumerate(self.dcs) for nic in dc.nics_mbit]

    def link(self, src: int, dst: int) -> DCLink:
        """The link from DC ``src`` to DC ``dst``: its rate that way and the pair's round
        trip (with symmetric links, either order gives the same)."""
        return self.links[(src, dst)]

    def symmetric(self, a: int, b: int) -> bool:
        """Whether DCs ``a`` and ``b`` have the same rate both ways and no change."""
        return (self.links[(a, b)] == self.links[(b, a)]
                and not any({c.src, c.dst} == {a, b} for c in self.changes))

    def rate_steps(self, src: int, dst: int) -> list[tuple[float, float]]:
        """``(from_s, bytes/s)`` of the link ``src -> dst`` during a fan-out: its rate
        from 0 s, then each change's rate from its ``at_s``, in time order."""
        steps = [(0.0, self.link(src, dst).bytes_per_s)]
        for change in sorted((c for c in self.changes if (c.src, c.dst) == (src, dst)),
                             key=lambda c: c.at_s):
            steps.append((change.at_s, change.mbit * 1e6 / 8))
        return steps

    def cut_steps(self, inside: Iterable[int]) -> list[tuple[float, float]]:
        """``(from_s, bytes/s)``: the summed rate over time of the links *into* the set of
        DCs ``inside`` from the other DCs (:meth:`rate_steps` added up)."""
        group = set(inside)
        into = [self.rate_steps(b, a) for a in group for b in range(len(self.dcs))
                if b not in group]
        times = sorted({t for steps in into for t, _ in steps})
        return [(t, sum(_rate_at(steps, t) for steps in into)) for t in times]

    def with_links(self, mbit: float | None = None, rtt_ms: float | None = None
                   ) -> ClusterSpec:
        """Every DC pair's rate (``mbit``) and/or round trip (``rtt_ms``) replaced."""
        changes: dict[str, Any] = {}
        if mbit is not None:
            changes["mbit"] = mbit
        if rtt_ms is not None:
            changes["rtt_ms"] = rtt_ms
        return replace(self, links={k: replace(v, **changes) for k, v in self.links.items()})

    def with_nics(self, mbit: float) -> ClusterSpec:
        """Every host's NIC at ``mbit``."""
        return replace(self, dcs=tuple(replace(dc, nics_mbit=(mbit,) * len(dc.nics_mbit))
                                       for dc in self.dcs))

    def describe(self) -> str:
        """One line: hosts per DC with their NIC rates, then each link."""
        parts = []
        for dc in self.dcs:
            counts: dict[float, int] = {}
            for nic in dc.nics_mbit:
                counts[nic] = counts.get(nic, 0) + 1
            nics = " + ".join(f"{n} x {rate:g}" for rate, n in counts.items())
            parts.append(f"{dc.name}: {nics} Mbit")
        name = [dc.name for dc in self.dcs]
        for a, b in itertools.combinations(range(len(self.dcs)), 2):
            there, back = self.links[(a, b)], self.links[(b, a)]
            if there.mbit == back.mbit:
                parts.append(f"{name[a]}-{name[b]}: {_mbit(there.mbit)}, "
                             f"{there.rtt_ms:g} ms rtt")
            else:
                parts.append(f"{name[a]}->{name[b]}: {_mbit(there.mbit)}, "
                             f"{name[b]}->{name[a]}: {_mbit(back.mbit)}, "
                             f"{there.rtt_ms:g} ms rtt")
        for c in self.changes:
            parts.append(f"at {c.at_s:g} s {name[c.src]}->{name[c.dst]}: {_mbit(c.mbit)}")
        return "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """The spec as JSON-able data (the settings of a run): a symmetric pair as one
        ``between`` entry, an asymmetric one as two ``from``/``to`` entries."""
        name = [dc.name for dc in self.dcs]
        links: list[dict[str, Any]] = []
        for a, b in itertools.combinations(range(len(self.dcs)), 2):
            there, back = self.links[(a, b)], self.links[(b, a)]
            if there == back:
                links.append({"between": [name[a], name[b]], "mbit": there.mbit,
                              "rtt_ms": there.rtt_ms})
            else:
                links += [{"from": name[x], "to": name[y], "mbit": self.links[(x, y)].mbit,
                           "rtt_ms": self.links[(x, y)].rtt_ms} for x, y in ((a, b), (b, a))]
        out: dict[str, Any] = {"dcs": [{"name": dc.name, "hosts_mbit": list(dc.nics_mbit)}
                                       for dc in self.dcs], "links": links}
        if self.changes:
            out["changes"] = [{"at_s": c.at_s, "from": name[c.src], "to": name[c.dst],
                               "mbit": c.mbit} for c in self.changes]
        return out


def uniform(hosts: int, nic_mbit: float, dcs: int = 1, wan_mbit: float | None = None,
            wan_rtt_ms: float = 0.0) -> ClusterSpec:
    """The shorthand flags' cluster: ``hosts`` split into ``dcs`` contiguous blocks (host
    ``i`` in DC ``i * dcs // hosts``), every NIC at ``nic_mbit``, every DC pair at
    ``wan_mbit`` (None: no cap) and ``wan_rtt_ms``."""
    if hosts < 1 or dcs < 1 or dcs > hosts:
        raise ConfigError(f"need 1 <= dcs <= hosts, got {hosts=} {dcs=}")
    counts = [0] * dcs
    for i in range(hosts):
        counts[i * dcs // hosts] += 1
    return ClusterSpec(
        tuple(DCSpec(f"dc{d}", (nic_mbit,) * n) for d, n in enumerate(counts)),
        {(a, b): DCLink(wan_mbit, wan_rtt_ms) for a, b in itertools.combinations(range(dcs), 2)})


def _problems(spec: ClusterSpec) -> list[str]:
    out = []
    if not 1 <= len(spec.dcs) <= MAX_DCS:
        out.append(f"need 1 to {MAX_DCS} DCs, got {len(spec.dcs)}")
    names = [dc.name for dc in spec.dcs]
    for name in {n for n in names if names.count(n) > 1}:
        out.append(f"DC name {name!r} is used twice")
    for dc in spec.dcs:
        if not 1 <= len(dc.nics_mbit) <= MAX_HOSTS_PER_DC:
            out.append(f"DC {dc.name!r}: need 1 to {MAX_HOSTS_PER_DC} hosts, "
                       f"got {len(dc.nics_mbit)}")
        if not all(_positive(n) for n in dc.nics_mbit):
            out.append(f"DC {dc.name!r}: every NIC rate must be a number > 0 (Mbit/s)")
    pairs = set(itertools.permutations(range(len(spec.dcs)), 2))
    if set(spec.links) != pairs:
        missing = sorted(pairs - set(spec.links))
        extra = sorted(set(spec.links) - pairs)
        out.append(f"links must cover each pair of DCs once: missing {missing}, extra {extra}")
        return out
    for (a, b), link in sorted(spec.links.items()):
        if link.mbit is not None and not _positive(link.mbit):
            out.append(f"link {a}->{b}: mbit must be > 0 (or absent: no cap)")
        if not (math.isfinite(link.rtt_ms) and link.rtt_ms >= 0):
            out.append(f"link {a}->{b}: rtt_ms must be >= 0")
        elif a < b and link.rtt_ms != spec.links[(b, a)].rtt_ms:
            out.append(f"link {a}-{b}: the round trip must be the same both ways, got "
                       f"{link.rtt_ms:g} ms {a}->{b} and {spec.links[(b, a)].rtt_ms:g} ms "
                       f"{b}->{a}")
    seen = set()
    for c in spec.changes:
        if (c.src, c.dst) not in pairs:
            out.append(f"change {c.src}->{c.dst}: not a pair of two different DCs")
            continue
        if not (isinstance(c.at_s, int | float) and math.isfinite(c.at_s) and c.at_s >= 0):
            out.append(f"change {c.src}->{c.dst}: at_s must be >= 0")
        if not _positive(c.mbit):
            out.append(f"change {c.src}->{c.dst}: mbit must be > 0")
        if spec.links[(c.src, c.dst)].mbit is None:
            out.append(f"change {c.src}->{c.dst}: the link has no cap to change")
        if (c.src, c.dst, c.at_s) in seen:
            out.append(f"change {c.src}->{c.dst} at {c.at_s:g} s is given twice")
        seen.add((c.src, c.dst, c.at_s))
    return out


def _positive(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _mbit(mbit: float | None) -> str:
    return "uncapped" if mbit is None else f"{mbit:g} Mbit"


def _rate_at(steps: list[tuple[float, float]], t: float) -> float:
    """The rate of :meth:`ClusterSpec.rate_steps` at time ``t``."""
    return [rate for start, rate in steps if start <= t][-1]


# -- the topology file ----------------------------------------------------------------------

_TOP_KEYS = {"dc", "link", "defaults", "change"}
_DC_KEYS = {"name", "hosts", "nic_mbit"}
_LINK_KEYS = {"between", "from", "to", "mbit", "rtt_ms"}
_CHANGE_KEYS = {"at_s", "between", "from", "to", "mbit"}
_DEFAULT_KEYS = {"wan_mbit", "wan_rtt_ms"}


def load_topology(path: str | Path) -> ClusterSpec:
    """Read a topology file (TOML; format in ``docs/cluster.md``); every problem found is
    reported at once in a :class:`TopologyFileError` naming the file."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise TopologyFileError(f"topology file {path}: {error.strerror or error}") from None
    return parse_topology(text, str(path))


def parse_topology(text: str, where: str = "topology") -> ClusterSpec:
    """A :class:`ClusterSpec` from the text of a topology file (see :func:`load_topology`)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise TopologyFileError(f"{where}: not valid TOML: {error}") from None
    problems: list[str] = []
    _unknown(data, _TOP_KEYS, "top level", problems)
    defaults = _table(data.get("defaults", {}), "[defaults]", problems)
    _unknown(defaults, _DEFAULT_KEYS, "[defaults]", problems)
    dcs = [_dc(i, raw, problems) for i, raw in enumerate(_tables(data, "dc", problems))]
    names = [dc.name for dc in dcs]
    twice = sorted({n for n in names if names.count(n) > 1})
    problems += [f"DC name {name!r} is used twice" for name in twice]
    index = {dc.name: i for i, dc in enumerate(dcs)}
    links: dict[tuple[int, int], DCLink] = {}
    origin: dict[tuple[int, int], str] = {}
    for i, raw in enumerate(_tables(data, "link", problems)):
        where_link = f"[[link]] #{i + 1}"
        _unknown(raw, _LINK_KEYS, where_link, problems)
        pairs = _directions(raw, where_link, index, problems)
        if pairs is None:
            continue
        link = DCLink(_rate(raw, "mbit", where_link, problems),
                      _rtt(raw, "rtt_ms", where_link, problems))
        again = [pair for pair in pairs if pair in links]
        if again:
            x, y = (names[d] for d in again[0])
            problems.append(f"{where_link}: a second link "
                            + (f"between {x!r} and {y!r}" if len(again) == 2
                               else f"from {x!r} to {y!r}")
                            + f" (the first is {origin[again[0]]})")
        for pair in pairs:
            if pair not in again:
                links[pair], origin[pair] = link, where_link
    if not dcs and not problems:
        problems.append("no [[dc]] tables: at least one DC is needed")
    missing = [pair for pair in itertools.permutations(range(len(dcs)), 2)
               if pair not in links]
    if missing and {"wan_mbit", "wan_rtt_ms"} & set(defaults):
        fill = DCLink(_rate(defaults, "wan_mbit", "[defaults]", problems),
                      _rtt(defaults, "wan_rtt_ms", "[defaults]", problems))
        links.update({pair: fill for pair in missing})
        origin.update({pair: "[defaults]" for pair in missing})
    elif missing and not twice:
        said = [f"{dcs[a].name}-{dcs[b].name}" if (b, a) in missing
                else f"{dcs[a].name}->{dcs[b].name}" for a, b in missing
                if a < b or (b, a) not in missing]
        one_way = any("->" in pair for pair in said)
        problems.append(f"no [[link]] for {', '.join(said)} (and no [defaults] wan_mbit / "
                        "wan_rtt_ms)" + ("; a one-way link (from / to) needs one back"
                                         if one_way else ""))
    for a, b in itertools.combinations(range(len(dcs)), 2):
        there, back = links.get((a, b)), links.get((b, a))
        if there is not None and back is not None and there.rtt_ms != back.rtt_ms:
            problems.append(
                f"{origin[(a, b)]} and {origin[(b, a)]}: the round trip between "
                f"{dcs[a].name!r} and {dcs[b].name!r} must be the same both ways, got "
                f"rtt_ms = {there.rtt_ms:g} {dcs[a].name}->{dcs[b].name} and "
                f"{back.rtt_ms:g} {dcs[b].name}->{dcs[a].name}")
    changes = _changes(data, index, links, problems)
    if not problems:
        try:
            return ClusterSpec(tuple(dcs), links, tuple(changes))
        except ConfigError as error:
            problems.append(str(error))
    raise TopologyFileError(f"{where}: " + "; ".join(problems))


def _directions(raw: Mapping[str, Any], where: str, index: Mapping[str, int],
                problems: list[str]) -> list[tuple[int, int]] | None:
    """The directions a ``[[link]]`` or ``[[change]]`` names: ``between = [a, b]`` both
    ways, ``from = a, to = b`` one way; None (with a problem) if it names none."""
    if "between" in raw:
        if "from" in raw or "to" in raw:
            problems.append(f"{where}: give either between = [a, b] or from / to, not both")
            return None
        names = raw["between"]
        if (not isinstance(names, list) or len(names) != 2
                or not all(isinstance(n, str) for n in names)):
            problems.append(f"{where}: between must be two DC names, e.g. "
                            '["east", "west"]')
            return None
    elif "from" in raw and "to" in raw:
        names = [raw["from"], raw["to"]]
        if not all(isinstance(n, str) for n in names):
            problems.append(f"{where}: from and to must be DC names")
            return None
    else:
        problems.append(f"{where}: needs between = [a, b] (both ways), or from and to "
                        "(one way)")
        return None
    unknown = [n for n in names if n not in index]
    if unknown:
        problems.append(f"{where}: no DC named {', '.join(map(repr, unknown))}")
        return None
    a, b = (index[n] for n in names)
    if a == b:
        problems.append(f"{where}: a link joins two different DCs, got {names}")
        return None
    return [(a, b), (b, a)] if "between" in raw else [(a, b)]


def _changes(data: dict[str, Any], index: Mapping[str, int],
             links: Mapping[tuple[int, int], DCLink], problems: list[str]
             ) -> list[LinkChange]:
    """The ``[[change]]`` tables: each a time and a new rate for one or both directions."""
    out: list[LinkChange] = []
    names = {i: n for n, i in index.items()}
    for i, raw in enumerate(_tables(data, "change", problems)):
        where = f"[[change]] #{i + 1}"
        _unknown(raw, _CHANGE_KEYS, where, problems)
        pairs = _directions(raw, where, index, problems)
        at_s = raw.get("at_s")
        if (isinstance(at_s, bool) or not isinstance(at_s, int | float)
                or not (math.isfinite(at_s) and at_s >= 0)):
            problems.append(f"{where}: at_s must be a number >= 0 (seconds after the "
                            "fan-out starts)")
            continue
        if not _positive(raw.get("mbit")):
            problems.append(f"{where}: mbit must be a number > 0 (Mbit/s): the new rate")
            continue
        for src, dst in pairs or []:
            link = links.get((src, dst))
            if link is not None and link.mbit is None:
                problems.append(f"{where}: the link {names[src]}->{names[dst]} has no cap "
                                "(no mbit) to change; give it one")
            elif any((c.src, c.dst, c.at_s) == (src, dst, at_s) for c in out):
                problems.append(f"{where}: a second change of {names[src]}->{names[dst]} "
                                f"at {at_s:g} s")
            else:
                out.append(LinkChange(float(at_s), src, dst, float(raw["mbit"])))
    return out


def _dc(i: int, raw: dict[str, Any], problems: list[str]) -> DCSpec:
    name = raw.get("name")
    where = f"[[dc]] #{i + 1}" + (f" ({name!r})" if isinstance(name, str) else "")
    _unknown(raw, _DC_KEYS, where, problems)
    if not isinstance(name, str) or not name:
        problems.append(f"{where}: needs a name (a non-empty string)")
        name = f"#{i + 1}"
    hosts = raw.get("hosts")
    nics: tuple[float, ...] = ()
    if isinstance(hosts, int) and not isinstance(hosts, bool):
        if not 1 <= hosts <= MAX_HOSTS_PER_DC:
            problems.append(f"{where}: need 1 to {MAX_HOSTS_PER_DC} hosts, got {hosts}")
        elif "nic_mbit" not in raw:
            problems.append(f"{where}: hosts = {hosts} needs nic_mbit (or list each host's "
                            "rate: hosts = [400, 100, ...])")
        elif not _positive(raw["nic_mbit"]):
            problems.append(f"{where}: nic_mbit must be a number > 0 (Mbit/s)")
        else:
            nics = (float(raw["nic_mbit"]),) * hosts
    elif isinstance(hosts, list):
        if "nic_mbit" in raw:
            problems.append(f"{where}: give nic_mbit only with a host count (hosts = 4)")
        bad = [h for h in hosts if not _positive(h)]
        if bad or not 1 <= len(hosts) <= MAX_HOSTS_PER_DC:
            problems.append(f"{where}: hosts must list 1 to {MAX_HOSTS_PER_DC} NIC rates "
                            f"> 0 (Mbit/s){f', got {bad[:3]}' if bad else ''}")
        else:
            nics = tuple(float(h) for h in hosts)
    else:
        problems.append(f"{where}: hosts must be a count (with nic_mbit) or a list of NIC "
                        "rates in Mbit/s")
    return DCSpec(name, nics)


def _rate(raw: Mapping[str, Any], key: str, where: str, problems: list[str]) -> float | None:
    if key not in raw:
        return None
    if not _positive(raw[key]):
        problems.append(f"{where}: {key} must be a number > 0 (Mbit/s), or absent: no cap")
        return None
    return float(raw[key])


def _rtt(raw: Mapping[str, Any], key: str, where: str, problems: list[str]) -> float:
    value = raw.get(key, 0.0)
    if (isinstance(value, bool) or not isinstance(value, int | float)
            or not (math.isfinite(value) and value >= 0)):
        problems.append(f"{where}: {key} must be a number >= 0 (ms)")
        return 0.0
    return float(value)


def _tables(data: dict[str, Any], key: str, problems: list[str]) -> list[dict[str, Any]]:
    value = data.get(key, [])
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        problems.append(f"{key} must be an array of tables: [[{key}]]")
        return []
    return value


def _table(value: Any, where: str, problems: list[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        problems.append(f"{where} must be a table")
        return {}
    return value


def _unknown(raw: Mapping[str, Any], allowed: Iterable[str], where: str,
             problems: list[str]) -> None:
    extra = sorted(set(raw) - set(allowed))
    if extra:
        problems.append(f"{where}: unknown key(s) {', '.join(extra)} "
                        f"(allowed: {', '.join(sorted(allowed))})")


# -- what the router does with it ----------------------------------------------------------


def pair_class(dc: int) -> int:
    """The htb minor class id, on a DC's router leg, of bytes coming from DC ``dc`` (1 is
    the uncapped default class)."""
    return 0x100 + dc


def relay_routes(spec: ClusterSpec, subnet: str) -> list[dict[str, Any]]:
    """The relay's ``--routes``: for each ordered pair of DCs (``<subnet>.<dc>.0/24``) the
    one-way delay, and the ``SO_PRIORITY`` (htb class ``1:pair_class(x)``) of each
    direction's socket: bytes back to the client come from the destination's DC, and
    bytes to the destination from the client's. A direction without a cap gets
    priority 0 (the default class)."""
    routes = []
    for src, dst in itertools.permutations(range(len(spec.dcs)), 2):
        there, back = spec.link(src, dst), spec.link(dst, src)
        routes.append({
            "src": f"{subnet}.{src}.0/24", "dst": f"{subnet}.{dst}.0/24",
            "one_way_ms": there.rtt_ms / 2,
            "to_src_priority": 0 if back.mbit is None else (1 << 16) | pair_class(dst),
            "to_dst_priority": 0 if there.mbit is None else (1 << 16) | pair_class(src),
        })
    return routes


def relay_buffer(spec: ClusterSpec) -> int:
    """Bytes one direction of a relayed connection must be able to hold so the delay line
    never caps a pair's rate: twice rate x one-way delay of the most demanding direction
    (at its fastest, changes included; an uncapped one runs at most at the faster NIC of
    its two DCs)."""
    need = 0.0
    for a, b in itertools.permutations(range(len(spec.dcs)), 2):
        rate = max(r for _, r in spec.rate_steps(a, b))
        nic = max(max(spec.dcs[a].nics_mbit), max(spec.dcs[b].nics_mbit)) * 1e6 / 8
        need = max(need, 2 * min(rate, nic) * spec.link(a, b).rtt_ms / 2000)
    return int(need)


# -- the fluid bound ------------------------------------------------------------------------


def send_time_s(amount: float, steps: Sequence[tuple[float, float]]) -> float:
    """When a pipe has carried ``amount`` bytes, if it runs at ``steps[i][1]`` bytes/s from
    ``steps[i][0]`` seconds on (times ascending, the first 0; the last rate holds for
    ever): with one change at ``t0`` from ``c1`` to ``c2``, the ``T`` with
    ``c1*min(T, t0) + c2*max(0, T - t0) = amount``."""
    carried = 0.0
    for i, (start, rate) in enumerate(steps):
        end = steps[i + 1][0] if i + 1 < len(steps) else math.inf
        if rate == math.inf:
            return start
        if end == math.inf or carried + rate * (end - start) >= amount:
            return start + (amount - carried) / rate
        carried += rate * (end - start)
    raise ValueError("no steps")


def fluid_bound_s(spec: ClusterSpec, size: float) -> float:
    """No schedule sends ``size`` bytes from ``h0`` to every other host faster than this.

    With ``u_i`` / ``d_i`` host ``i``'s upload / download (bytes/s; both its NIC rate),
    ``N`` receivers, ``s = h0``, and ``c(A)`` the capacity of the links *into* a set ``A``
    of DCs not holding ``s`` (the sum of the rates of the links ``b -> a``, ``a`` in
    ``A``, ``b`` not):

        max{ S/u_s,  S/min_i d_i,  N*S/(u_s + sum_i u_i),
             max over A:  S/c(A),  |hosts(A)|*S/(sum_{i in A} u_i + c(A)) }

    Each term is a cut: the source must upload one copy; the slowest receiver must
    download one; all N copies must be uploaded by someone; ``A`` must receive at least
    one copy over its links, and its hosts' N_A copies come from inside ``A`` or over
    them. Heterogeneous NICs enter through ``min d_i`` and the sums, not an average.
    Uncapped links count as infinite. Every subset ``A`` is tried (2^(DCs-1)).

    With :attr:`~ClusterSpec.changes` the cut into ``A`` has a capacity that changes
    over time (:meth:`~ClusterSpec.cut_steps`); its two terms are then the times at which
    that capacity (plus ``sum_{i in A} u_i`` for the second) has carried ``S`` (``N_A*S``)
    bytes (:func:`send_time_s`).
    """
    hosts = spec.hosts
    if len(hosts) < 2:
        return 0.0
    rate = [nic * 1e6 / 8 for _, nic in hosts]
    src_dc, up_s = hosts[0][0], rate[0]
    receivers = rate[1:]
    terms = [size / up_s, size / min(receivers), len(receivers) * size / (up_s + sum(receivers))]
    others = [d for d in range(len(spec.dcs)) if d != src_dc]
    for k in range(1, len(others) + 1):
        for group in itertools.combinations(others, k):
            steps = spec.cut_steps(group)
            members = [r for (d, _), r in zip(hosts, rate, strict=True) if d in group]
            terms.append(send_time_s(size, steps))
            terms.append(send_time_s(len(members) * size,
                                     [(t, sum(members) + c) for t, c in steps]))
    return max(terms)
