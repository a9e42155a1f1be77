"""The same-host transport: a reader on the holder's host copies a chunk straight from
the holder's memory into its own arrays, one copy, no payload on any socket.  Control
messages travel over a Unix socket (:mod:`tensorhub.transport.local`) framed as over TCP
(:mod:`tensorhub.transport.frames`); the holder's server
(:class:`tensorhub.transport.server.TcpServer`) hands same-host requests to this package.

The pieces:

- :mod:`.reader` -- the reader side (:class:`~.reader.ShmConnection`), and the protocol:
  chunk and version leases, the checks that make a copy safe.
- :mod:`.holder` -- the holder side: granting leases, revoking those a reader holds too
  long.
- :mod:`.memory_files` -- shared-memory arrays (:func:`~.memory_files.shared_empty`): memory
  files the holder grants by descriptor and the reader maps read-only.
- :mod:`.process_vm` -- copying another process's plain memory with ``process_vm_readv``
  (arrays not in memory files, and the handshake).
- :mod:`.streaming_copy` -- the copy out of mapped memory files, with non-temporal stores.
- :mod:`.checked_copy` -- the same copy computing the chunk's xxh3-128 as it goes: one
  read of the holder's bytes for the copy and its check.
- :mod:`.loopback` -- showing that a TCP connection's holder is such a process too, so
  its chunks are checked against the fast local digests.

The worker threads the reader copies in are :mod:`tensorhub.transport.copy_threads`,
shared with the TCP reader.
"""
