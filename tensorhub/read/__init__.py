"""The read path: how a peer gets a version's bytes, and what it holds and serves.

:mod:`.reader` is the one owner of reads at a peer (connections, link memory, fetches in
flight, counters); the phases it runs follow the pure policy of
:mod:`tensorhub.protocol.reading`: :mod:`.manifests`, :mod:`.planning`, :mod:`.deltas`,
:mod:`.transfer` (the chunks), :mod:`.reshard` and :mod:`.cast`.  :mod:`.store` is what
the peer holds: the reader fills it, the data server serves from it.  The peer above
hands the reader its :mod:`.ports`; nothing here imports :mod:`tensorhub.peer`.
"""
