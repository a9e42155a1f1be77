"""Links between datacenters that an operator declares: the ``[[link]]`` tables.

A peer may be told what the WAN looks like (``PeerConfig.links``; the CLI's ``--links
FILE``).  The shape is the topology files' (``docs/cluster.md``), so one file serves the
emulated cluster and the real peers::

    [[link]]
    between = ["east", "west"]   # both ways alike
    mbit = 300                   # Mbit/s each way; absent: not declared (no cap known)
    rtt_ms = 40                  # the round trip the link adds

    [[link]]
    from = "east"                # one way only (asymmetric links: one table per way)
    to = "south"
    mbit = 40
    rtt_ms = 150

Other tables of the file (``[[dc]]``, ``[defaults]``) are the emulator's and are ignored
here.  Declared values are where the planner starts, not the truth: peers measure the
links they use and the estimates they gossip replace what was declared
(:mod:`tensorhub.protocol.wan`).
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .bounds import MAX_LABEL_VALUE
from .errors import ConfigError

MAX_DECLARED_LINKS = 4096
"""Directed links one peer may be told of (64 DCs, every ordered pair)."""
MAX_LINK_BPS = 1e13
"""80 Tbit/s: far above any inter-DC link; a larger figure is a typo."""
MAX_LINK_RTT_S = 10.0

_KEYS = {"between", "from", "to", "mbit", "rtt_ms"}


@dataclass(frozen=True)
class LinkSpec:
    """One direction of a link between two DCs: ``src -> dst`` at ``bps`` bytes/s, adding
    ``rtt_s`` to a round trip."""

    src: str
    dst: str
    bps: float
    rtt_s: float = 0.0

    def __post_init__(self) -> None:
        for dc in (self.src, self.dst):
            if not isinstance(dc, str) or not 0 < len(dc) <= MAX_LABEL_VALUE:
                raise ConfigError(f"a link joins two DC names (1..{MAX_LABEL_VALUE} "
                                  f"characters), got {dc!r}")
        if self.src == self.dst:
            raise ConfigError(f"a link joins two different DCs, got {self.src!r} twice")
        if not (isinstance(self.bps, int | float) and math.isfinite(self.bps)
                and 0 < self.bps <= MAX_LINK_BPS):
            raise ConfigError(f"link {self.src}->{self.dst}: rate must be in "
                              f"(0, {MAX_LINK_BPS:g}] bytes/s, got {self.bps!r}")
        if not (isinstance(self.rtt_s, int | float) and math.isfinite(self.rtt_s)
                and 0 <= self.rtt_s <= MAX_LINK_RTT_S):
            raise ConfigError(f"link {self.src}->{self.dst}: round trip must be in "
                              f"[0, {MAX_LINK_RTT_S:g}] s, got {self.rtt_s!r}")


def check_links(links: Sequence[LinkSpec]) -> None:
    """Raise :class:`ConfigError` unless ``links`` is a tuple of at most
    :data:`MAX_DECLARED_LINKS` :class:`LinkSpec` with each direction given once."""
    if not isinstance(links, tuple):
        raise ConfigError(f"links must be a tuple of LinkSpec, got {type(links).__name__}")
    if len(links) > MAX_DECLARED_LINKS:
        raise ConfigError(f"at most {MAX_DECLARED_LINKS} declared links, got {len(links)}")
    seen: set[tuple[str, str]] = set()
    for link in links:
        if not isinstance(link, LinkSpec):
            raise ConfigError(f"links must hold LinkSpec values, got {link!r}")
        if (link.src, link.dst) in seen:
            raise ConfigError(f"link {link.src}->{link.dst} is declared twice")
        seen.add((link.src, link.dst))


def parse_links(tables: object, where: str = "links") -> tuple[LinkSpec, ...]:
    """The :class:`LinkSpec` of a list of ``[[link]]`` tables (see the module docstring);
    every problem is reported at once in a :class:`ConfigError` naming ``where``."""
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise ConfigError(f"{where}: link must be an array of tables: [[link]]")
    out: list[LinkSpec] = []
    problems: list[str] = []
    for i, raw in enumerate(tables):
        out += _one(raw, f"{where}: [[link]] #{i + 1}", problems)
    if not problems:
        try:
            check_links(tuple(out))
        except ConfigError as error:
            problems.append(f"{where}: {error}")
    if problems:
        raise ConfigError("; ".join(problems))
    return tuple(out)


def load_links(path: str | Path) -> tuple[LinkSpec, ...]:
    """The ``[[link]]`` tables of a TOML file (a topology file will do)."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as error:
        raise ConfigError(f"links file {path}: {error.strerror or error}") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"links file {path}: not valid TOML: {error}") from None
    return parse_links(data.get("link", []), str(path))


def _one(raw: Mapping[str, Any], where: str, problems: list[str]) -> list[LinkSpec]:
    extra = sorted(set(raw) - _KEYS)
    if extra:
        problems.append(f"{where}: unknown key(s) {', '.join(extra)} "
                        f"(allowed: {', '.join(sorted(_KEYS))})")
        return []
    if "between" in raw:
        if "from" in raw or "to" in raw:
            problems.append(f"{where}: give either between = [a, b] or from / to, not both")
            return []
        between = raw["between"]
        if (not isinstance(between, list) or len(between) != 2
                or not all(isinstance(n, str) and n for n in between)):
            problems.append(f'{where}: between must be two DC names, e.g. ["east", "west"]')
            return []
        pairs = [(between[0], between[1]), (between[1], between[0])]
    elif "from" in raw and "to" in raw:
        a, b = raw["from"], raw["to"]
        if not (isinstance(a, str) and a and isinstance(b, str) and b):
            problems.append(f"{where}: from and to must be DC names")
            return []
        pairs = [(a, b)]
    else:
        problems.append(f"{where}: needs between = [a, b], or from and to")
        return []
    mbit, rtt = raw.get("mbit"), raw.get("rtt_ms", 0.0)
    if mbit is None:
        return []  # no rate: nothing declared (the emulator reads it as no cap)
    if isinstance(mbit, bool) or not isinstance(mbit, int | float):
        problems.append(f"{where}: mbit must be a number > 0 (Mbit/s)")
        return []
    if isinstance(rtt, bool) or not isinstance(rtt, int | float):
        problems.append(f"{where}: rtt_ms must be a number >= 0 (ms)")
        return []
    try:
        return [LinkSpec(a, b, float(mbit) * 1e6 / 8, float(rtt) / 1000) for a, b in pairs]
    except ConfigError as error:
        problems.append(f"{where}: {error}")
        return []
