"""What an emulated cluster looks like: datacenters, hosts' NIC rates, links between DCs.

Theory of operation
-------------------
A :class:`ClusterSpec` is the plain description :func:`~tensorhub.testing.netns.open_topology`
builds: DCs in order, each a list of hosts given by their NIC rate (Mbit/s, both ways),
and one :class:`DCLink` per pair of DCs with its rate (Mbit/s each way, or no cap) and the
round trip it adds (ms). Hosts are numbered across DCs in order: ``h0`` is the first host
of the first DC (the trainer, or the holder, by convention).

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
from collections.abc import Iterable, Mapping
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
    """The link between two DCs: a cap each way (Mbit/s; None: none) and the round trip
    it adds (ms; half of it each way)."""

    mbit: float | None
    rtt_ms: float

    @property
    def bytes_per_s(self) -> float:
        return math.inf if self.mbit is None else self.mbit * 1e6 / 8


@dataclass(frozen=True)
class ClusterSpec:
    """DCs in order (host numbering follows it) and a link for every pair of DCs."""

    dcs: tuple[DCSpec, ...]
    links: Mapping[tuple[int, int], DCLink]
    """Keyed by ``(a, b)`` with ``a < b``: DC indices."""

    def __post_init__(self) -> None:
        problems = _problems(self)
        if problems:
            raise ConfigError("; ".join(problems))

    @property
    def hosts(self) -> list[tuple[int, float]]:
        """``(dc, nic_mbit)`` of every host in order: ``h0`` first."""
        return [(d, nic) for d, dc in enumerate(self.dcs) for nic in dc.nics_mbit]

    def link(self, a: int, b: int) -> DCLink:
        """The link between DCs ``a`` and ``b`` (either order)."""
        return self.links[(min(a, b), max(a, b))]

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
        for (a, b), link in sorted(self.links.items()):
            rate = "uncapped" if link.mbit is None else f"{link.mbit:g} Mbit"
            parts.append(f"{self.dcs[a].name}-{self.dcs[b].name}: {rate}, "
                         f"{link.rtt_ms:g} ms rtt")
        return "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """The spec as JSON-able data (the settings of a run)."""
        return {"dcs": [{"name": dc.name, "hosts_mbit": list(dc.nics_mbit)}
                        for dc in self.dcs],
                "links": [{"between": [self.dcs[a].name, self.dcs[b].name],
                           "mbit": link.mbit, "rtt_ms": link.rtt_ms}
                          for (a, b), link in sorted(self.links.items())]}


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
    pairs = set(itertools.combinations(range(len(spec.dcs)), 2))
    if set(spec.links) != pairs:
        missing = sorted(pairs - set(spec.links))
        extra = sorted(set(spec.links) - pairs)
        out.append(f"links must cover each pair of DCs once: missing {missing}, extra {extra}")
    for (a, b), link in spec.links.items():
        if link.mbit is not None and not _positive(link.mbit):
            out.append(f"link {a}-{b}: mbit must be > 0 (or absent: no cap)")
        if not (math.isfinite(link.rtt_ms) and link.rtt_ms >= 0):
            out.append(f"link {a}-{b}: rtt_ms must be >= 0")
    return out


def _positive(x: float) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x > 0


# -- the topology file ----------------------------------------------------------------------

_TOP_KEYS = {"dc", "link", "defaults"}
_DC_KEYS = {"name", "hosts", "nic_mbit"}
_LINK_KEYS = {"between", "mbit", "rtt_ms"}
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
    for i, raw in enumerate(_tables(data, "link", problems)):
        where_link = f"[[link]] #{i + 1}"
        _unknown(raw, _LINK_KEYS, where_link, problems)
        between = raw.get("between")
        if (not isinstance(between, list) or len(between) != 2
                or not all(isinstance(n, str) for n in between)):
            problems.append(f"{where_link}: between must be two DC names, e.g. "
                            '["east", "west"]')
            continue
        unknown = [n for n in between if n not in index]
        if unknown:
            problems.append(f"{where_link}: no DC named {', '.join(map(repr, unknown))}")
            continue
        a, b = sorted(index[n] for n in between)
        if a == b:
            problems.append(f"{where_link}: a link joins two different DCs, got {between}")
            continue
        if (a, b) in links:
            problems.append(f"{where_link}: a second link between {between[0]!r} and "
                            f"{between[1]!r}")
            continue
        links[(a, b)] = DCLink(_rate(raw, "mbit", where_link, problems),
                               _rtt(raw, "rtt_ms", where_link, problems))
    if not dcs and not problems:
        problems.append("no [[dc]] tables: at least one DC is needed")
    missing = [(a, b) for a, b in itertools.combinations(range(len(dcs)), 2)
               if (a, b) not in links]
    if missing and {"wan_mbit", "wan_rtt_ms"} & set(defaults):
        fill = DCLink(_rate(defaults, "wan_mbit", "[defaults]", problems),
                      _rtt(defaults, "wan_rtt_ms", "[defaults]", problems))
        links.update({pair: fill for pair in missing})
    elif missing and not twice:
        pairs = ", ".join(f"{dcs[a].name}-{dcs[b].name}" for a, b in missing)
        problems.append(f"no [[link]] for {pairs} (and no [defaults] wan_mbit / wan_rtt_ms)")
    if not problems:
        try:
            return ClusterSpec(tuple(dcs), links)
        except ConfigError as error:
            problems.append(str(error))
    raise TopologyFileError(f"{where}: " + "; ".join(problems))


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
    bytes to the destination from the client's. Uncapped pairs get priority 0."""
    routes = []
    for src, dst in itertools.permutations(range(len(spec.dcs)), 2):
        link = spec.link(src, dst)
        routes.append({
            "src": f"{subnet}.{src}.0/24", "dst": f"{subnet}.{dst}.0/24",
            "one_way_ms": link.rtt_ms / 2,
            "to_src_priority": 0 if link.mbit is None else (1 << 16) | pair_class(dst),
            "to_dst_priority": 0 if link.mbit is None else (1 << 16) | pair_class(src),
        })
    return routes


