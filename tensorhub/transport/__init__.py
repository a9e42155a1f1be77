"""The data plane: how a reader gets a version's bytes from a holder.

- :mod:`.base` -- the seam: a reader's ``Connection``, a holder's ``Provider``.
- :mod:`.server` -- the holder's data server (TCP, and a Unix socket for same-host readers).
- :mod:`.tcp` -- the reader over TCP; :mod:`.sockio` its payload calls in threads.
- :mod:`.samehost` -- the same-host transport: copies straight from the holder's memory.
- :mod:`.onesided` -- RDMA READ and CUDA IPC: the reader reads the holder's registered
  memory itself (:mod:`.rdma`, :mod:`.cuda_ipc` the real backends); :mod:`.dial` which
  transports this host can use.
- :mod:`.memory` -- reader and holder in one process, for protocol tests.
- :mod:`.frames` -- the framing every connection speaks; :mod:`.handshake` the mutual
  authentication that opens one; :mod:`.admission` what a server lets a reader have;
  :mod:`.local` the same-host socket and who is on its other end; :mod:`.copy_threads`
  the worker threads readers copy and check in.
"""