def relay_buffer(spec: ClusterSpec) -> int:
    """Bytes one direction of a relayed connection must be able to hold so the delay line
    never caps a pair's rate: twice rate x one-way delay of the most demanding pair (an
    uncapped pair runs at most at the faster NIC of its two DCs)."""
    need = 0.0
    for a, b in itertools.combinations(range(len(spec.dcs)), 2):
        link = spec.link(a, b)
        nic = max(max(spec.dcs[a].nics_mbit), max(spec.dcs[b].nics_mbit)) * 1e6 / 8
        need = max(need, 2 * min(link.bytes_per_s, nic) * link.rtt_ms / 2000)
    return int(need)


# -- the fluid bound ------------------------------------------------------------------------


def fluid_bound_s(spec: ClusterSpec, size: float) -> float:
    """No schedule sends ``size`` bytes from ``h0`` to every other host faster than this.

    With ``u_i`` / ``d_i`` host ``i``'s upload / download (bytes/s; both its NIC rate),
    ``N`` receivers, ``s = h0``, and ``c(A)`` the capacity of the links into a set ``A``
    of DCs not holding ``s`` (the sum of the rates of links between ``A`` and the rest):

        max{ S/u_s,  S/min_i d_i,  N*S/(u_s + sum_i u_i),
             max over A:  S/c(A),  |hosts(A)|*S/(sum_{i in A} u_i + c(A)) }

    Each term is a cut: the source must upload one copy; the slowest receiver must
    download one; all N copies must be uploaded by someone; ``A`` must receive at least
    one copy over its links, and its hosts' N_A copies come from inside ``A`` or over
    them. Heterogeneous NICs enter through ``min d_i`` and the sums, not an average.
    Uncapped links count as infinite. Every subset ``A`` is tried (2^(DCs-1)).
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
            inside = set(group)
            cut = sum(spec.link(a, b).bytes_per_s for a in inside
                      for b in range(len(spec.dcs)) if b not in inside)
            members = [r for (d, _), r in zip(hosts, rate, strict=True) if d in inside]
            terms.append(size / cut)
            terms.append(len(members) * size / (sum(members) + cut))
    return max(terms)
